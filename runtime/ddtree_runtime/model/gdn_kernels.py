"""Fused Triton kernels around the Gated DeltaNet tree pass on CUDA (the torch path serves everything else).

Why: in torch a linear layer's tree pass is ~60 small kernels; replayed from a CUDA graph each still
costs microseconds, so the 48 linear layers of a Qwen3.6-27B pass spend milliseconds on launches alone.
Two of the elementwise stretches fold into one kernel each: the path-gathered causal conv + SiLU + the
split into q/k/v + L2 normalisation (+ q's scale), and the output's RMSNorm gated by SiLU(z).
The commit's state advance is one more: the recurrent state is the largest tensor a commit touches
(~151 MB a request at Qwen3.6-27B), and torch reads and writes it twice (the decay, then the rank-P
update) besides the gathers; the kernel reads each tile once and writes it once.
The verify's recurrence itself (gated_delta) is one more: in torch it is float32 batched GEMMs against
the state (k S0, q S0: the state read twice), [B, H, T, T] temporaries and a batched triangular solve;
`tree_delta` does a (sequence, head)'s whole tree in one program, reading the state once.
Numerics: the conv sums in float32 (the torch path sums in the model dtype); the gated norm rounds where
the torch path does; the state advance is float32 throughout, as in torch (summed in path order); the tree verify's products run
at TreeDeltaLaunch.precision (three TF32 products by default: float32's error, on the tensor cores)."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from .kernels import _pow2, _use_triton, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _conv_taps(mixed_ptr, state_ptr, w_ptr, ext, from_state, ch, s_mix, C, KM1, K: tl.constexpr):
        # the K taps of channels `ch` along one node's path (rows of the conv state, then of the new inputs)
        # and their weights, as loaded
        taps = tl.arange(0, K)
        x_old = tl.load(state_ptr + ext[:, None] * C + ch[None, :], mask=from_state[:, None], other=0.0)
        x_new = tl.load(mixed_ptr + (ext - KM1)[:, None] * s_mix + ch[None, :], mask=~from_state[:, None],
                        other=0.0)
        return x_old, x_new, tl.load(w_ptr + ch[None, :] * K + taps[:, None])

    @triton.jit
    def _conv_silu(loaded):
        x_old, x_new, w = loaded
        y = tl.sum((x_old.to(tl.float32) + x_new.to(tl.float32)) * w.to(tl.float32), axis=0)
        return y * tl.sigmoid(y)

    @triton.jit
    def _conv_heads_kernel(mixed_ptr, state_ptr, w_ptr, win_ptr, q_ptr, k_ptr, v_ptr, keep_ptr, s_mixb, s_mix,
                           s_win, s_kb, s_kh, s_keepb, T, C, KM1, HV, q_scale, NK: tl.constexpr,
                           GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_T: tl.constexpr, DK: tl.constexpr,
                           DV: tl.constexpr, K: tl.constexpr, KEEP: tl.constexpr):
        # BLOCK_T nodes of one sequence for HEADS value heads: a key head's GROUP (its q and k made once
        # a node for all of them) or one (q and k made again by each of the group). A node's loads all
        # come before its first store, which they could alias: one round trip to memory, not one a head.
        # Each head's vectors are the same [K, D] tiles and reductions whatever the grid (ConvHeadsLaunch)
        tb, unit, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)   # node block, heads, sequence
        h0 = unit * HEADS
        kh = h0 // GROUP
        mixed_ptr += b * s_mixb
        state_ptr += b * KM1 * C
        q_ptr += b * HV * T * DK
        k_ptr += b * s_kb
        v_ptr += b * HV * T * DV
        win_ptr += b * s_win
        keep_ptr += b * s_keepb
        dk = tl.arange(0, DK)
        dv = tl.arange(0, DV)
        q_ch = kh * DK + dk
        for i in tl.static_range(BLOCK_T):
            t = tl.minimum(tb * BLOCK_T + i, T - 1)   # past the tree, the last node again: no branch
            ext = tl.load(win_ptr + t * K + tl.arange(0, K))
            from_state = ext < KM1
            q_in = _conv_taps(mixed_ptr, state_ptr, w_ptr, ext, from_state, q_ch, s_mix, C, KM1, K)
            k_in = _conv_taps(mixed_ptr, state_ptr, w_ptr, ext, from_state, NK + q_ch, s_mix, C, KM1, K)
            v_in = ()
            for j in tl.static_range(HEADS):
                v_ch = 2 * NK + (h0 + j) * DV + dv
                v_in = v_in + (_conv_taps(mixed_ptr, state_ptr, w_ptr, ext, from_state, v_ch, s_mix, C, KM1, K),)
            q = _conv_silu(q_in)
            k = _conv_silu(k_in)
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            for j in tl.static_range(HEADS):
                tl.store(q_ptr + ((h0 + j) * T + t) * DK + dk, q)
                tl.store(k_ptr + (h0 + j) * s_kh + t * DK + dk, k)
                tl.store(v_ptr + ((h0 + j) * T + t) * DV + dv, _conv_silu(v_in[j]))
            if KEEP:  # the node's own input row, each channel by one program: q, k by the group's first head
                row = mixed_ptr + t * s_mix
                keep_row = keep_ptr + t * C
                for j in tl.static_range(HEADS):
                    v_ch = 2 * NK + (h0 + j) * DV + dv
                    tl.store(keep_row + v_ch, tl.load(row + v_ch))
                if h0 % GROUP == 0:
                    tl.store(keep_row + q_ch, tl.load(row + q_ch))
                    tl.store(keep_row + NK + q_ch, tl.load(row + NK + q_ch))

    @triton.jit
    def _gated_norm_kernel(core_ptr, z_ptr, w_ptr, out_ptr, s_zb, s_z, T, H, eps, DV: tl.constexpr):
        t, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # node, value head, sequence
        core_ptr += b * H * T * DV
        z_ptr += b * s_zb
        out_ptr += b * T * H * DV
        d = tl.arange(0, DV)
        ty = out_ptr.dtype.element_ty
        x = tl.load(core_ptr + (h * T + t) * DV + d).to(ty).to(tl.float32)   # the output, in the model dtype
        n = (x * tl.rsqrt(tl.sum(x * x, axis=0) / DV + eps)).to(ty).to(tl.float32)
        y = (tl.load(w_ptr + d).to(tl.float32) * n).to(ty).to(tl.float32)
        z = tl.load(z_ptr + t * s_z + h * DV + d).to(tl.float32)
        tl.store(out_ptr + (t * H + h) * DV + d, (y * z * tl.sigmoid(z)).to(ty))

    @triton.jit
    def _advance_kernel(state_ptr, k_ptr, u_ptr, g_ptr, nodes_ptr, length_ptr,
                        s_sn, s_sb, s_sh, s_sk, s_sv, s_kn, s_kb, s_kh, s_kt, s_kd, s_un, s_ub, s_uh, s_ut, s_ud,
                        s_gn, s_gb, s_gh, s_gt, s_nb, s_np, s_len, B, H,
                        DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        # one [BLOCK_K, BLOCK_V] tile of one (layer, sequence, head)'s state: read once, advanced along
        # the sequence's whole path, written once
        pid = tl.program_id(0)
        h = (pid % H).to(tl.int64)
        b = ((pid // H) % B).to(tl.int64)
        layer = (pid // (H * B)).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        in_rows, in_cols = rows < DK, cols < DV
        nodes_ptr += b * s_nb
        k_ptr += layer * s_kn + b * s_kb + h * s_kh + rows * s_kd
        u_ptr += layer * s_un + b * s_ub + h * s_uh + cols * s_ud
        g_ptr += layer * s_gn + b * s_gb + h * s_gh
        length = tl.load(length_ptr + b * s_len)
        last = tl.load(g_ptr + tl.load(nodes_ptr + (length - 1) * s_np) * s_gt)   # G at the path's end
        tile = (state_ptr + layer * s_sn + b * s_sb + h * s_sh
                + rows[:, None] * s_sk + cols[None, :] * s_sv)
        in_tile = in_rows[:, None] & in_cols[None, :]
        acc = tl.load(tile, mask=in_tile, other=0.0) * tl.exp(last)
        for p in range(0, length):
            node = tl.load(nodes_ptr + p * s_np)
            w = tl.exp(last - tl.load(g_ptr + node * s_gt))
            k = tl.load(k_ptr + node * s_kt, mask=in_rows, other=0.0) * w
            u = tl.load(u_ptr + node * s_ut, mask=in_cols, other=0.0)
            acc += k[:, None] * u[None, :]
        tl.store(tile, acc, mask=in_tile)

    @triton.jit
    def _conv_tail_kernel(conv_ptr, inputs_ptr, nodes_ptr, length_ptr, s_cn, s_cb, s_ck, s_in, s_ib, s_it,
                          s_nb, s_np, s_len, B, C, K1: tl.constexpr, K1P: tl.constexpr, BLOCK: tl.constexpr):
        # one (layer, sequence) and BLOCK channels: the K-1 inputs that end [old tail | accepted path], each
        # from where it lies (slot j is position length + j of that concatenation: the old tail's slot, or
        # the path's node's input in the tree pass's scratch), all read before the tail is written over
        pid = tl.program_id(0)
        layer = (pid // B).to(tl.int64)
        b = (pid % B).to(tl.int64)
        ch = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        j = tl.arange(0, K1P)
        keep = tl.load(length_ptr + b * s_len) + j
        slot = j < K1
        on_path = slot & (keep >= K1)
        node = tl.load(nodes_ptr + b * s_nb + (keep - K1) * s_np, mask=on_path, other=0)
        live = slot[:, None] & (ch < C)[None, :]
        tail = conv_ptr + layer * s_cn + b * s_cb
        new = tl.load(inputs_ptr + layer * s_in + b * s_ib + node[:, None] * s_it + ch[None, :],
                      mask=live & on_path[:, None], other=0.0)
        old = tl.load(tail + keep[:, None] * s_ck + ch[None, :], mask=live & ~on_path[:, None], other=0.0)
        tail_in = tl.where(on_path[:, None], new, old)
        tl.debug_barrier()   # another thread may read slot j as an older slot of its own: every read lands first
        tl.store(tail + j[:, None] * s_ck + ch[None, :], tail_in, mask=live)

    @triton.jit
    def _tree_gates(g, beta, beta_ty, a_log_ptr, dt_bias_ptr, h, RAW_GATES: tl.constexpr):
        # beta and g of any shape; RAW_GATES: from the in-projection's b and a columns, as
        # GatedDeltaNet.forward makes them in torch: the sigmoid rounded to the model dtype;
        # softplus(x) = log1p(e^x) (x <= 20), in float32
        if RAW_GATES:
            beta = tl.sigmoid(beta).to(beta_ty).to(tl.float32)
            x = g + tl.load(dt_bias_ptr + h).to(tl.float32)
            e = tl.exp(tl.minimum(x, 20.0))
            softplus = tl.where(x > 20.0, x, tl.where(e < 1e-4, e * (1.0 - 0.5 * e), tl.log(1.0 + e)))
            g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus
        return g, beta

    # T follows the tree: not specialised on (one compile for every tree size up to a block)
    @triton.jit(do_not_specialize=["T"])
    def _tree_delta_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, state_ptr, mask_ptr,
                           out_ptr, u_ptr, sum_ptr, s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kt, s_kd,
                           s_vb, s_vh, s_vt, s_vd, s_gb, s_gh, s_gt, s_bb, s_bh, s_bt, s_sb, s_sh, s_sk, s_sv,
                           s_mb, s_mi, s_mj, s_ub, s_uh, s_ut, s_ud, s_Gb, s_Gh, s_Gt, T, H,
                           DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, LOG_BT: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr, HAS_STATE: tl.constexpr, RAW_GATES: tl.constexpr,
                           PRECISION: tl.constexpr, OUT_PRECISION: tl.constexpr, SQUARING: tl.constexpr,
                           PEEL: tl.constexpr):
        # one (sequence, value head)'s whole tree for BV columns of dv: the state's [dk, BV] columns read
        # once, everything else [BT, BT] or [BT, BV] in registers. PRECISION for the products that make u
        # (the commit folds u into the state, so its error stays); OUT_PRECISION for those that only make
        # this pass's output (q k^T, q S0 and the last product), which leaves the layer in 16 bits.
        # PEEL: node 0 (the root: ancestors come first, so it has none) is taken apart, and the blocks hold
        # nodes 1..T-1: a 17-node tree in blocks of 16, not 32. Its terms in the others' are rank one:
        # u_0 = beta_0 (v_0 - e^G_0 k_0 S0), then each node i below it sees e^(G_i - G_0) (k_i . k_0) u_0
        # in its right-hand side and e^(G_i - G_0) (q_i . k_0) u_0 in its output. Its products ride the
        # blocks' dots: a [BT, BK] block whose row 0 is k_0 and row 1 q_0 (the rest zero), so k_i . k_0,
        # q_i . k_0, k_0 S0 and q_0 S0 are a column or a row of three more dots, picked out once after
        # the dk loop (summing them as vectors chunk by chunk crossed threads at every chunk)
        pid = tl.program_id(0)
        b = (pid // H).to(tl.int64)
        h = (pid % H).to(tl.int64)
        cols = tl.program_id(1) * BV + tl.arange(0, BV)
        node = tl.arange(0, BT) + (1 if PEEL else 0)
        live = node < T
        on_path = tl.load(mask_ptr + b * s_mb + node[:, None] * s_mi + node[None, :] * s_mj,
                          mask=live[:, None] & live[None, :], other=0) != 0      # [i, j]: j is i or an ancestor
        g = tl.load(g_ptr + b * s_gb + h * s_gh + node * s_gt, mask=live, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + b * s_bb + h * s_bh + node * s_bt, mask=live, other=0.0).to(tl.float32)
        g, beta = _tree_gates(g, beta, beta_ptr.dtype.element_ty, a_log_ptr, dt_bias_ptr, h, RAW_GATES)
        pathsum = tl.sum(tl.where(on_path, g[None, :], 0.0), axis=1)            # G_i over i's path
        if PEEL:
            below = tl.load(mask_ptr + b * s_mb + node * s_mi, mask=live, other=0) != 0   # the root is i's ancestor
            g0 = tl.load(g_ptr + b * s_gb + h * s_gh).to(tl.float32)
            beta0 = tl.load(beta_ptr + b * s_bb + h * s_bh).to(tl.float32)
            g0, beta0 = _tree_gates(g0, beta0, beta_ptr.dtype.element_ty, a_log_ptr, dt_bias_ptr, h, RAW_GATES)
            pathsum += tl.where(below, g0, 0.0)
            from_root = tl.where(below, tl.exp(pathsum - g0), 0.0)               # e^(G_i - G_0), or 0
            pair = tl.arange(0, BT)                                              # the root block's rows
            k_row = pair == 0                                                    # k_0's row (q_0's is 1)
            kk0 = tl.zeros([BT, BT], dtype=tl.float32)                           # column 0: k_i . k_0
            qk0 = tl.zeros([BT, BT], dtype=tl.float32)                           # column 0: q_i . k_0
            rs = tl.zeros([BT, BV], dtype=tl.float32)                            # rows 0, 1: k_0 S0, q_0 S0
        decay = tl.exp(tl.where(on_path, pathsum[:, None] - pathsum[None, :], float("-inf")))
        kk = tl.zeros([BT, BT], dtype=tl.float32)
        qk = tl.zeros([BT, BT], dtype=tl.float32)
        ks = tl.zeros([BT, BV], dtype=tl.float32)
        qs = tl.zeros([BT, BV], dtype=tl.float32)
        for c in range(0, DK, BK):   # a loop, not unrolled: a quarter of the compile time (issue 38)
            d = c + tl.arange(0, BK)
            kc = tl.load(k_ptr + b * s_kb + h * s_kh + node[:, None] * s_kt + d[None, :] * s_kd,
                         mask=live[:, None], other=0.0)
            qc = tl.load(q_ptr + b * s_qb + h * s_qh + node[:, None] * s_qt + d[None, :] * s_qd,
                         mask=live[:, None], other=0.0)
            kk += tl.dot(kc, tl.trans(kc), input_precision=PRECISION)
            qk += tl.dot(qc, tl.trans(kc), input_precision=OUT_PRECISION)
            if PEEL:
                root = tl.where(k_row, k_ptr + b * s_kb + h * s_kh, q_ptr + b * s_qb + h * s_qh)
                kq0 = tl.load(root[:, None] + d[None, :] * tl.where(k_row, s_kd, s_qd)[:, None],
                              mask=(pair < 2)[:, None], other=0.0)
                kk0 += tl.dot(kc, tl.trans(kq0), input_precision=PRECISION)
                qk0 += tl.dot(qc, tl.trans(kq0), input_precision=OUT_PRECISION)
            if HAS_STATE:
                s0 = tl.load(state_ptr + b * s_sb + h * s_sh + d[:, None] * s_sk + cols[None, :] * s_sv)
                ks += tl.dot(kc, s0, input_precision=PRECISION)
                qs += tl.dot(qc, s0, input_precision=OUT_PRECISION)
                if PEEL:
                    rs += tl.dot(kq0, s0, input_precision=PRECISION)
        strict = on_path & (node[:, None] != node[None, :])
        a = tl.where(strict, kk * decay * beta[:, None], 0.0)
        v = tl.load(v_ptr + b * s_vb + h * s_vh + node[:, None] * s_vt + cols[None, :] * s_vd,
                    mask=live[:, None], other=0.0)
        grow = tl.exp(pathsum)[:, None]
        if HAS_STATE:
            v = v - grow * ks
        if PEEL:
            kk0 = tl.sum(tl.where(k_row[None, :], kk0, 0.0), axis=1)
            qk0 = tl.sum(tl.where(k_row[None, :], qk0, 0.0), axis=1)
            dk = tl.arange(0, DK)
            q0 = tl.load(q_ptr + b * s_qb + h * s_qh + dk * s_qd)
            q0k0 = tl.sum(q0 * tl.load(k_ptr + b * s_kb + h * s_kh + dk * s_kd), axis=0)
            u0 = tl.load(v_ptr + b * s_vb + h * s_vh + cols * s_vd)
            if HAS_STATE:
                u0 = u0 - tl.exp(g0) * tl.sum(tl.where(k_row[:, None], rs, 0.0), axis=0)
                q0s = tl.sum(tl.where((pair == 1)[:, None], rs, 0.0), axis=0)
            u0 = beta0 * u0
            v = v - (from_root * kk0)[:, None] * u0[None, :]
        rhs = beta[:, None] * v
        # u = (I + A)^-1 rhs, A strictly lower triangular (ancestors first)
        if SQUARING:
            # A^(depth + 1) = 0 (A_ij links j to its descendant i), so (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...
            # up to the first power past the tree's depth: at most log2(BT) - 1 squarings (a chain), fewer
            # for a bushy tree, and no T-long chain of steps; but its terms grow where keys along a path
            # align (beta near 1), and cancel: errors up to ~1e-5 of the output where the substitution
            # keeps ~1e-7
            depth = tl.max(tl.sum(on_path.to(tl.int32), axis=1), axis=0) - 1   # the deepest node's ancestors
            u = rhs - tl.dot(a, rhs, input_precision=PRECISION)
            power = a
            span = 2   # u holds the terms A^0 .. A^(span - 1)
            for _ in range(LOG_BT - 1):
                if span <= depth:
                    power = tl.dot(power, power, input_precision=PRECISION)
                    u += tl.dot(power, u, input_precision=PRECISION)
                span *= 2
        else:  # forward substitution, a node at a time: u_i = rhs_i - sum_j A_ij u_j
            u = tl.zeros([BT, BV], dtype=tl.float32)
            for i in range(0, T):
                row = (node == i)[:, None]
                a_i = tl.sum(tl.where(row, a, 0.0), axis=0)                   # A[i, :], over j
                u_i = tl.sum(tl.where(row, rhs, 0.0), axis=0) - tl.sum(a_i[:, None] * u, axis=0)
                u = tl.where(row, u_i[None, :], u)
        out = tl.dot(qk * decay, u, input_precision=OUT_PRECISION)
        if HAS_STATE:
            out += grow * qs
        if PEEL:
            out += (from_root * qk0)[:, None] * u0[None, :]
            out0 = q0k0 * u0
            if HAS_STATE:
                out0 += tl.exp(g0) * q0s
            tl.store(out_ptr + (b * H + h) * T * DV + cols, out0)
            tl.store(u_ptr + b * s_ub + h * s_uh + cols * s_ud, u0)
        tl.store(out_ptr + ((b * H + h) * T + node[:, None]) * DV + cols[None, :], out, mask=live[:, None])
        tl.store(u_ptr + b * s_ub + h * s_uh + node[:, None] * s_ut + cols[None, :] * s_ud, u, mask=live[:, None])
        if tl.program_id(1) == 0:
            tl.store(sum_ptr + b * s_Gb + h * s_Gh + node * s_Gt, pathsum, mask=live)
            if PEEL:
                tl.store(sum_ptr + b * s_Gb + h * s_Gh, g0)


def fused_fits(mixed: torch.Tensor, dk: int, dv: int, kernel: int) -> bool:
    """On CUDA, power-of-two head dims and conv width (the Qwen3.5/3.6 shapes)."""
    return (_use_triton(mixed) and mixed.stride(-1) == 1
            and all(map(_pow2, (dk, dv, kernel))))


class ConvHeadsLaunch(NamedTuple):
    """A program per (`nodes` nodes, key head, sequence) that makes the key head's q and k once for all its
    value heads (`per_key`), else one per (`nodes` nodes, value head, sequence) making them again for each
    (the grid before: 3x the programs and the q/k work at the 27B's 48/16 heads); `warps` a program.
    At 4 warps each head gets the same [K, D] tiles, layouts and reductions as the kernel before, so the
    same bits (gdn_tree_bench.py compares them on the GPU); other warps lay the vectors out differently,
    and their sums may round differently."""
    per_key: bool = True
    nodes: int = 1
    warps: int = 4


# The launch the layers run (gdn_tree_bench.py times it beside the others): on the H200 at the 27B's
# heads, 17 nodes, the bits of the kernel before it and 13.8 us a layer at 16 rows against 23.1 (2.9
# against 3.2 at 1 row; 2 warps 12.7 but other bits)
CONV_HEADS_LAUNCH = ConvHeadsLaunch()


def conv_heads(mixed: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, window: torch.Tensor,
               n_k: int, n_v: int, dk: int, dv: int,
               k: torch.Tensor | None = None,
               keep: torch.Tensor | None = None,
               launch: ConvHeadsLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixed [B, T, C] new inputs (rows may be strided), conv_state [B, K-1, C], weight [C, K], window
    [T, K] (or [B, T, K]: each sequence its own tree) -> q, k [B, Hv, T, dk] (L2-normalised, q scaled
    by dk^-0.5), v [B, Hv, T, dv], float32. k is written into `k` where given (rows and heads may be
    strided, nodes dense: the cache's scratch), and a copy of mixed into `keep` ([B, T, C], rows may
    be strided) where given (the scratch's inputs)."""
    launch = launch or CONV_HEADS_LAUNCH
    b, t, c = mixed.shape
    kernel = weight.shape[1]
    q = torch.empty(b, n_v, t, dk, device=mixed.device, dtype=torch.float32)
    k = torch.empty_like(q) if k is None else k
    v = torch.empty(b, n_v, t, dv, device=mixed.device, dtype=torch.float32)
    window = window.contiguous()
    heads = n_v // n_k if launch.per_key else 1
    grid = (triton.cdiv(t, launch.nodes), n_v // heads, b)
    _conv_heads_kernel[grid](mixed, conv_state.contiguous(), weight.contiguous(), window, q, k, v,
                             mixed if keep is None else keep, mixed.stride(0), mixed.stride(1),
                             t * kernel if window.dim() == 3 else 0, k.stride(0), k.stride(1),
                             0 if keep is None else keep.stride(0), t, c, kernel - 1, n_v, dk ** -0.5,
                             NK=n_k * dk, GROUP=n_v // n_k, HEADS=heads, BLOCK_T=launch.nodes, DK=dk, DV=dv,
                             K=kernel, KEEP=keep is not None, num_warps=launch.warps)
    return q, k, v


def gated_norm(core: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
               dtype: torch.dtype) -> torch.Tensor:
    """core [B, Hv, T, dv] float32, z [B, T, Hv*dv] (rows may be strided) -> RMSNorm(core) * w * SiLU(z)
    as [B, T, Hv*dv] in `dtype`."""
    b, h, t, dv = core.shape
    out = torch.empty(b, t, h * dv, device=core.device, dtype=dtype)
    _gated_norm_kernel[(t, h, b)](core.contiguous(), z, weight, out, z.stride(0), z.stride(1), t, h, eps, DV=dv)
    return out


class AdvanceLaunch(NamedTuple):
    """A state tile per program (BLOCK_K rows of dk x BLOCK_V of dv) and its warps."""
    block_k: int = 32
    block_v: int = 128
    warps: int = 4


def advance_fits(state: torch.Tensor) -> bool:
    """On CUDA, a float32 state (the cache's)."""
    return _use_triton(state) and state.dtype == torch.float32


def advance_state(k: torch.Tensor, u: torch.Tensor, g: torch.Tensor, state: torch.Tensor, nodes: torch.Tensor,
                  length: torch.Tensor, launch: AdvanceLaunch = AdvanceLaunch()) -> None:
    """gated_delta.advance_along in one pass over the state: k [n, B, H, T, dk], u [n, B, H, T, dv],
    g [n, B, H, T] (a Step), state [n, B, H, dk, dv] written in place, nodes [B, P] (each row's path,
    root first; entries past length[b] are never read), length [B] (each >= 1). Any strides (pool
    views, a column of the walk's result)."""
    n, b, h, dk, dv = state.shape
    block_k = min(launch.block_k, triton.next_power_of_2(dk))
    block_v = min(launch.block_v, triton.next_power_of_2(dv))
    grid = (n * b * h, triton.cdiv(dk, block_k), triton.cdiv(dv, block_v))
    _advance_kernel[grid](state, k, u, g, nodes, length, *state.stride(), *k.stride(), *u.stride(), *g.stride(),
                          *nodes.stride(), length.stride(0), b, h, DK=dk, DV=dv, BLOCK_K=block_k,
                          BLOCK_V=block_v, num_warps=launch.warps)


CONV_TAIL_BLOCK = 1024   # channels a program of conv_tail (the 27B's 10,240 in 10 programs a layer and row)


def conv_tail_fits(conv: torch.Tensor, inputs: torch.Tensor) -> bool:
    """On CUDA, channels contiguous in the tail and the tree pass's inputs alike."""
    return _use_triton(conv) and conv.stride(-1) == 1 and inputs.stride(-1) == 1


def conv_tail(conv: torch.Tensor, inputs: torch.Tensor, nodes: torch.Tensor, length: torch.Tensor) -> None:
    """gated_delta.conv_tail_along in one launch: conv [n, B, K-1, C] (written in place), inputs
    [n, B, T, C] (the tree pass's conv inputs by node), nodes [B, P] (each row's path, root first),
    length [B] (each >= 1). Any strides but the channels'."""
    n, b, k1, c = conv.shape
    block = min(CONV_TAIL_BLOCK, triton.next_power_of_2(c))
    _conv_tail_kernel[(n * b, triton.cdiv(c, block))](
        conv, inputs, nodes, length, *conv.stride()[:3], *inputs.stride()[:3], *nodes.stride(), length.stride(0), b,
        c, K1=k1, K1P=triton.next_power_of_2(k1), BLOCK=block, num_warps=4)


# the largest tree the one-kernel verify takes: its [T, T] matrices and [T, BV] blocks live in registers
TREE_DELTA_MAX_NODES = 64


class TreeDeltaLaunch(NamedTuple):
    """A program per (sequence, value head, BLOCK_V columns of dv), the dk reduction in BLOCK_K chunks,
    `warps` for trees of up to 32 nodes (twice as many for 64);
    `precision`: Triton's float32 dot ("tf32x3": three TF32 products, about float32's error on the tensor
    cores; "ieee": float32 FMAs; "tf32": one TF32 product, ~1e-3 relative) for the products that make u,
    which the commit folds into the state; `output_precision` (None: the same) for those that make only
    the pass's output, which the layer rounds to 16 bits after its norm; `squaring`: solve the
    triangular system by repeated squaring (log2 T products) rather than by substitution (T steps);
    `peel`: take the root apart where that halves the blocks (17 nodes in blocks of 16, 33 in 32).
    The fields' defaults were the fastest of gdn_tree_bench.py's first 20 launches on the H200 at 1, 8
    and 16 rows of 17 nodes (27B shape: 13.9 / 55.7 / 119.5 us against torch's 63.3 / 120.4 / 193.7,
    error 3e-7); the layers run tree_delta_launch's."""
    block_k: int = 32
    block_v: int = 64
    warps: int = 4
    precision: str = "tf32x3"
    squaring: bool = True
    output_precision: str | None = None
    peel: bool = False


# The launches the layers run (gdn_tree_bench.py times the one for its rows as its default, beside its
# grid), both with the root taken apart (a 17-node tree in blocks of 16), its products riding the blocks'
# dots, dk in chunks of 16 (fewer registers a chunk: more programs an SM). An H100, 27B, 17 nodes, the
# state read from memory as a step reads it (inputs rotated past the L2), us at 1 / 8 / 16 rows
# (bench/results/runtime-gdn-tree-bench-dots-*-s33-h100.json): below TREE_DELTA_MANY_ROWS rows, float32
# FMAs, 64 columns of dv a program, 4 warps: 11.6 at one row; from there three TF32 products, every column
# in one program (no [T, T] work done twice), 4 warps: 38.2-39.2 / 59.0-59.6. The launches before them
# (the root's terms summed as vectors at every dk chunk: dk in chunks of 32 at one row, 64 columns and 2
# warps from 8 rows) 12.8 / 44.6 / 70.0 on the same machine (runtime-gdn-tree-bench-sums-s33-h100.json);
# the 16-row round 40.94 -> 40.42 ms in one call. Errors against float64 within 4.4e-7 (u 1.7e-7).
# Summing the root's terms before the loop (sessions 28-30) read the state twice: slower in the round
TREE_DELTA_LAUNCH = TreeDeltaLaunch(block_k=16, precision="ieee", peel=True)
TREE_DELTA_MANY = TreeDeltaLaunch(block_k=16, block_v=128, warps=4, peel=True)
TREE_DELTA_MANY_ROWS = 8


def tree_delta_launch(rows: int) -> TreeDeltaLaunch:
    """The launch for a pass of `rows` sequences' trees."""
    return TREE_DELTA_MANY if rows >= TREE_DELTA_MANY_ROWS else TREE_DELTA_LAUNCH

# Checked and timed on an H200 by gdn_tree_bench.py (docs/performance.md); DDTREE_TREE_DELTA=0 serves
# the tree pass in torch instead (to compare, or should a GPU's compiler refuse the kernel)
TREE_DELTA_ON_GPU = os.environ.get("DDTREE_TREE_DELTA") != "0"


def tree_delta_fits(q: torch.Tensor, v: torch.Tensor) -> bool:
    """On CUDA (unless DDTREE_TREE_DELTA=0), power-of-two head dims of at least 16 (a Triton dot's smallest
    side) and trees of up to TREE_DELTA_MAX_NODES nodes."""
    return (_use_triton(q) and (TREE_DELTA_ON_GPU or not q.is_cuda) and q.shape[2] <= TREE_DELTA_MAX_NODES
            and all(n >= 16 and _pow2(n) for n in (q.shape[-1], v.shape[-1])))


class Gates(NamedTuple):
    """A linear layer's gate inputs as its in-projection gives them: b and a [B, T, Hv] (any strides, the
    model dtype) and its A_log, dt_bias [Hv]. tree_delta then makes beta = sigmoid(b) and
    g = -exp(A_log) softplus(a + dt_bias) itself (about ten small torch kernels a layer fewer)."""
    b: torch.Tensor
    a: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor


def tree_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, beta: torch.Tensor | None,
               state: torch.Tensor | None, mask: torch.Tensor, launch: TreeDeltaLaunch | None = None,
               gates: Gates | None = None, u: torch.Tensor | None = None,
               pathsum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gated_delta.gated_delta in one launch: q, k [B, H, T, dk], v [B, H, T, dv], g, beta [B, H, T] (or
    None with `gates`), all float32 with any strides; state [B, H, dk, dv] float32 (any strides) or None;
    mask [T, T] or [B, 1, T, T] bool (ancestor-or-self, ancestors first). Returns out [B, H, T, dv]
    (contiguous), u [B, H, T, dv] and the path sums G [B, H, T]: written into `u` and `pathsum` where
    given (any strides: the cache's scratch), else new."""
    b, h, t, dk = q.shape
    launch = launch or tree_delta_launch(b)
    dv = v.shape[-1]
    block_t = max(16, triton.next_power_of_2(t))
    peel = launch.peel and max(16, triton.next_power_of_2(t - 1)) < block_t
    if peel:
        block_t //= 2
    block_k, block_v = min(launch.block_k, dk), min(launch.block_v, dv)
    out = torch.empty(b, h, t, dv, device=q.device, dtype=torch.float32)
    u = torch.empty_like(out) if u is None else u
    pathsum = torch.empty(b, h, t, device=q.device, dtype=torch.float32) if pathsum is None else pathsum
    if gates is not None:  # [B, T, H] columns, read as [B, H, T]
        g, beta = gates.a.transpose(1, 2), gates.b.transpose(1, 2)
    flags = mask.view(torch.uint8)
    s_mb, s_mi, s_mj = (0, *flags.stride()) if flags.dim() == 2 else (flags.stride(0), *flags.stride()[-2:])
    s_state = (0, 0, 0, 0) if state is None else state.stride()
    params = (gates.a_log, gates.dt_bias) if gates is not None else (g, g)
    _tree_delta_kernel[(b * h, dv // block_v)](
        q, k, v, g, beta, *params, q if state is None else state, flags, out, u, pathsum,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *s_state, s_mb, s_mi, s_mj,
        *u.stride(), *pathsum.stride(), t, h,
        DK=dk, DV=dv, BT=block_t, LOG_BT=block_t.bit_length() - 1, BK=block_k, BV=block_v,
        HAS_STATE=state is not None, RAW_GATES=gates is not None, PRECISION=launch.precision,
        OUT_PRECISION=launch.output_precision or launch.precision, SQUARING=launch.squaring,
        # (PEEL as 0 or 1: the shipped compile record names it so, from when the root had two ways apart)
        PEEL=int(peel), num_warps=launch.warps * max(1, block_t // 32))
    return out, u, pathsum

"""Fused Triton kernels around the Gated DeltaNet tree pass on CUDA (the torch path serves everything else).

Why: in torch a linear layer's tree pass is ~60 small kernels; replayed from a CUDA graph each still
costs microseconds, so the 48 linear layers of a Qwen3.6-27B pass spend milliseconds on launches alone.
Two of the elementwise stretches fold into one kernel each: the path-gathered causal conv + SiLU + the
split into q/k/v + L2 normalisation (+ q's scale), and the output's RMSNorm gated by SiLU(z).
The commit's state advance is one more: the recurrent state is the largest tensor a commit touches
(~151 MB a request at Qwen3.6-27B), and torch reads and writes it twice (the decay, then the rank-P
update) besides the gathers; the kernel reads each tile once and writes it once.
Numerics: the conv sums in float32 (the torch path sums in the model dtype); the gated norm rounds where
the torch path does; the state advance is float32 throughout, as in torch (summed in path order)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kernels import _use_triton, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _conv_silu(mixed_ptr, state_ptr, w_ptr, ext, from_state, ch, s_mix, C, KM1, K: tl.constexpr):
        # the K taps of channels `ch` along one node's path: rows of the conv state, then of the new inputs
        taps = tl.arange(0, K)
        x_old = tl.load(state_ptr + ext[:, None] * C + ch[None, :], mask=from_state[:, None], other=0.0)
        x_new = tl.load(mixed_ptr + (ext - KM1)[:, None] * s_mix + ch[None, :], mask=~from_state[:, None],
                        other=0.0)
        w = tl.load(w_ptr + ch[None, :] * K + taps[:, None]).to(tl.float32)
        y = tl.sum((x_old.to(tl.float32) + x_new.to(tl.float32)) * w, axis=0)
        return y * tl.sigmoid(y)

    @triton.jit
    def _conv_heads_kernel(mixed_ptr, state_ptr, w_ptr, win_ptr, q_ptr, k_ptr, v_ptr, s_mixb, s_mix, s_win, T, C,
                           KM1, q_scale, NK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                           K: tl.constexpr):
        t, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # node, value head, sequence
        HV = tl.num_programs(1)
        mixed_ptr += b * s_mixb
        state_ptr += b * KM1 * C
        q_ptr += b * HV * T * DK
        k_ptr += b * HV * T * DK
        v_ptr += b * HV * T * DV
        kh = h // GROUP
        ext = tl.load(win_ptr + b * s_win + t * K + tl.arange(0, K))
        from_state = ext < KM1
        dk = tl.arange(0, DK)
        q = _conv_silu(mixed_ptr, state_ptr, w_ptr, ext, from_state, kh * DK + dk, s_mix, C, KM1, K)
        k = _conv_silu(mixed_ptr, state_ptr, w_ptr, ext, from_state, NK + kh * DK + dk, s_mix, C, KM1, K)
        dv = tl.arange(0, DV)
        v = _conv_silu(mixed_ptr, state_ptr, w_ptr, ext, from_state, 2 * NK + h * DV + dv, s_mix, C, KM1, K)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        tl.store(q_ptr + (h * T + t) * DK + dk, q)
        tl.store(k_ptr + (h * T + t) * DK + dk, k)
        tl.store(v_ptr + (h * T + t) * DV + dv, v)

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


def fused_fits(mixed: torch.Tensor, dk: int, dv: int, kernel: int) -> bool:
    """On CUDA, power-of-two head dims and conv width (the Qwen3.5/3.6 shapes)."""
    return (_use_triton(mixed) and mixed.stride(-1) == 1
            and all(n & (n - 1) == 0 for n in (dk, dv, kernel)))


def conv_heads(mixed: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, window: torch.Tensor,
               n_k: int, n_v: int, dk: int, dv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixed [B, T, C] new inputs (rows may be strided), conv_state [B, K-1, C], weight [C, K], window
    [T, K] (or [B, T, K]: each sequence its own tree) -> q, k [B, Hv, T, dk] (L2-normalised, q scaled
    by dk^-0.5), v [B, Hv, T, dv], float32."""
    b, t, c = mixed.shape
    kernel = weight.shape[1]
    q = torch.empty(b, n_v, t, dk, device=mixed.device, dtype=torch.float32)
    k = torch.empty_like(q)
    v = torch.empty(b, n_v, t, dv, device=mixed.device, dtype=torch.float32)
    window = window.contiguous()
    _conv_heads_kernel[(t, n_v, b)](mixed, conv_state.contiguous(), weight.contiguous(), window, q, k, v,
                                    mixed.stride(0), mixed.stride(1), t * kernel if window.dim() == 3 else 0,
                                    t, c, kernel - 1, dk ** -0.5,
                                    NK=n_k * dk, GROUP=n_v // n_k, DK=dk, DV=dv, K=kernel)
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

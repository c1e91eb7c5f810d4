"""Fused Triton kernels around fla-core's chunked Gated DeltaNet for a padded prompt piece on CUDA (the
graphed PrefillRunner pass: qwen3_5.GatedDeltaNet._padded_chain; the torch path serves everything else).

Why: at a second turn's prompt piece (width 256 after a reused 16K prefix, Qwen3.6-27B) the 48 linear
layers spent ~11 ms of 47 in small torch kernels around fla: the depthwise conv (slow in PyTorch), its
cat and transposes, copies making q, k, v contiguous for fla, index_selects moving the tokens after the
snapshot point to the front for fla's second call, ~10 kernels of gates and their masks, the gathers of
the conv tails, and the gated norm's casts and transposes. Three kernels take their place:

- `prompt_conv_heads`: the causal conv + SiLU read straight from the projection and the row's conv
  tail, q and k L2-normalised (fla's own l2norm kernels are then skipped), written as the contiguous
  [1, W, H, d] tensors fla takes, and with `keep` also the moved copies its second call takes; the conv
  tails at `length` and at `keep` go straight into the cache rows.
- `prompt_gates`: beta and g for both calls, the padding's and the other call's tokens masked to zero,
  and the row's initial state (zeros at a prompt's start) copied out for fla.
- `prompt_gated_norm`: the output's RMSNorm gated by SiLU(z), reading each token from whichever of the
  two calls made it (no gather, no where).

Numerics: each kernel rounds where the torch path does (the conv and SiLU to the model dtype, then the
L2 norm as fla's kernel does it; the gates as _gates; the norm as kernels.rms_norm), so the results are
today's up to the order of float32 sums."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .gdn_chunk import PaddedPrompt, _fla_chunk
from .kernels import _use_triton, triton

L2_EPS = 1e-6   # fla-core's l2norm_fwd default, which this replaces

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _conv_head(mixed_ptr, s_mix, conv_ptr, snap_ptr, w_ptr, out_ptr, moved_ptr, tb, ch, head, resume,
                   length, keep, W, C, H: tl.constexpr, D: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                   NORM: tl.constexpr, KEEP: tl.constexpr):
        # BT tokens x one head's D channels `ch` (stored as head `head` of H); the conv's input row e is
        # the row's tail (e < K-1, zeros from a prompt's start) or the new token e - (K-1)
        tok = tb * BT + tl.arange(0, BT)
        inside = tok < W
        ty = out_ptr.dtype.element_ty
        acc = tl.zeros([BT, D], dtype=tl.float32)
        for j in tl.static_range(K):
            e = tok + j
            old = e < K - 1
            x_old = tl.load(conv_ptr + e[:, None] * C + ch[None, :], mask=(old & resume)[:, None], other=0.0)
            x_new = tl.load(mixed_ptr + (e - (K - 1))[:, None] * s_mix + ch[None, :],
                            mask=(~old & inside)[:, None], other=0.0)
            acc += (x_old.to(tl.float32) + x_new.to(tl.float32)) * tl.load(w_ptr + ch * K + j).to(tl.float32)[None, :]
        y = acc.to(ty).to(tl.float32)                       # the conv's output in the model dtype
        y = (y * tl.sigmoid(y)).to(ty).to(tl.float32)       # SiLU, likewise
        if NORM:                                            # as fla's l2norm_fwd: 1 / sqrt(sum + eps)
            y = y / tl.sqrt(tl.sum(y * y, axis=1) + 1e-6)[:, None]
        d = tl.arange(0, D)
        place = (tok * H + head)[:, None] * D + d[None, :]
        tl.store(out_ptr + place, y.to(ty), mask=inside[:, None])
        if KEEP:
            # the second call's inputs: token keep + i at i; past the piece's end zeros (finite: those
            # tokens' beta and g are zero, so they change nothing)
            tl.store(moved_ptr + place - keep * H * D, y.to(ty), mask=(inside & (tok >= keep))[:, None])
            tl.store(moved_ptr + place, tl.zeros([BT, D], dtype=ty), mask=(inside & (tok >= W - keep))[:, None])
        if tb == 0:
            # the K-1 conv inputs before token `length` (and `keep`): the tails a later pass continues
            # from. Only this program reads the row's tail (its tokens are the first BT >= K-1), so once
            # its reads are done (the barrier) it may overwrite it
            r = tl.arange(0, K)
            part = (r < K - 1)[:, None]
            pos = length + r
            in_tail = pos < K - 1
            tail = (tl.load(conv_ptr + pos[:, None] * C + ch[None, :], mask=part & (in_tail & resume)[:, None],
                            other=0.0)
                    + tl.load(mixed_ptr + (pos - (K - 1))[:, None] * s_mix + ch[None, :],
                              mask=part & ~in_tail[:, None], other=0.0))
            if KEEP:
                pos = keep + r
                in_tail = pos < K - 1
                snap = (tl.load(conv_ptr + pos[:, None] * C + ch[None, :],
                                mask=part & (in_tail & resume)[:, None], other=0.0)
                        + tl.load(mixed_ptr + (pos - (K - 1))[:, None] * s_mix + ch[None, :],
                                  mask=part & ~in_tail[:, None], other=0.0))
                tl.store(snap_ptr + r[:, None] * C + ch[None, :], snap, mask=part)
            tl.debug_barrier()
            tl.store(conv_ptr + r[:, None] * C + ch[None, :], tail, mask=part)

    @triton.jit
    def _prompt_conv_kernel(mixed_ptr, conv_ptr, snap_ptr, w_ptr, row_ptr, resume_ptr, length_ptr, keep_ptr,
                            q_ptr, k_ptr, v_ptr, qm_ptr, km_ptr, vm_ptr, s_mix, s_conv, s_snap, W, C,
                            HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                            K: tl.constexpr, BT: tl.constexpr, KEEP: tl.constexpr):
        tb, slot = tl.program_id(0), tl.program_id(1)   # BT tokens; a q head, a k head or a v head
        row = tl.load(row_ptr).to(tl.int64)
        conv_ptr += row * s_conv
        snap_ptr += row * s_snap
        resume = tl.load(resume_ptr) != 0
        length = tl.load(length_ptr)
        keep = length
        if KEEP:
            keep = tl.load(keep_ptr)
        if slot < HK:
            _conv_head(mixed_ptr, s_mix, conv_ptr, snap_ptr, w_ptr, q_ptr, qm_ptr, tb, slot * DK + tl.arange(0, DK),
                       slot, resume, length, keep, W, C, HK, DK, K, BT, True, KEEP)
        elif slot < 2 * HK:
            h = slot - HK
            _conv_head(mixed_ptr, s_mix, conv_ptr, snap_ptr, w_ptr, k_ptr, km_ptr, tb,
                       (HK + h) * DK + tl.arange(0, DK), h, resume, length, keep, W, C, HK, DK, K, BT, True, KEEP)
        else:
            h = slot - 2 * HK
            _conv_head(mixed_ptr, s_mix, conv_ptr, snap_ptr, w_ptr, v_ptr, vm_ptr, tb,
                       2 * HK * DK + h * DV + tl.arange(0, DV), h, resume, length, keep, W, C, HV, DV, K, BT,
                       False, KEEP)

    @triton.jit
    def _raw_gates(b_ptr, a_ptr, tok, live, h, s_b, s_a, a_log, dt_bias):
        # as GatedDeltaNet._gates: beta = sigmoid(b) in the model dtype; g = -exp(A_log) softplus(a + dt_bias)
        # in float32 (torch's softplus: x past 20 as is, else log1p(e^x)); zero where not live
        b = tl.load(b_ptr + tok * s_b + h, mask=live, other=0.0)
        beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype)
        x = tl.load(a_ptr + tok * s_a + h, mask=live, other=0.0).to(tl.float32) + dt_bias
        e = tl.exp(tl.minimum(x, 20.0))
        softplus = tl.where(x > 20.0, x, tl.where(e < 1e-4, e * (1.0 - 0.5 * e), tl.log(1.0 + e)))
        g = -tl.exp(a_log) * softplus
        return tl.where(live, g, 0.0), tl.where(live, beta, 0.0)

    @triton.jit
    def _prompt_gates_kernel(b_ptr, a_ptr, a_log_ptr, dt_bias_ptr, state_ptr, row_ptr, resume_ptr, length_ptr,
                             keep_ptr, g_ptr, beta_ptr, gm_ptr, betam_ptr, init_ptr, s_b, s_a,
                             s_sr, s_sh, s_sk, s_sv, W, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                             BW: tl.constexpr, BK: tl.constexpr, KEEP: tl.constexpr):
        h = tl.program_id(0)   # a value head: its gates at every token, its initial state
        tok = tl.arange(0, BW)
        inside = tok < W
        length = tl.load(length_ptr)
        a_log = tl.load(a_log_ptr + h).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        cut = length
        if KEEP:
            keep = tl.load(keep_ptr)
            cut = keep
            # the second call: token keep + i at i, live while before the piece's end
            g, beta = _raw_gates(b_ptr, a_ptr, tok + keep, inside & (tok + keep < length), h, s_b, s_a, a_log, dt_bias)
            tl.store(gm_ptr + tok * HV + h, g, mask=inside)
            tl.store(betam_ptr + tok * HV + h, beta, mask=inside)
        g, beta = _raw_gates(b_ptr, a_ptr, tok, inside & (tok < cut), h, s_b, s_a, a_log, dt_bias)
        tl.store(g_ptr + tok * HV + h, g, mask=inside)
        tl.store(beta_ptr + tok * HV + h, beta, mask=inside)
        row = tl.load(row_ptr).to(tl.int64)
        resume = tl.load(resume_ptr) != 0
        cols = tl.arange(0, DV)
        for r in tl.static_range(0, DK, BK):
            rows = r + tl.arange(0, BK)
            tile = tl.load(state_ptr + row * s_sr + h * s_sh + rows[:, None] * s_sk + cols[None, :] * s_sv,
                           mask=resume, other=0.0)
            tl.store(init_ptr + (h * DK + rows[:, None]) * DV + cols[None, :], tile)

    @triton.jit
    def _prompt_norm_kernel(out_ptr, rest_ptr, keep_ptr, z_ptr, w_ptr, y_ptr, s_z, eps, HV: tl.constexpr,
                            DV: tl.constexpr, HP: tl.constexpr, KEEP: tl.constexpr):
        t = tl.program_id(0)   # a token, all its heads
        h = tl.arange(0, HP)[:, None]
        d = tl.arange(0, DV)[None, :]
        live = h < HV
        place = h * DV + d
        if KEEP:  # tokens before `keep` from the first call, the others from the second (moved to 0)
            keep = tl.load(keep_ptr)
            x = (tl.load(out_ptr + t * HV * DV + place, mask=live & (t < keep), other=0.0)
                 + tl.load(rest_ptr + (t - keep) * HV * DV + place, mask=live & (t >= keep), other=0.0))
        else:
            x = tl.load(out_ptr + t * HV * DV + place, mask=live, other=0.0)
        x = x.to(tl.float32)
        ty = y_ptr.dtype.element_ty
        r = tl.rsqrt(tl.sum(x * x, axis=1) / DV + eps)[:, None]
        n = (x * r * tl.load(w_ptr + d).to(tl.float32)).to(ty).to(tl.float32)   # kernels.rms_norm's rounding
        z = tl.load(z_ptr + t * s_z + place, mask=live, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * HV * DV + place, (n * z * tl.sigmoid(z)).to(ty), mask=live)


class Heads(NamedTuple):
    """One fla call's inputs: q, k [1, W, Hk, dk] (L2-normalised), v [1, W, Hv, dv], contiguous, the model
    dtype; g [1, W, Hv] float32 and beta [1, W, Hv] in the model dtype, zero where the call skips a token."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor | None = None
    beta: torch.Tensor | None = None


def prompt_fits(mixed: torch.Tensor, dk: int, dv: int, kernel: int) -> bool:
    """On CUDA with fla-core, 16 bits, one row, power-of-two head dims of at least 16 and conv width
    (the Qwen3.5/3.6 shapes)."""
    return (_use_triton(mixed) and mixed.dtype in (torch.bfloat16, torch.float16) and mixed.shape[0] == 1
            and mixed.stride(-1) == 1 and _fla_chunk() is not None
            and all(n & (n - 1) == 0 for n in (dk, dv, kernel)) and min(dk, dv) >= 16)


def prompt_conv_heads(mixed: torch.Tensor, conv: torch.Tensor, snap_conv: torch.Tensor | None,
                      weight: torch.Tensor, prompt: PaddedPrompt, n_k: int, n_v: int, dk: int,
                      dv: int) -> tuple[Heads, Heads | None]:
    """mixed [1, W, C] (rows may be strided), conv and snap_conv [rows, K-1, C] (a layer's tails in the
    cache; rows may be strided), weight [C, K] -> the first fla call's q, k, v and, with prompt.keep, the
    second's (tokens keep.. moved to the front). Writes the tail at prompt.length into conv's row
    prompt.row and the tail at prompt.keep into snap_conv's."""
    _, width, c = mixed.shape
    kernel = weight.shape[1]
    block_t = 32
    if kernel - 1 > block_t:
        raise ValueError(f"conv width {kernel} past the kernel's token block ({block_t})")
    keep = prompt.keep is not None

    def heads() -> Heads:
        return Heads(mixed.new_empty(1, width, n_k, dk), mixed.new_empty(1, width, n_k, dk),
                     mixed.new_empty(1, width, n_v, dv))

    first = heads()
    moved = heads() if keep else first
    snap = snap_conv if keep else conv
    for t in (conv, snap):
        if t.stride(2) != 1 or t.stride(1) != c:
            raise ValueError("the conv tails must be dense within a row")
    _prompt_conv_kernel[(triton.cdiv(width, block_t), 2 * n_k + n_v)](
        mixed, conv, snap, weight.contiguous(), prompt.row, prompt.resume, prompt.length,
        prompt.keep if keep else prompt.length, *first[:3], *moved[:3], mixed.stride(1), conv.stride(0), snap.stride(0),
        width, c, HK=n_k, HV=n_v, DK=dk, DV=dv, K=kernel, BT=block_t, KEEP=keep)
    return first, moved if keep else None


def prompt_gates(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                 state: torch.Tensor, prompt: PaddedPrompt, first: Heads,
                 moved: Heads | None) -> tuple[Heads, Heads | None, torch.Tensor]:
    """The in-projection's b, a [1, W, Hv] (tokens may be strided), A_log, dt_bias [Hv] and a layer's
    states in the cache [rows, Hv, dk, dv] float32 -> the two fla calls' inputs (prompt_conv_heads's)
    with their g and beta, and the row's initial state [1, Hv, dk, dv] (zeros where prompt.resume is
    False)."""
    _, width, hv = b.shape
    _, _, dk, dv = state.shape
    keep = moved is not None
    g, gm = (torch.empty(1, width, hv, device=b.device, dtype=torch.float32) for _ in range(2))
    beta, betam = (torch.empty(1, width, hv, device=b.device, dtype=b.dtype) for _ in range(2))
    init = torch.empty(1, hv, dk, dv, device=b.device, dtype=torch.float32)
    if b.stride(2) != 1 or a.stride(2) != 1:
        raise ValueError("b and a must be dense over heads")
    _prompt_gates_kernel[(hv,)](
        b, a, a_log, dt_bias, state, prompt.row, prompt.resume, prompt.length,
        prompt.keep if keep else prompt.length, g, beta, gm, betam, init, b.stride(1), a.stride(1),
        *state.stride(), width, HV=hv, DK=dk, DV=dv, BW=triton.next_power_of_2(width), BK=min(16, dk), KEEP=keep)
    return (first._replace(g=g, beta=beta), moved._replace(g=gm, beta=betam) if keep else None, init)


def prompt_delta(heads: Heads, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One fla call over inputs already normalised and gated (no copies, no l2norm kernels): outputs
    [1, W, Hv, dv] in the model dtype, the final state [1, Hv, dk, dv] float32."""
    return _fla_chunk()(heads.q, heads.k, heads.v, heads.g, heads.beta, scale=heads.q.shape[-1] ** -0.5,
                        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=False)


def prompt_gated_norm(out: torch.Tensor, rest: torch.Tensor | None, keep: torch.Tensor | None, z: torch.Tensor,
                      weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(core) * weight * SiLU(z) -> [1, W, Hv*dv] in z's dtype, where core is token t of `out`
    [1, W, Hv, dv] before `keep`, and token t - keep of `rest` from there (rest and keep given together);
    z [1, W, Hv*dv] (tokens may be strided)."""
    _, width, hv, dv = out.shape
    y = torch.empty(1, width, hv * dv, device=out.device, dtype=z.dtype)
    if z.stride(2) != 1 or not all(t is None or t.is_contiguous() for t in (out, rest)):
        raise ValueError("the outputs must be contiguous and z dense within a token")
    _prompt_norm_kernel[(width,)](out, out if rest is None else rest, out if keep is None else keep, z, weight, y,
                                  z.stride(1), eps, HV=hv, DV=dv, HP=triton.next_power_of_2(hv), KEEP=rest is not None,
                                  num_warps=8)   # a token's [Hv, dv] (48 x 128 at Qwen3.6-27B) per program
    return y

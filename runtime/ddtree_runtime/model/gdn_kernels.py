"""Fused Triton kernels around the Gated DeltaNet tree pass on CUDA (the torch path serves everything else).

Why: in torch a linear layer's tree pass is ~60 small kernels; replayed from a CUDA graph each still
costs microseconds, so the 48 linear layers of a Qwen3.6-27B pass spend milliseconds on launches alone.
Two of the elementwise stretches fold into one kernel each: the path-gathered causal conv + SiLU + the
split into q/k/v + L2 normalisation (+ q's scale), and the output's RMSNorm gated by SiLU(z).
Numerics: the conv sums in float32 (the torch path sums in the model dtype); the gated norm rounds where
the torch path does."""

from __future__ import annotations

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

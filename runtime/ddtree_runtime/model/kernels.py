"""Fused RMSNorm and RMSNorm + RoPE for CUDA (Triton), with the plain torch path everywhere else.

Why: a decode forward of an 8B model is ~50 small kernels per layer; in a CUDA graph each still costs a
few microseconds, and RMSNorm in float32 (7 kernels) plus RoPE (5 kernels) are most of them. One kernel
each instead. Numerics: float32 inside, one rounding at the end (the torch path rounds between steps, so
bf16 results can differ in the last bit; the CPU tests run the torch path)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path below is used
    triton = None


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + offs, (x * r * w).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_tok, eps,
                              HALF: tl.constexpr):
        # one program per (token, head) row; x is [tokens, heads, 2*HALF] with heads and dims dense
        # (tokens may be strided: a slice of the fused qkv output); out is contiguous
        row = tl.program_id(0)
        tok = row // heads
        lo = tl.arange(0, HALF)
        hi = lo + HALF
        base = row * 2 * HALF
        src = tok * stride_tok + (row % heads) * 2 * HALF
        x1 = tl.load(x_ptr + src + lo).to(tl.float32)
        x2 = tl.load(x_ptr + src + hi).to(tl.float32)
        r = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        y1 = x1 * r * tl.load(w_ptr + lo).to(tl.float32)
        y2 = x2 * r * tl.load(w_ptr + hi).to(tl.float32)
        c1 = tl.load(cos_ptr + tok * 2 * HALF + lo).to(tl.float32)
        c2 = tl.load(cos_ptr + tok * 2 * HALF + hi).to(tl.float32)
        s1 = tl.load(sin_ptr + tok * 2 * HALF + lo).to(tl.float32)
        s2 = tl.load(sin_ptr + tok * 2 * HALF + hi).to(tl.float32)
        ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + base + lo, (y1 * c1 - y2 * s1).to(ty))
        tl.store(out_ptr + base + hi, (y2 * c2 + y1 * s2).to(ty))


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # normalise in float32 (as HF does) so bf16/fp16 weights give the reference numerics
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N] -> same shape, normalised over the last dim and scaled by weight [N]."""
    if not _use_triton(x) or x.dtype != weight.dtype:
        return rms_norm_torch(x, weight, eps)
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), n, eps,
                                     BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape)


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; cos, sin: [B, 1, T, D]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D] (per-head q or k) -> RMSNorm over D, then RoPE; returns [B, H, T, D]."""
    b, t, h, d = x.shape
    if not _use_triton(x) or x.dtype != weight.dtype or d & (d - 1) or cos.dtype != x.dtype:
        return rotate_half_rope(rms_norm_torch(x, weight, eps).transpose(1, 2), cos, sin)
    if x.stride(3) != 1 or x.stride(2) != d or x.stride(0) != t * x.stride(1):
        x = x.contiguous()
    out = torch.empty((b, t, h, d), dtype=x.dtype, device=x.device)
    c = cos.reshape(b * t, d).contiguous()
    s = sin.reshape(b * t, d).contiguous()
    _rms_norm_rope_kernel[(b * t * h,)](x, weight, c, s, out, h, x.stride(1), eps, HALF=d // 2)
    return out.transpose(1, 2)

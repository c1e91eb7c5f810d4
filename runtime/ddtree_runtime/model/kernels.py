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


if triton is not None:
    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, n, BLOCK: tl.constexpr):
        # x is [rows, 2n] = gate | up; out [rows, n] = silu(gate) * up, one rounding
        row, blk = tl.program_id(0), tl.program_id(1)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        gate = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + n + offs, mask=m, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * n + offs, y.to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2n] (gate | up, the fused gate/up GEMM's output) -> silu(gate) * up, [..., n]; one
    kernel on CUDA instead of two."""
    n = x.shape[-1] // 2
    if not _use_triton(x):
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    x2 = x.reshape(-1, 2 * n)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, x2.stride(0), n, BLOCK=block)
    return out.view(*x.shape[:-1], n)


def residual_linear(x: torch.Tensor, y: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """x + linear(y). In CUDA inference the sum is written over x by the GEMM itself (addmm_ with
    beta 1: no add kernel, and no copy as an out-of-place addmm makes), so x must be a residual stream
    nothing else holds; elsewhere (and with a bias, or when autograd records) the plain two steps."""
    if not x.is_cuda or linear.bias is not None or torch.is_grad_enabled():
        return x + linear(y)
    x.view(-1, x.shape[-1]).addmm_(y.reshape(-1, y.shape[-1]), linear.weight.t())
    return x


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


# ---- split-KV decode attention ------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _decode_attn_part_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, o_ptr, ml_ptr,
                                 sq_h, sq_t, sk_h, sk_n, sv_h, sv_n, sb_t,
                                 T, L, rows_pad, scale, SPLIT: tl.constexpr,
                                 G: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        # one program per (KV head, KV split, block of rows); rows are (query head of the group, query)
        kvh, split, rb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n_splits = tl.num_programs(1)
        r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        g, t = r // T, r % T
        live = r < G * T
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (kvh * G + g)[:, None] * sq_h + t[:, None] * sq_t + d[None, :],
                    mask=live[:, None], other=0.0)
        m = tl.full([BLOCK_R], -1.0e30, tl.float32)  # finite: a split may be fully masked for a row
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        lo = split * SPLIT
        hi = tl.minimum(lo + SPLIT, L)
        for off in range(0, SPLIT, BLOCK_N):
            n = lo + off + tl.arange(0, BLOCK_N)
            keep = n < hi
            kb = tl.load(k_ptr + kvh * sk_h + n[:, None] * sk_n + d[None, :], mask=keep[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kb)) * scale
            s += tl.load(bias_ptr + t[:, None] * sb_t + n[None, :], mask=live[:, None] & keep[None, :],
                         other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            vb = tl.load(v_ptr + kvh * sv_h + n[:, None] * sv_n + d[None, :], mask=keep[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
            l = l * alpha + tl.sum(p, 1)
            m = m_new
        row = (kvh * n_splits + split) * rows_pad + r
        tl.store(o_ptr + row[:, None] * D + d[None, :], acc)
        tl.store(ml_ptr + 2 * row, m)
        tl.store(ml_ptr + 2 * row + 1, l)

    @triton.jit
    def _decode_attn_reduce_kernel(o_ptr, ml_ptr, out_ptr, so_h, so_t, T, rows_pad, n_splits,
                                   G: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr):
        # one program per (KV head, row): merge the splits' partial softmaxes
        kvh, r = tl.program_id(0), tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        ok = s < n_splits
        row = (kvh * n_splits + s) * rows_pad + r
        m = tl.load(ml_ptr + 2 * row, mask=ok, other=-1.0e30)
        l = tl.load(ml_ptr + 2 * row + 1, mask=ok, other=0.0)
        w = tl.where(ok, tl.exp(m - tl.max(m, 0)), 0.0)
        d = tl.arange(0, D)
        o = tl.load(o_ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        out = tl.sum(o * w[:, None], 0) / tl.sum(w * l, 0)
        g, t = r // T, r % T
        tl.store(out_ptr + (kvh * G + g) * so_h + t * so_t + d, out.to(out_ptr.dtype.element_ty))


# keys per program and query rows per program, as measured on an H200 in CUDA graphs
# (runtime/bench/attn_probe.py, one layer of Qwen3-8B heads, bench/results/runtime-attn-probe.txt):
# 17 queries over 1K keys 9.0 us at 128 keys x 64 rows (12.6 at 128 x 128, SDPA 26.8); over 4.6K keys
# 24.1 us at 256 x 64 (31.8 at 128 x 128, SDPA 98.2); one query does best at 64 keys (5.2 / 9.0 us,
# SDPA 7.1 / 12.1). At 129 queries SDPA wins (each block of rows rereads the keys), so the kernel
# takes at most 512 rows: 65 queries of four query heads per KV head (Qwen3-8B) or of six (Qwen3.6).
DECODE_SPLIT = 128
DECODE_SPLIT_LONG = 256     # over more than DECODE_LONG keys
DECODE_LONG = 2048
DECODE_SPLIT_ONE_QUERY = 64
DECODE_BLOCK_ROWS = 64
DECODE_MAX_ROWS = 512


def decode_attention_fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Shapes the split-KV kernel takes: one sequence, 16-bit, a power-of-two head dim, few query rows."""
    d = q.shape[-1]
    rows = q.shape[2] * q.shape[1] // k.shape[1]
    return (_use_triton(q) and q.shape[0] == 1 and q.dtype in (torch.bfloat16, torch.float16)
            and d in (32, 64, 128, 256) and rows <= DECODE_MAX_ROWS and k.stride(-1) == 1 and q.stride(-1) == 1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Attention of a few queries over a long KV (flash-decoding): q [1, Hq, T, D], k/v [1, Hkv, L, D],
    bias additive, broadcastable to [1, 1, T, L] -> [1, Hq, T, D]. The KV length is split across
    programs and each KV head's query heads share one read of its keys (grouped heads), then a second
    kernel merges the splits. SDPA here runs one block per query head over all of L: ~25 us a layer for
    a 17-node tree at 1K context on an H200, most of a verify's cost beyond an AR step."""
    _, hq, t, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = hq // hkv
    rows = g * t
    block_r = min(max(16, triton.next_power_of_2(rows)), DECODE_BLOCK_ROWS)
    rows_pad = -(-rows // block_r) * block_r
    split = DECODE_SPLIT_ONE_QUERY if t == 1 else DECODE_SPLIT_LONG if length > DECODE_LONG else DECODE_SPLIT
    n_splits = -(-length // split)
    bias2 = bias.reshape(bias.shape[-2], length)  # [T or 1, L]
    part = torch.empty(hkv, n_splits, rows_pad, d, device=q.device, dtype=torch.float32)
    ml = torch.empty(hkv, n_splits, rows_pad, 2, device=q.device, dtype=torch.float32)
    _decode_attn_part_kernel[(hkv, n_splits, rows_pad // block_r)](
        q, k, v, bias2, part, ml, q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        bias2.stride(0) if bias2.shape[0] > 1 else 0, t, length, rows_pad, d ** -0.5, SPLIT=split,
        G=g, D=d, BLOCK_R=block_r, BLOCK_N=64 if d <= 128 else 32, num_warps=4)
    out = torch.empty(1, hq, t, d, device=q.device, dtype=q.dtype)
    _decode_attn_reduce_kernel[(hkv, rows)](part, ml, out, out.stride(1), out.stride(2), t, rows_pad, n_splits,
                                            G=g, D=d, BLOCK_S=max(2, triton.next_power_of_2(n_splits)))
    return out

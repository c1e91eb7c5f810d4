"""Fused kernels for CUDA (Triton), with the plain torch path everywhere else: RMSNorm, RMSNorm + RoPE
(full or partial; for k also writing k and v into the KV cache), SiLU·up, the gated attention's output
gate, the residual add inside the GEMM, and split-KV decode attention over a tree.

Why: a decode forward of an 8B model is ~50 small kernels per layer; in a CUDA graph each still costs a
few microseconds, and RMSNorm in float32 (7 kernels) plus RoPE (5 kernels) are most of them. One kernel
each instead. Numerics: float32 inside, one rounding at the end (the torch path rounds between steps, so
bf16 results can differ in the last bit; the CPU tests run the torch path, and the kernels run through
Triton's interpreter in tests/runtime/test_triton_kernels.py)."""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from .fp8 import FP8Linear

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

    # tokens and the slots' row stride follow a pass's length: not specialised on (one compile for every
    # prompt length; they only index, so nothing is lost)
    @triton.jit(do_not_specialize=["tokens", "stride_sb"])
    def _rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, slots_ptr, v_ptr, vout_ptr,
                              heads, tokens, stride_tok, stride_xh, stride_ob, stride_oh, stride_ot, stride_sb, eps,
                              HALF: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, HAS_SLOTS: tl.constexpr,
                              HAS_V: tl.constexpr):
        # one program per token, all its heads at once (a program per head was thousands of tiny
        # programs at a batched pass's 272 tokens); x is [B * tokens, heads, D], each head's dims dense
        # (tokens and heads may be strided: a slice of the fused qkv output, q of [query | gate]). RoPE
        # rotates dims [0, 2*HALF) (cos/sin rows of 2*HALF); with D > 2*HALF (partial RoPE) the rest
        # are normalised and weighted only. Token (b, t) goes to out at b * stride_ob + head *
        # stride_oh + t * stride_ot, or, with slots ([B, tokens], row stride stride_sb: 0 where all rows
        # share one [tokens]), at its KV cache slot in place of t; with v (laid out as x), the same rows
        # of v are copied there into vout (the whole KV write of a tree pass)
        tok = tl.program_id(0)
        seq = tok // tokens
        hh = tl.arange(0, HP)[:, None]
        live = hh < heads
        lo = tl.arange(0, HALF)[None, :]
        hi = lo + HALF
        src = tok * stride_tok + hh * stride_xh
        x1 = tl.load(x_ptr + src + lo, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + src + hi, mask=live, other=0.0).to(tl.float32)
        if D == 2 * HALF:  # full RoPE: the Qwen3 arithmetic, bit for bit as before
            r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
        else:
            # the pass-through dims as a whole-head tile masked to [2*HALF, D) (D - 2*HALF need not be
            # a power of two: 192 of the 27B's 256)
            dd = tl.arange(0, D)[None, :]
            rest = dd >= 2 * HALF
            x3 = tl.load(x_ptr + src + dd, mask=live & rest, other=0.0).to(tl.float32)
            ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x3 * x3, axis=1)
            r = tl.rsqrt(ss / D + eps)[:, None]
        y1 = x1 * r * tl.load(w_ptr + lo).to(tl.float32)
        y2 = x2 * r * tl.load(w_ptr + hi).to(tl.float32)
        c1 = tl.load(cos_ptr + tok * 2 * HALF + lo).to(tl.float32)
        c2 = tl.load(cos_ptr + tok * 2 * HALF + hi).to(tl.float32)
        s1 = tl.load(sin_ptr + tok * 2 * HALF + lo).to(tl.float32)
        s2 = tl.load(sin_ptr + tok * 2 * HALF + hi).to(tl.float32)
        place = tok % tokens
        if HAS_SLOTS:
            place = tl.load(slots_ptr + seq * stride_sb + place)
        dst = seq.to(tl.int64) * stride_ob + hh * stride_oh + place * stride_ot
        ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + dst + lo, (y1 * c1 - y2 * s1).to(ty), mask=live)
        tl.store(out_ptr + dst + hi, (y2 * c2 + y1 * s2).to(ty), mask=live)
        if D != 2 * HALF:
            w3 = tl.load(w_ptr + dd, mask=rest, other=0.0).to(tl.float32)
            tl.store(out_ptr + dst + dd, (x3 * r * w3).to(ty), mask=live & rest)
        if HAS_V:
            vd = tl.arange(0, D)[None, :]
            tl.store(vout_ptr + dst + vd, tl.load(v_ptr + src + vd, mask=live), mask=live)

    # tokens follows a pass's length: not specialised on, as above
    @triton.jit(do_not_specialize=["tokens"])
    def _sigmoid_gate_kernel(o_ptr, g_ptr, out_ptr, tokens, so_b, so_h, so_t, stride_gtok, stride_gh,
                             D: tl.constexpr):
        # one program per (token, head): out[tok, head * D + d] = o[b, head, t, d] * sigmoid(gate), the
        # gate at g_ptr + tok * stride_gtok + head * stride_gh + D + d (q_proj's [query | gate] heads);
        # rounded as torch rounds: the sigmoid to the model dtype, then the product
        tok, head = tl.program_id(0), tl.program_id(1)
        seq, t = tok // tokens, tok % tokens
        d = tl.arange(0, D)
        ty = out_ptr.dtype.element_ty
        o = tl.load(o_ptr + seq.to(tl.int64) * so_b + head * so_h + t * so_t + d).to(tl.float32)
        g = tl.load(g_ptr + tok.to(tl.int64) * stride_gtok + head * stride_gh + D + d).to(tl.float32)
        gate = tl.sigmoid(g).to(ty).to(tl.float32)
        tl.store(out_ptr + (tok.to(tl.int64) * tl.num_programs(1) + head) * D + d, (o * gate).to(ty))

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
    nothing else holds; elsewhere (and with a bias, or when autograd records) the plain two steps. An
    FP8 projection adds the residual in its own GEMM (model/fp8.py)."""
    if isinstance(linear, FP8Linear):
        return linear.add_to(x, y)
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
    """x: [B, H, T, D]; cos, sin: [B, 1, T, R] with R <= D: rotate_half RoPE on the first R dims (partial
    RoPE, the hybrid's 64 of 256), the rest passed through."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([rotate_half_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    half = r // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def _pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def _rope_fits(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor) -> bool:
    """The kernel's shapes: a power-of-two head dim D, a rotated width R <= D with R/2 a power of two,
    one cos row per sequence of x, one dtype."""
    d, r = x.shape[-1], cos.shape[-1]
    return (_use_triton(x) and x.dtype == weight.dtype == cos.dtype and _pow2(d) and r % 2 == 0 and _pow2(r // 2)
            and r <= d and cos.shape[0] == x.shape[0])


def _token_stride(x: torch.Tensor) -> int:
    """The step between consecutive tokens of [B, T, H, D] taken as B*T rows: with one token a sequence
    (a batched AR step), torch's stride of the size-1 T dim is arbitrary and the batch's is the step."""
    return x.stride(0) if x.shape[1] == 1 else x.stride(1)


def _rows(x: torch.Tensor) -> bool:
    """[B, T, H, D] with each head's dims dense (heads may be strided, tokens too, evenly across B)."""
    return x.dim() == 4 and x.stride(3) == 1 and x.stride(0) == x.shape[1] * _token_stride(x)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D] (per-head q or k; q may be the query half of [query | gate] heads) -> RMSNorm
    over D, then RoPE on the first R = cos.shape[-1] dims; returns [B, H, T, D]. On CUDA one kernel per
    token whatever the pass, so a token's bits do not depend on the tokens beside it (a verify and the
    AR step agree)."""
    b, t, h, d = x.shape
    r = cos.shape[-1]
    if not _rope_fits(x, weight, cos):
        return rotate_half_rope(rms_norm_torch(x, weight, eps).transpose(1, 2), cos, sin)
    if not _rows(x):
        x = x.contiguous()
    out = torch.empty((b, t, h, d), dtype=x.dtype, device=x.device)
    c = cos.reshape(b * t, r).contiguous()
    s = sin.reshape(b * t, r).contiguous()
    _rms_norm_rope_kernel[(b * t,)](x, weight, c, s, out, x, x, out, h, t, _token_stride(x), x.stride(2), t * h * d,
                                    d, h * d, 0, eps, HALF=r // 2, D=d, HP=triton.next_power_of_2(h),
                                    HAS_SLOTS=False, HAS_V=False)
    return out.transpose(1, 2)


def rms_norm_rope_to_cache(k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, eps: float,
                           cos: torch.Tensor, sin: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                           slots: torch.Tensor) -> bool:
    """A tree pass's whole KV write in one kernel: RMSNorm + RoPE of k ([B, T, Hkv, D]; partial where
    cos.shape[-1] < D) and v as is, into one layer's cache rows ([B, Hkv, capacity, D], row b for
    sequence b) at `slots` ([T]: the same for every row, or [B, T]: each row its own), instead of the
    RoPE kernel and two index copies or scatters; k's bits are rms_norm_rope's. False (nothing written)
    where the kernel does not apply."""
    b, t, h, d = k.shape
    r = cos.shape[-1]
    if not (_rope_fits(k, weight, cos) and v.shape == k.shape and _rows(k) and _rows(v)
            and _token_stride(k) == _token_stride(v) and k.stride(0) == v.stride(0) and k.stride(2) == v.stride(2)
            and cache_k.dtype == k.dtype and cache_k.shape[0] == b and cache_k.stride() == cache_v.stride()
            and cache_k.stride(3) == 1 and cache_k.stride(2) == d and slots.shape[-1] == t and slots.stride(-1) == 1
            and (slots.dim() == 1 or slots.shape[0] == b)):
        return False
    c = cos.reshape(b * t, r).contiguous()
    s = sin.reshape(b * t, r).contiguous()
    slot_rows = slots.stride(0) if slots.dim() == 2 else 0
    _rms_norm_rope_kernel[(b * t,)](k, weight, c, s, cache_k, slots, v, cache_v, h, t, _token_stride(k), k.stride(2),
                                    cache_k.stride(0), cache_k.stride(1), d, slot_rows, eps, HALF=r // 2, D=d,
                                    HP=triton.next_power_of_2(h), HAS_SLOTS=True, HAS_V=True)
    return True


def sigmoid_gate(o: torch.Tensor, q_gate: torch.Tensor) -> torch.Tensor:
    """The gated attention's output gate: o [B, Hq, T, D] (attention's output, any layout with dense
    dims) times sigmoid of the gate half of q_gate [B, T, Hq, 2D] ([query | gate] heads) -> [B, T, Hq*D],
    o_proj's input. On CUDA one kernel reading the gate in place (torch: a copy, a sigmoid, a product),
    rounded as torch rounds."""
    b, h, t, d = o.shape
    if not (_use_triton(o) and o.dtype == q_gate.dtype and _pow2(d) and o.stride(3) == 1 and _rows(q_gate)):
        return o.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(q_gate[..., d:].reshape(b, t, -1))
    out = torch.empty((b, t, h * d), dtype=o.dtype, device=o.device)
    _sigmoid_gate_kernel[(b * t, h)](o, q_gate, out, t, o.stride(0), o.stride(1), o.stride(2), _token_stride(q_gate),
                                     q_gate.stride(2), D=d)
    return out


# ---- split-KV decode attention ------------------------------------------------------------------------

if triton is not None:
    # Triton compiles a kernel per distinct set of constexprs and of integer properties (== 1, a
    # multiple of 16). T and rows_pad follow a pass's query count (a prefill group's width): not
    # specialised on, as they only index. L stays specialised: its being a multiple of 16 lets the
    # bias loads along the keys vectorise, and every caller passes a bucket (graphs: KV_BUCKET; eager
    # passes: EAGER_KV_BUCKET, with DECODE_EAGER's fixed launch), so it always is one
    @triton.jit
    def _attn_keys(q, m, l, acc, k_ptr, v_ptr, bias_ptr, bt_ptr, b, kvh, t, live, d, lo, hi, sk_h, sk_n, sv_h,
                   sv_n, sb_t, sbt_b, scale, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, BIASED: tl.constexpr):
        # the online softmax over keys lo..hi-1 (lo a multiple of BLOCK_N); BIASED: with the pass's bias
        # and hi anywhere, else every row sees every key and hi is a multiple of BLOCK_N (no mask at all)
        for first in range(lo, hi, BLOCK_N):
            n = first + tl.arange(0, BLOCK_N)
            keep = n < hi
            slot = n
            if PAGE > 0:
                un = n.to(tl.uint32)   # unsigned: a shift and a mask (a start read from memory left its sign unknown)
                if BIASED:
                    page = tl.load(bt_ptr + b * sbt_b + un // PAGE, mask=keep, other=0)
                else:
                    page = tl.load(bt_ptr + b * sbt_b + un // PAGE)
                slot = page * PAGE + (un % PAGE).to(tl.int32)
            if BIASED:
                kb = tl.load(k_ptr + kvh * sk_h + slot[:, None] * sk_n + d[None, :], mask=keep[:, None], other=0.0)
            else:
                kb = tl.load(k_ptr + kvh * sk_h + slot[:, None] * sk_n + d[None, :])
            s = tl.dot(q, tl.trans(kb)) * scale
            if BIASED:
                s += tl.load(bias_ptr + t[:, None] * sb_t + n[None, :], mask=live[:, None] & keep[None, :],
                             other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            if BIASED:
                vb = tl.load(v_ptr + kvh * sv_h + slot[:, None] * sv_n + d[None, :], mask=keep[:, None], other=0.0)
            else:
                vb = tl.load(v_ptr + kvh * sv_h + slot[:, None] * sv_n + d[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
            l = l * alpha + tl.sum(p, 1)
            m = m_new
        return m, l, acc

    @triton.jit
    def _attn_span(q_ptr, k_ptr, v_ptr, bias_ptr, bt_ptr, b, kvh, r, lo, hi, end, sq_h, sq_t, sk_h, sk_n, sv_h,
                   sv_n, sb_t, sbt_b, T, scale, G: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SHARED: tl.constexpr):
        # the online softmax of query rows r (query head of the group, query) of sequence b's KV head kvh
        # over its keys lo..hi-1 (q, k, v and bias pointers already at sequence b; end: the keys it may
        # see). SHARED: every query sees the keys before end - T (the row's context), so the bias is read
        # only from the block holding that key on. An empty span (lo >= hi) reads nothing.
        g, t = r // T, r % T
        live = r < G * T
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (kvh * G + g)[:, None] * sq_h + t[:, None] * sq_t + d[None, :],
                    mask=live[:, None] & (lo < hi), other=0.0)
        m = tl.full([BLOCK_R], -1.0e30, tl.float32)  # finite: a split may be fully masked for a row
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        mid = lo
        if SHARED:  # the whole blocks before the row's own last T keys: no bias, no mask
            mid = tl.maximum(lo, tl.minimum(hi, (end - T) // BLOCK_N * BLOCK_N))
            m, l, acc = _attn_keys(q, m, l, acc, k_ptr, v_ptr, bias_ptr, bt_ptr, b, kvh, t, live, d, lo, mid, sk_h,
                                   sk_n, sv_h, sv_n, sb_t, sbt_b, scale, BLOCK_N, PAGE, False)
        m, l, acc = _attn_keys(q, m, l, acc, k_ptr, v_ptr, bias_ptr, bt_ptr, b, kvh, t, live, d, mid, hi, sk_h,
                               sk_n, sv_h, sv_n, sb_t, sbt_b, scale, BLOCK_N, PAGE, True)
        return m, l, acc

    @triton.jit
    def _merge_splits(o_ptr, ml_ptr, first, step, count, D: tl.constexpr, CHUNK: tl.constexpr,
                      ONE_PASS: tl.constexpr):
        # the normalised output of one query row from its `count` splits' partial softmaxes (rows first,
        # first + step, ... of the partials): all at once (ONE_PASS: count <= CHUNK), or CHUNK at a time
        # with a running maximum (a row's spans of a fitted split: all at once, up to a wave's share,
        # held 127 registers a program)
        d = tl.arange(0, D)
        s = tl.arange(0, CHUNK)
        if ONE_PASS:
            ok = s < count
            row = first + s * step
            m = tl.load(ml_ptr + 2 * row, mask=ok, other=-1.0e30)
            l = tl.load(ml_ptr + 2 * row + 1, mask=ok, other=0.0)
            w = tl.where(ok, tl.exp(m - tl.max(m, 0)), 0.0)
            o = tl.load(o_ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            out = tl.sum(o * w[:, None], 0) / tl.sum(w * l, 0)
        else:
            top = -1.0e30
            total = 0.0
            acc = tl.zeros([D], tl.float32)
            for c in range(0, count, CHUNK):
                ok = c + s < count
                row = first + (c + s) * step
                m = tl.load(ml_ptr + 2 * row, mask=ok, other=-1.0e30)
                l = tl.load(ml_ptr + 2 * row + 1, mask=ok, other=0.0)
                o = tl.load(o_ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
                new_top = tl.maximum(top, tl.max(m, 0))
                w = tl.where(ok, tl.exp(m - new_top), 0.0)
                keep = tl.exp(top - new_top)
                acc = acc * keep + tl.sum(o * w[:, None], 0)
                total = total * keep + tl.sum(w * l, 0)
                top = new_top
            out = acc / total
        return out

    @triton.jit(do_not_specialize=["T", "rows_pad"])
    def _decode_attn_part_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, len_ptr, o_ptr, ml_ptr, out_ptr, bt_ptr,
                                 sq_b, sq_h, sq_t, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sb_b, sb_t, so_b, so_h, so_t,
                                 sbt_b, HKV, T, L, rows_pad, scale, SPLIT: tl.constexpr, G: tl.constexpr,
                                 D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                                 HAS_LENGTHS: tl.constexpr, DIRECT: tl.constexpr, PAGE: tl.constexpr,
                                 SHARED: tl.constexpr):
        # one program per (sequence x KV head, KV split, block of rows); rows are (query head of the
        # group, query). With lengths, sequence b reads only its first lengths[b] keys (the rest are
        # masked by its bias anyway): the key loop stops there, and a split starting past it writes no
        # partial (the reduce skips it; split 0 always writes). SHARED (with lengths): _attn_span's.
        # DIRECT (one split): the program writes the normalised output itself and
        # no reduce runs. PAGE > 0: the keys are a paged pool's, key n of sequence b at slot
        # table[b, n // PAGE] * PAGE + n % PAGE (sk_b = sv_b = 0: one pool)
        bh, split, rb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, kvh = bh // HKV, bh % HKV
        n_splits = tl.num_programs(1)
        r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        lo = split * SPLIT
        end = L
        if HAS_LENGTHS:
            end = tl.minimum(L, tl.load(len_ptr + b).to(tl.int32))
        hi = tl.minimum(lo + SPLIT, end)
        m, l, acc = _attn_span(q_ptr + b * sq_b, k_ptr + b * sk_b, v_ptr + b * sv_b, bias_ptr + b * sb_b, bt_ptr, b,
                               kvh, r, lo, hi, end, sq_h, sq_t, sk_h, sk_n, sv_h, sv_n, sb_t, sbt_b, T, scale, G, D,
                               BLOCK_R, BLOCK_N, PAGE, SHARED)
        if DIRECT:
            g, t = r // T, r % T
            d = tl.arange(0, D)
            o = acc / l[:, None]
            tl.store(out_ptr + b * so_b + (kvh * G + g)[:, None] * so_h + t[:, None] * so_t + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=(r < G * T)[:, None])
        elif (split == 0) | (lo < hi):
            row = (bh * n_splits + split) * rows_pad + r
            tl.store(o_ptr + row[:, None] * D + tl.arange(0, D)[None, :], acc)
            tl.store(ml_ptr + 2 * row, m)
            tl.store(ml_ptr + 2 * row + 1, l)

    @triton.jit(do_not_specialize=["T", "L", "rows_pad", "n_splits"])
    def _decode_attn_reduce_kernel(o_ptr, ml_ptr, len_ptr, out_ptr, so_b, so_h, so_t, HKV, T, L, rows_pad,
                                   n_splits, SPLIT: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                                   BLOCK_S: tl.constexpr, HAS_LENGTHS: tl.constexpr):
        # one program per (sequence x KV head, row): merge the splits' partial softmaxes (with lengths,
        # only the splits that start before the sequence's length: the others wrote nothing)
        bh, r = tl.program_id(0), tl.program_id(1)
        b, kvh = bh // HKV, bh % HKV
        written = n_splits
        if HAS_LENGTHS:
            written = tl.maximum(1, tl.cdiv(tl.minimum(L, tl.load(len_ptr + b).to(tl.int32)), SPLIT))
        out = _merge_splits(o_ptr, ml_ptr, bh * n_splits * rows_pad + r, rows_pad, written, D, BLOCK_S, True)
        g, t = r // T, r % T
        tl.store(out_ptr + b * so_b + (kvh * G + g) * so_h + t * so_t + tl.arange(0, D),
                 out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _fitted_split(lens, rows, unit, programs, waves, overhead, BLOCK_N: tl.constexpr):
        # the keys a program reads: the longest row cut into k equal spans (whole blocks of keys; every row's
        # keys in spans of that many, each row at least one, make that many work items of `unit` each), for
        # the k whose items take the least time as waves x (span + `overhead`, a program's fixed cost in
        # keys) within `waves` waves of `programs`; one span a row where even k = 1 takes more. In one wave
        # that is the largest k that fits (the items grow with k, the span shrinks).
        longest = tl.max(lens)
        best = tl.maximum(tl.cdiv(longest, BLOCK_N), 1) * BLOCK_N
        best_cost = 1 << 30
        for k in range(1, tl.maximum(waves * programs // unit, 1) + 1):
            span = tl.maximum(tl.cdiv(tl.cdiv(longest, k), BLOCK_N), 1) * BLOCK_N
            items = tl.sum(tl.where(rows, tl.maximum(tl.cdiv(lens, span), 1), 0)) * unit
            cost = tl.cdiv(items, programs) * (span + overhead)
            better = (items <= waves * programs) & (cost < best_cost)
            best, best_cost = tl.where(better, span, best), tl.where(better, cost, best_cost)
        return best

    @triton.jit(do_not_specialize=["B", "L", "programs", "n_items"])
    def _fit_plan_kernel(len_ptr, meta_ptr, plan_ptr, B, L, HKV, programs, waves, overhead, n_items,
                         ROW_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                         BLOCK_I: tl.constexpr):
        # one program: the split fitted to the rows' own lengths (_fitted_split) and the work items it
        # makes, row by row (each row's spans, each span's KV heads and blocks of rows): item i's row, first
        # and last key and its KV head and block of rows (as one index) at plan[i] (an item past the last:
        # no keys); meta: the split and each row's first item, for the merge
        bb = tl.arange(0, BLOCK_B)
        rows = bb < B
        unit = HKV * ROW_BLOCKS
        lens = tl.minimum(L, tl.load(len_ptr + bb, mask=rows, other=0).to(tl.int32))
        split = _fitted_split(lens, rows, unit, programs, waves, overhead, BLOCK_N)
        counts = tl.where(rows, tl.maximum(tl.cdiv(lens, split), 1) * unit, 0)
        ends = tl.cumsum(counts, 0)
        firsts = ends - counts
        tl.store(meta_ptr, split)
        tl.store(meta_ptr + 1 + bb, firsts, mask=rows)
        ii = tl.arange(0, BLOCK_I)
        live = ii < tl.sum(counts)
        b = tl.minimum(tl.sum(((ends[None, :] <= ii[:, None]) & rows[None, :]).to(tl.int32), 1), B - 1)
        mine = bb[None, :] == b[:, None]
        j = ii - tl.sum(tl.where(mine, firsts[None, :], 0), 1)
        lo = (j // unit) * split
        hi = tl.minimum(lo + split, tl.sum(tl.where(mine, lens[None, :], 0), 1))
        at = plan_ptr + 4 * ii
        keep = ii < n_items
        tl.store(at, tl.where(live, b, 0), mask=keep)
        tl.store(at + 1, tl.where(live, lo, 0), mask=keep)
        tl.store(at + 2, tl.where(live, hi, 0), mask=keep)
        tl.store(at + 3, tl.where(live, j % unit, 0), mask=keep)

    @triton.jit(do_not_specialize=["T"])
    def _decode_attn_fit_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, len_ptr, o_ptr, ml_ptr, plan_ptr, bt_ptr,
                                sq_b, sq_h, sq_t, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sb_b, sb_t, sbt_b, T, L, scale,
                                G: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                                BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SHARED: tl.constexpr):
        # work item pid of _fit_plan_kernel's plan (decode_attention's docstring): its row's keys lo..hi-1
        # for one KV head and block of rows, the partial softmax to rows pid * BLOCK_R.. of the partials;
        # an item past the last reads and writes nothing. (The plan is made once, not in every program:
        # made here it held the tile's registers, 1,152 bytes of spills a thread against 952.)
        item = tl.program_id(0)
        b = tl.load(plan_ptr + 4 * item)
        lo = tl.multiple_of(tl.load(plan_ptr + 4 * item + 1), BLOCK_N)   # (the page loads then coalesce)
        hi = tl.load(plan_ptr + 4 * item + 2)
        sub = tl.load(plan_ptr + 4 * item + 3)
        end = tl.minimum(L, tl.load(len_ptr + b).to(tl.int32))
        r = (sub % ROW_BLOCKS) * BLOCK_R + tl.arange(0, BLOCK_R)
        m, l, acc = _attn_span(q_ptr + b * sq_b, k_ptr + b * sk_b, v_ptr + b * sv_b, bias_ptr + b * sb_b, bt_ptr, b,
                               sub // ROW_BLOCKS, r, lo, hi, end, sq_h, sq_t, sk_h, sk_n, sv_h, sv_n, sb_t, sbt_b, T,
                               scale, G, D, BLOCK_R, BLOCK_N, PAGE, SHARED)
        row = item * BLOCK_R + tl.arange(0, BLOCK_R)
        live = lo < hi
        tl.store(o_ptr + row[:, None] * D + tl.arange(0, D)[None, :], acc, mask=live)
        tl.store(ml_ptr + 2 * row, m, mask=live)
        tl.store(ml_ptr + 2 * row + 1, l, mask=live)

    @triton.jit(do_not_specialize=["T", "L"])
    def _decode_attn_fit_reduce_kernel(o_ptr, ml_ptr, len_ptr, meta_ptr, out_ptr, so_b, so_h, so_t, HKV, T, L,
                                       G: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
                                       ROW_BLOCKS: tl.constexpr, MERGE_CHUNK: tl.constexpr):
        # one program per (sequence x KV head, row): _decode_attn_fit_kernel's items of its row merged
        bh, r = tl.program_id(0), tl.program_id(1)
        b, kvh = bh // HKV, bh % HKV
        split = tl.load(meta_ptr)
        spans = tl.maximum(tl.cdiv(tl.minimum(L, tl.load(len_ptr + b).to(tl.int32)), split), 1)
        item = tl.load(meta_ptr + 1 + b) + kvh * ROW_BLOCKS + r // BLOCK_R   # its first span's
        out = _merge_splits(o_ptr, ml_ptr, item * BLOCK_R + r % BLOCK_R, HKV * ROW_BLOCKS * BLOCK_R, spans, D,
                            MERGE_CHUNK, False)
        g, t = r // T, r % T
        tl.store(out_ptr + b * so_b + (kvh * G + g) * so_h + t * so_t + tl.arange(0, D),
                 out.to(out_ptr.dtype.element_ty))


class DecodeRule(NamedTuple):
    """How decode_attention shares out its work: the kernel is latency-bound, so what matters is how
    many programs share the keys and how long each one's loop is."""
    programs: int             # programs to aim for in all: sequences x KV heads x row blocks x splits
    splits: tuple[int, int]   # bounds on the keys a program reads (powers of two)
    block_rows: int           # the most query rows (query heads of a group x queries) a program takes
    warps: int
    one_query_split: int      # keys per program when each sequence has one query (an AR step)
    block_keys: int = 0       # the key loop's block for several queries a sequence (0: the kernel's choice)


class DecodeLaunch(NamedTuple):
    """One launch's shape: rows per program (at least 16, rows padded up to a multiple), keys per
    program, warps; and the key loop's block (0: the kernel's choice, 64 keys, 32 for heads over 128)
    and software-pipelining stages (num_stages)."""
    block_rows: int
    split: int
    warps: int
    stages: int = 3
    block_keys: int = 0


# The launch rules, all in one place. One sequence: tuned on an H200 in CUDA graphs
# (runtime/bench/attn_probe.py, one layer of Qwen3-8B heads: 32 query / 8 KV heads of 128;
# bench/results/runtime-attn-probe.txt). Best were about 128 programs with 64-row blocks and 4 warps:
# 17 queries over 1K keys 8.9 us (SDPA 26.2), over 4.6K keys 22.2 us (SDPA 99.2); 129 queries
# 22.8 / 69.7 us (SDPA 30.0 / 111.4). One query does best at 64-key splits (5.1 / 9.0 us; SDPA 6.9 /
# 12.1). At 257 queries SDPA wins (each row block rereads the keys), so the kernel takes up to 516 rows:
# 129 queries of four query heads per KV head (Qwen3-8B), 86 of six.
# Over long contexts twice the programs do better (attn_probe.py --batched --batches 1 --page-size 16,
# bench/results/runtime-attn-probe-lone-*-s21-h200.json, 4.6K / 8.7K buckets): the 27B's tree (24 / 4
# heads of 256, 17 queries) 25.7 / 40.5 us with 256 / 512-key splits against the 128-program rule's 31.9
# / 55.1, its drafter's block (32 / 8 heads of 128, 16 queries) 19.5 / 29.4 against 23.6 / 39.7.
DECODE_ONE_SEQUENCE = DecodeRule(programs=256, splits=(128, 1024), block_rows=64, warps=4, one_query_split=64)
# A batch (a batched round: B sequences, each over its own cache row). Set from the probe's batched
# sweep on an H200 (attn_probe.py --batched, bench/results/runtime-attn-probe-batched-1k.json; 1K
# bucket, rows of ~529 real keys): 16 rows of 17-node trees do best with all 68 rows of a KV head in
# one 128-row block and one 1024-key split, 8 warps (36.1 us a layer, against 55.6 with the
# one-sequence rule's launch and 99.8 in SDPA); 32 rows 69.1 (107.8, 192.3). A batch of single
# queries (AR steps) does best unsplit too: 14.0 us at 16 rows with per-row lengths (SDPA 21.3).
# Over long contexts, through the paged pool and with `shared` (attn_probe.py --batched --page-size 16,
# bench/results/runtime-attn-probe-paged-*-s20-h200.json, 16 rows, 4.6K / 8.7K buckets): 2,048-key
# splits are best, for the 27B's tree (24 / 4 heads of 256: 102 rows, 128-row blocks, 8 warps: 148 /
# 272 us against 159 / 301 at 1,024) and its drafter's block (32 / 8 heads of 128, 16 queries: 64
# rows), whose 64-row blocks do best with 4 warps (104 / 159 us against 172 / 291 with 8).
# Its key loop takes 64 keys a block for the 27B's heads of 256 as well (the kernel's own choice there is
# 32): 16 rows of the 27B's tree at 4.6K / 8.7K keys, shared, 138 / 226 us against 150 / 276
# (bench/results/runtime-attn-probe-keys-27b-s21-h200.json).
DECODE_BATCH = DecodeRule(programs=128, splits=(128, 2048), block_rows=128, warps=8, one_query_split=1024,
                          block_keys=64)
# Whether a batch of single queries (batched AR steps) takes the kernel, given per-row lengths: it
# does (the figures above; without lengths the kernel only tied SDPA, 21.2 against 21.3 us).
DECODE_BATCHED_ONE_QUERY = True
# Per-row lengths stop a program's key loop early, but the loop's bound then waits on a loaded value:
# for several queries a sequence the full bucket ran faster (36.1 against 42.8 us a layer at 16 rows
# of 17 queries, the sweep above), so lengths are used for one-query passes only, unless the pass
# promises a shared context (below: then its loop over the context has no mask and no bias read).
DECODE_LENGTHS_MAX_QUERIES = 1
DECODE_MAX_ROWS = 4 * 129
# Passes with per-row lengths (a batched tree, a drafter's block, a prompt piece) read no bias over the
# row's context, which every query sees (decode_attention's `shared`); DDTREE_SHARED_CONTEXT=0 reads it
# everywhere, as before (the A/B of docs/performance.md)
DECODE_SHARED_CONTEXT = os.environ.get("DDTREE_SHARED_CONTEXT", "1") != "0"
# A batch of trees over a shared context takes its split from the rows' own lengths rather than the
# bucket's (fitted_attention): as many keys a program as puts all the work in one wave of programs, the
# longest row in equal spans; DDTREE_FIT_SPLIT=0 keeps the bucket's. On an H100 (session 35, attn_probe.py,
# us a layer, the 27B's tree over the paged pool, its plan made once a pass: ~5 us), one long row among
# short ones: 16 rows at 8.7K 68 against 116, at 33K 139 against 205, 8 rows at 4.6K 49 against 110;
# equal rows: 16 at 33K 716 against 876, 8 at 4.6K 86 against 121, 16 at 8.7K 223 against 231, but 16 at
# 4.6K 143 against 142 and 8 at 8.7K 131 against 123 (its items pay ~7% more a key than the bucket's
# programs; the page index's signed division, which cost 9% more instructions in the key loop, is gone).
# The 16-row round at 8K: 39.99 against 40.11 ms. Batches whose rows alone fill more than half the wave
# keep the bucket's split (takes_fitted_split). docs/performance.md, sessions 34-35.
DECODE_FIT_SPLIT = os.environ.get("DDTREE_FIT_SPLIT", "1") != "0"
# The launch of passes not graphed, whose shapes follow each request (a prefill group's width, a first
# draft's keys): one fixed launch, so that they compile once, not once per rows-and-length bucket (a
# served engine compiled kernels well into its traffic: 20% of its thread's time, docs/performance.md).
# A 1024-key split keeps short prompts in one direct pass (no reduce); 64-row blocks, the one-sequence rule's.
DECODE_EAGER = DecodeLaunch(block_rows=64, split=1024, warps=4)


def decode_launch(batch: int, queries: int, rows: int, length: int, kv_heads: int,
                  rule: DecodeRule | None = None) -> DecodeLaunch:
    """The launch for `batch` sequences of `rows` query rows per KV head over `length` keys (the
    bucket: per-row lengths are device values): the rule's row block, and keys per program such that
    about rule.programs programs run, a power of two within rule.splits."""
    rule = rule or (DECODE_BATCH if batch > 1 else DECODE_ONE_SEQUENCE)
    block_rows = min(max(16, triton.next_power_of_2(rows)), rule.block_rows)
    if queries == 1:
        return DecodeLaunch(block_rows, rule.one_query_split, rule.warps)
    row_blocks = -(-rows // block_rows)
    lo, hi = rule.splits
    split = min(hi, max(lo, triton.next_power_of_2(length * row_blocks * batch * kv_heads // rule.programs)))
    return DecodeLaunch(block_rows, split, rule.warps if block_rows > 64 else min(rule.warps, 4),
                        block_keys=rule.block_keys)


# The fitted split counts its wave in programs of 8 warps, which hold an SM alone (255 registers a thread,
# sm90_report.py): the 27B tree's 128-row tiles. Smaller tiles (the drafter's block: 64 rows, 4 warps)
# share an SM with others, so a wave of one an SM left them half idle (its 16 rows at 4.6K / 8.7K on an
# H100: 156 / 232 us against the bucket's 111 / 170): they keep the bucket's split.
FIT_WARPS = 8
# The waves of programs a fit may spread its work over (DDTREE_FIT_WAVES; 1 by default, the measured fit):
# beyond one, a batch whose rows alone come near the wave (the 8B's 16 rows of 8 KV heads) can still cut
# a long row, at the cost of a program's fixed time a wave, FIT_PROGRAM_KEYS keys' worth (~19 us against
# ~48 ns a key for the 27B's tiles on an H100, session 35). Not yet timed above one.
_FIT_WAVES = os.environ.get("DDTREE_FIT_WAVES", "1")
FIT_WAVES = int(_FIT_WAVES) if _FIT_WAVES.isdigit() and int(_FIT_WAVES) > 0 else 1   # else the measured one
FIT_PROGRAM_KEYS = 512
FIT_MERGE_CHUNK = 4   # spans the fitted split's merge reads at a time (a row's spans can be up to a wave's
                      # share, ~33: all at once held 127 registers a program, four 40)


def takes_fitted_split(batch: int, queries: int, launch: DecodeLaunch, kv_heads: int, rows: int,
                       device: torch.device) -> bool:
    """Whether a pass over a shared context at the rule's `launch` takes the split fitted to its rows'
    lengths (DECODE_FIT_SPLIT): a batch of several queries a row in tiles of FIT_WARPS warps, whose rows
    x KV heads x row blocks fill at most half its FIT_WAVES waves. Where the rows alone come near them
    (the 8B's 16 rows of 8 KV heads: 128 of one wave's 132) a long row among short ones could not be
    cut at all, and one program would read all its keys: the bucket's split cuts it."""
    units = batch * kv_heads * -(-rows // launch.block_rows)
    return (DECODE_FIT_SPLIT and batch > 1 and queries > 1 and launch.warps >= FIT_WARPS
            and 2 * units <= FIT_WAVES * fit_programs(device))


def key_block(launch: DecodeLaunch, head_dim: int) -> int:
    """The keys a launch's loop takes a block: the rule's, else 64, or 32 for heads over 128."""
    return launch.block_keys or (64 if head_dim <= 128 else 32)


@functools.cache
def fit_programs(device: torch.device) -> int:
    """The programs a fitted split aims for (DECODE_FIT_SPLIT): one wave, a program a multiprocessor (8
    off CUDA: the interpreter's tests, whose rows can then outnumber the wave)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def decode_kernel_shape(head_dim: int, rows: int) -> bool:
    """A head dim and a count of query rows a KV head (query heads of its group x queries) the split-KV
    kernel takes: a power of two up to 256, at most DECODE_MAX_ROWS."""
    return head_dim in (32, 64, 128, 256) and rows <= DECODE_MAX_ROWS


def decode_attention_fits(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor | None = None) -> bool:
    """Shapes the split-KV kernel takes: 16-bit, a power-of-two head dim, few query rows a sequence;
    one query a sequence only for a single sequence, or for a batch with per-row lengths where
    DECODE_BATCHED_ONE_QUERY says the kernel won."""
    rows = q.shape[2] * q.shape[1] // k.shape[1]
    one_query_ok = q.shape[0] == 1 or (DECODE_BATCHED_ONE_QUERY and lengths is not None)
    return (_use_triton(q) and q.dtype in (torch.bfloat16, torch.float16) and (q.shape[2] > 1 or one_query_ok)
            and decode_kernel_shape(q.shape[-1], rows) and k.stride(-1) == 1 and q.stride(-1) == 1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                     lengths: torch.Tensor | None = None, launch: DecodeLaunch | None = None,
                     table: torch.Tensor | None = None, page_size: int = 0,
                     length: int | None = None, shared: bool = False, plan: FitPlan | None = None) -> torch.Tensor:
    """Attention of a few queries over a long KV (flash-decoding): q [B, Hq, T, D], k/v [B, Hkv, L, D],
    bias additive, broadcastable to [B, 1, T, L] -> [B, Hq, T, D]; each sequence of a batch (a batched
    round's rows) is its own set of programs. The KV length is split across programs and each KV
    head's query heads share one read of its keys (grouped heads), then a second kernel merges the
    splits (none with one split). SDPA here runs one block per query head over all of L: ~25 us a
    layer for a 17-node tree at 1K context on an H200, most of a verify's cost beyond an AR step.

    lengths: [B] ints on the device, how many leading keys sequence b may attend (its bias must mask
    the rest, or they are ignored regardless): the bucket's padding past them costs no key reads (used
    for up to DECODE_LENGTHS_MAX_QUERIES queries a sequence, unless a launch is given).
    launch: a fixed launch shape (the probe's sweep); by default decode_launch's, whose split a batch of
    several queries a row over a shared context takes from its rows' lengths instead (fitted_attention).
    table, page_size, length: paged keys: k/v are a pool's layer [1, Hkv, slots, D], sequence b's key n
    at slot table[b, n // page_size] * page_size + n % page_size ([B, width] long), `length` keys each
    (the bucket, which the bias covers).
    shared (with lengths): the caller's promise that every query of row b sees its keys before
    lengths[b] - T (its context: a tree's nodes or a drafter's block follow it), so the bias is read
    only over the last T keys; lengths are then kept whatever the query count.
    plan: the fitted split's plan for these lengths and shapes, made once for a pass's layers
    (tree_attention_plan); made here where the fit applies and none is given."""
    batch, hq, t, d = q.shape
    hkv = k.shape[1]
    paged = table is not None
    if not paged:
        length = k.shape[2]
    g = hq // hkv
    rows = g * t
    if shared and lengths is None:
        raise ValueError("a shared context needs each row's lengths")
    if t > DECODE_LENGTHS_MAX_QUERIES and launch is None and not shared:
        lengths = None
    rule = decode_launch(batch, t, rows, length, hkv) if launch is None else None
    block_r, split, warps, stages, _ = launch or rule
    rows_pad = -(-rows // block_r) * block_r
    n_splits = -(-length // split)
    bias3 = bias.reshape(bias.shape[0], bias.shape[-2], length)  # [B or 1, T or 1, L]
    if bias3.stride(-1) != 1:
        bias3 = bias3.contiguous()
    # laid out [B, T, Hq, D] (returned as a [B, Hq, T, D] view): the output projection reads each
    # token's heads as one row, so its input needs no transposing copy
    out = torch.empty(batch, t, hq, d, device=q.device, dtype=q.dtype).transpose(1, 2)
    has_lengths = lengths is not None
    if has_lengths and lengths.shape != (batch,):
        raise ValueError(f"lengths {tuple(lengths.shape)} for a batch of {batch}")
    block_n = key_block(launch or rule, d)
    if rule is not None and shared and takes_fitted_split(batch, t, rule, hkv, rows, q.device):
        fitted_attention(q, k, v, bias3, lengths, out, table, page_size, length, block_r, warps, stages, block_n,
                         plan)
        return out
    direct = n_splits == 1
    if direct:
        part = ml = out  # unused
    else:
        part = torch.empty(batch * hkv, n_splits, rows_pad, d, device=q.device, dtype=torch.float32)
        ml = torch.empty(batch * hkv, n_splits, rows_pad, 2, device=q.device, dtype=torch.float32)
    lens = lengths if has_lengths else out  # unused without lengths
    _decode_attn_part_kernel[(batch * hkv, n_splits, rows_pad // block_r)](
        q, k, v, bias3, lens, part, ml, out, table if paged else lens, q.stride(0), q.stride(1), q.stride(2),
        0 if paged else k.stride(0), k.stride(1), k.stride(2), 0 if paged else v.stride(0), v.stride(1), v.stride(2),
        bias3.stride(0) if bias3.shape[0] > 1 else 0, bias3.stride(1) if bias3.shape[1] > 1 else 0, out.stride(0),
        out.stride(1), out.stride(2), table.stride(0) if paged else 0, hkv, t, length, rows_pad, d ** -0.5,
        SPLIT=split, G=g, D=d, BLOCK_R=block_r, BLOCK_N=min(block_n, split),
        HAS_LENGTHS=has_lengths, DIRECT=direct, PAGE=page_size if paged else 0, SHARED=shared, num_warps=warps,
        num_stages=stages)
    if not direct:
        _decode_attn_reduce_kernel[(batch * hkv, rows)](
            part, ml, lens, out, out.stride(0), out.stride(1), out.stride(2), hkv, t, length, rows_pad, n_splits,
            SPLIT=split, G=g, D=d, BLOCK_S=max(2, triton.next_power_of_2(n_splits)), HAS_LENGTHS=has_lengths)
    return out


class FitPlan(NamedTuple):
    """The fitted split's work for one pass's attention at its rows' lengths (fit_plan): made once, read by
    every layer that has the pass's shapes."""
    meta: torch.Tensor    # [B + 1] int32 on the device: the split, each row's first item
    items: torch.Tensor   # [n, 4] int32 on the device: each item's row, first and last key, KV head and row block
    kv_heads: int
    row_blocks: int
    length: int           # the keys' bucket


def fit_plan(lengths: torch.Tensor, length: int, kv_heads: int, row_blocks: int, block_n: int) -> FitPlan:
    """The work items of a batch over a shared context with the split fitted to its rows' lengths (one
    program on the device: _fit_plan_kernel): within FIT_WAVES waves of programs (one a multiprocessor),
    or a span a row where the rows alone are more."""
    batch = lengths.shape[0]
    programs = fit_programs(lengths.device)
    n = max(FIT_WAVES * programs, batch * kv_heads * row_blocks)
    meta = torch.empty(batch + 1, device=lengths.device, dtype=torch.int32)
    items = torch.empty(n, 4, device=lengths.device, dtype=torch.int32)
    _fit_plan_kernel[(1,)](lengths, meta, items, batch, length, kv_heads, programs, FIT_WAVES, FIT_PROGRAM_KEYS, n,
                           ROW_BLOCKS=row_blocks, BLOCK_N=block_n, BLOCK_B=max(2, triton.next_power_of_2(batch)),
                           BLOCK_I=triton.next_power_of_2(n))
    return FitPlan(meta, items, kv_heads, row_blocks, length)


def tree_attention_plan(lengths: torch.Tensor | None, length: int, queries: int, q_heads: int, kv_heads: int,
                        head_dim: int) -> FitPlan | None:
    """A batched tree pass's attention plan, made once for all its layers (the model's `prepare`), where
    its attention takes the fitted split (decode_attention: DECODE_FIT_SPLIT, over a shared context, the
    rule's launch of 8 warps); None elsewhere."""
    rows = q_heads // kv_heads * queries
    if (lengths is None or not _use_triton(lengths) or not DECODE_SHARED_CONTEXT
            or not decode_kernel_shape(head_dim, rows)):
        return None
    launch = decode_launch(lengths.shape[0], queries, rows, length, kv_heads)
    if not takes_fitted_split(lengths.shape[0], queries, launch, kv_heads, rows, lengths.device):
        return None
    return fit_plan(lengths, length, kv_heads, -(-rows // launch.block_rows), key_block(launch, head_dim))


def fitted_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias3: torch.Tensor, lengths: torch.Tensor,
                     out: torch.Tensor, table: torch.Tensor | None, page_size: int, length: int, block_r: int,
                     warps: int, stages: int, block_n: int, plan: FitPlan | None = None) -> torch.Tensor:
    """decode_attention of a batch over a shared context with the split fitted to the rows' lengths
    (DECODE_FIT_SPLIT) into `out`: the work items of `plan` (made here unless given for these shapes), a
    program an item, then one merge a query row. The grids and the buffers depend on the shapes alone, so
    a CUDA graph replays it at any lengths. Returns the plan's meta (the split, each row's first item: the
    tests read them)."""
    batch, hq, t, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    paged = table is not None
    row_blocks = -(-g * t // block_r)
    if plan is None or (plan.kv_heads, plan.row_blocks, plan.length) != (hkv, row_blocks, length):
        plan = fit_plan(lengths, length, hkv, row_blocks, block_n)
    n = plan.items.shape[0]
    part = torch.empty(n, block_r, d, device=q.device, dtype=torch.float32)
    ml = torch.empty(n, block_r, 2, device=q.device, dtype=torch.float32)
    _decode_attn_fit_kernel[(n,)](
        q, k, v, bias3, lengths, part, ml, plan.items, table if paged else lengths, q.stride(0), q.stride(1),
        q.stride(2), 0 if paged else k.stride(0), k.stride(1), k.stride(2), 0 if paged else v.stride(0), v.stride(1),
        v.stride(2), bias3.stride(0) if bias3.shape[0] > 1 else 0, bias3.stride(1) if bias3.shape[1] > 1 else 0,
        table.stride(0) if paged else 0, t, length, d ** -0.5, G=g, D=d, BLOCK_R=block_r, ROW_BLOCKS=row_blocks,
        BLOCK_N=block_n, PAGE=page_size if paged else 0, SHARED=True, num_warps=warps, num_stages=stages)
    _decode_attn_fit_reduce_kernel[(batch * hkv, g * t)](
        part, ml, lengths, plan.meta, out, out.stride(0), out.stride(1), out.stride(2), hkv, t, length, G=g, D=d,
        BLOCK_R=block_r, ROW_BLOCKS=row_blocks, MERGE_CHUNK=FIT_MERGE_CHUNK)
    return plan.meta

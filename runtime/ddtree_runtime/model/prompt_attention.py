"""A prompt piece's attention over a long cached prefix (an agent's second turn: ~200 new tokens after
16K reused ones), on CUDA in 16 bits.

Why: the graphed prompt pass attends over a key bucket (a doubling: 32,768 keys for 16,584) through an
additive [W, L] bias, so SDPA reads and scores twice the keys, after a copy of all of them out of the
pages (17.5 + 2.9 ms of a 58.9 ms second turn on the 27B, H200). Here the row's keys are copied only
up to its length (pages past it are skipped on the device, so a CUDA graph keeps one shape), and
FlashAttention-2's varlen kernel (PyTorch's build) reads only the first `lengths[b]` of them
(`seqused_k`), causal with the queries aligned to the end of those keys. No bias is read."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: prompt_flash_fits is False there
    triton = None

FLASH_HEAD_DIMS = (64, 128, 256)  # head dims FlashAttention-2 takes that the runtime's models use


def prompt_flash_fits(q: torch.Tensor) -> bool:
    """Shapes this path takes: CUDA, 16 bits, a FlashAttention-2 head dim (float32 runs, as the
    agreement checks do, keep SDPA over the bias)."""
    return (triton is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] in FLASH_HEAD_DIMS)


if triton is not None:
    @triton.jit
    def _gather_pages_kernel(src_ptr, dst_ptr, block_ptr, lengths_ptr, stride_sh, stride_db, stride_dh,
                             stride_bb, PAGE: tl.constexpr, D: tl.constexpr):
        # one program per (page of the bucket, row, KV head): copies the page if it holds a key the
        # row may attend, and does nothing past the row's length (what is left there is never read)
        page, row, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if page * PAGE < tl.load(lengths_ptr + row):
            phys = tl.load(block_ptr + row * stride_bb + page).to(tl.int64)
            t = tl.arange(0, PAGE)[:, None]
            d = tl.arange(0, D)[None, :]
            x = tl.load(src_ptr + head * stride_sh + (phys * PAGE + t) * D + d)
            tl.store(dst_ptr + row * stride_db + head * stride_dh + (page * PAGE + t) * D + d, x)


def gather_pages(pool: torch.Tensor, block: torch.Tensor, page_size: int, lengths: torch.Tensor,
                 kv_len: int) -> torch.Tensor:
    """One layer's pool [Hkv, slots, D] -> the rows' first kv_len keys [B, Hkv, kv_len, D], copied only
    up to each row's lengths[b] (rounded up to a page); the rest is left as allocated."""
    heads, _, d = pool.shape
    rows, pages = block.shape[0], -(-kv_len // page_size)
    out = torch.empty(rows, heads, pages * page_size, d, dtype=pool.dtype, device=pool.device)
    _gather_pages_kernel[(pages, rows, heads)](pool, out, block, lengths, pool.stride(0), out.stride(0),
                                               out.stride(1), block.stride(0), PAGE=page_size, D=d)
    return out[:, :, :kv_len]


def attend_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, W, D] at positions lengths[b] - W.. of row b; k, v [B, Hkv, L, D] (L >= lengths[b],
    the keys past lengths[b] never read) -> [B, Hq, W, D]. Query i of row b attends keys 0..lengths[b]
    - W + i (causal, aligned to the end of the row's keys), softmax scale 1/sqrt(D) as SDPA's."""
    b, hq, w, d = q.shape
    keys = k.shape[2]
    # [B*W, Hq, D] and [B*L, Hkv, D]: views where the layouts allow (a gathered k is row-major per head)
    qf, kf, vf = (x.transpose(1, 2).reshape(-1, x.shape[1], d) for x in (q, k, v))
    steps = torch.arange(b + 1, device=q.device, dtype=torch.int32)
    out = torch.ops.aten._flash_attention_forward(
        qf, kf, vf, steps * w, steps * keys, w, keys, 0.0, True, False,
        seqused_k=lengths.to(torch.int32))[0]
    return out.view(b, w, hq, d).transpose(1, 2)

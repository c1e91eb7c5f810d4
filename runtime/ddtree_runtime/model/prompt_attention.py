"""A prompt piece's attention over a long cached prefix (an agent's second turn: ~200 new tokens after
16K reused ones), on CUDA in 16 bits.

Why: the graphed prompt pass attends over a key bucket (a doubling: 32,768 keys for 16,584) through an
additive [W, L] bias, so SDPA reads and scores twice the keys, after a copy of all of them out of the
pages (17.5 + 2.9 ms of a 58.9 ms second turn on the 27B, H200). Here the row's keys are copied only
up to its length (pages past it are skipped on the device, so a CUDA graph keeps one shape), and
FlashAttention-2's varlen kernel (PyTorch's build) reads only the first `lengths[b]` of them
(`seqused_k`), causal with the queries aligned to the end of those keys. No bias is read.

Over a long prefix the keys are also split: one call over W queries grids W/64 x heads programs (96 on
the 27B at W = 256, for 132 SMs), each walking all 16K keys. The prefix every query sees whole is cut
into `splits` parts, each its own varlen sequence of one non-causal call (the queries repeated), the
piece's own W keys one causal call, and the parts merged by their log-sum-exps (one Triton pass)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: prompt_flash_fits is False there
    triton = None

FLASH_HEAD_DIMS = (64, 128, 256)  # head dims FlashAttention-2 takes that the runtime's models use
# the prefix's parts from a key bucket of SPLIT_FROM on; on the H200 (27B's 24 x 256 heads, 16K prefix,
# attn_probe.py --prefill) 8 parts took 418 / 657 us against one call's 505 / 869 at W = 256 / 384, and
# 1-6 parts fell between (wave quantisation: 96 programs a part at W = 256 for 132 SMs)
PREFIX_SPLITS, SPLIT_FROM = 8, 16384


def prompt_splits(kv_len: int) -> int:
    """How many parts a piece's prefix is cut into for a key bucket of kv_len (a host value, fixed per
    graph): none below SPLIT_FROM, where the parts' extra call and merge were not measured to pay."""
    return PREFIX_SPLITS if kv_len >= SPLIT_FROM else 0


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


def attend_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                  splits: int = 0) -> torch.Tensor:
    """q [B, Hq, W, D] at positions lengths[b] - W.. of row b; k, v [B, Hkv, L, D] (L >= lengths[b],
    the keys past lengths[b] never read) -> [B, Hq, W, D]. Query i of row b attends keys 0..lengths[b]
    - W + i (causal, aligned to the end of the row's keys), softmax scale 1/sqrt(D) as SDPA's.
    splits > 0: the prefix (keys before lengths[b] - W) in that many parts, merged (the module's doc)."""
    b, hq, w, d = q.shape
    keys = k.shape[2]
    # [B*W, Hq, D] and [B*L, Hkv, D]: views where the layouts allow (a gathered k is row-major per head)
    qf, kf, vf = (x.transpose(1, 2).reshape(-1, x.shape[1], d) for x in (q, k, v))
    steps = torch.arange(b + 1, device=q.device, dtype=torch.int32)
    lengths = lengths.to(torch.int32)
    if splits == 0:
        out = _flash(qf, kf, vf, steps * w, steps * keys, w, keys, lengths, causal=True)[0]
        return out.view(b, w, hq, d).transpose(1, 2)
    row_start = steps[:-1] * keys                                   # [B] each row's first key
    prefix = lengths - w                                            # [B] keys every query sees
    part = (prefix + splits - 1) // splits                          # [B] keys per part (the last shorter)
    first = torch.arange(splits, device=q.device, dtype=torch.int32)[:, None] * part   # [S, B]
    used = (prefix - first).clamp(min=0).minimum(part)              # [S, B] keys in each part (0: none)
    starts = torch.cat([(row_start + first).flatten(), used.new_zeros(1)])   # sequence j*B + b's first key
    many = torch.arange(splits * b + 1, device=q.device, dtype=torch.int32) * w
    parts, part_lse = _flash(qf.repeat(splits, 1, 1), kf, vf, many, starts, w, keys, used.flatten(), causal=False)
    own, own_lse = _flash(qf, kf, vf, steps * w, torch.cat([row_start + prefix, row_start[:1]]), w, w,
                          lengths.new_full((b,), w), causal=True)
    return merge_parts(parts.view(splits, b * w, hq, d), part_lse.view(hq, splits, b * w), used, own,
                       own_lse.view(hq, b * w), w).view(b, w, hq, d).transpose(1, 2)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
           max_q: int, max_k: int, used_k: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 varlen: sequence i's queries q[cu_q[i]:cu_q[i+1]], its keys the used_k[i] from
    cu_k[i] (with seqused_k the kernel reads no other entry of cu_k). Returns the output [Tq, Hq, D] and
    each query's log-sum-exp [Hq, Tq]."""
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                       seqused_k=used_k)[:2]
    return out, lse


if triton is not None:
    @triton.jit
    def _merge_parts_kernel(parts_ptr, part_lse_ptr, used_ptr, own_ptr, own_lse_ptr, out_ptr, TOKENS, WIDTH,
                            stride_pj, stride_pt, stride_ph, stride_lh, stride_lj, stride_ot, stride_oh,
                            stride_oh_lse, SPLITS: tl.constexpr, D: tl.constexpr):
        # one program per (query, head): the softmax over all parts' keys from each part's normalised
        # output and log-sum-exp; a part with no keys (used 0) weighs nothing
        t, h = tl.program_id(0), tl.program_id(1)
        rows = TOKENS // WIDTH
        row = t // WIDTH
        cols = tl.arange(0, D)
        m = tl.load(own_lse_ptr + h * stride_oh_lse + t)
        for j in tl.static_range(SPLITS):
            lse = tl.load(part_lse_ptr + h * stride_lh + j * stride_lj + t)
            live = tl.load(used_ptr + j * rows + row) > 0
            m = tl.where(live, tl.maximum(m, lse), m)
        own_w = tl.exp(tl.load(own_lse_ptr + h * stride_oh_lse + t) - m)
        acc = own_w * tl.load(own_ptr + t * stride_ot + h * stride_oh + cols).to(tl.float32)
        total = own_w
        for j in tl.static_range(SPLITS):
            lse = tl.load(part_lse_ptr + h * stride_lh + j * stride_lj + t)
            live = tl.load(used_ptr + j * rows + row) > 0
            wt = tl.where(live, tl.exp(lse - m), 0.0)
            part = tl.load(parts_ptr + j * stride_pj + t * stride_pt + h * stride_ph + cols).to(tl.float32)
            acc += tl.where(live, wt * part, 0.0)   # an empty part's output is never read into the sum
            total += wt
        tl.store(out_ptr + t * stride_ot + h * stride_oh + cols, (acc / total).to(out_ptr.dtype.element_ty))


def merge_parts(parts: torch.Tensor, part_lse: torch.Tensor, used: torch.Tensor, own: torch.Tensor,
                own_lse: torch.Tensor, width: int) -> torch.Tensor:
    """The attention over all keys from its parts: parts [S, T, Hq, D] over the prefix's parts (used
    [S, B] keys each, T = B * width queries), own [T, Hq, D] over the piece's own keys, each with its
    log-sum-exp ([Hq, S, T], [Hq, T]). Returns [T, Hq, D] in own's dtype. The piece's own part always
    has keys (its first query sees itself), so every query has a finite maximum."""
    splits, tokens, heads, d = parts.shape
    out = torch.empty_like(own)
    _merge_parts_kernel[(tokens, heads)](parts, part_lse, used, own, own_lse, out, tokens, width,
                                         parts.stride(0), parts.stride(1), parts.stride(2), part_lse.stride(0),
                                         part_lse.stride(1), own.stride(0), own.stride(1), own_lse.stride(0),
                                         SPLITS=splits, D=d)
    return out

"""The prompt piece's FlashAttention path (model/prompt_attention.py) on a CUDA GPU: it exists only there
(FlashAttention-2 has no CPU build), so CI skips this file and the GPU calls run it (docs/performance.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree_runtime.model.prompt_attention import attend_prompt, gather_pages, prompt_flash_fits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention-2 runs on CUDA only")


@pytest.mark.parametrize("splits", [0, 1, 3])
@pytest.mark.parametrize("hq,hkv,d", [(24, 4, 256), (32, 8, 128)])
def test_prompt_attention_over_pages_matches_sdpa_over_the_rows_keys(hq, hkv, d, splits):
    """Rows of different prefix lengths in one key bucket, their keys scattered over pages: equal (to
    bf16's rounding) to SDPA over each row's own keys with the causal mask aligned to their end, in one
    call or with the prefix in parts (the last row has no prefix: every part of it is empty)."""
    torch.manual_seed(0)
    dev, dt, page, width, bucket = "cuda", torch.bfloat16, 16, 48, 1024
    lengths = torch.tensor([1000, 300, 48], device=dev)
    table = (torch.randperm(3 * bucket // page, device=dev) + 1).view(3, -1)
    pool_k = torch.randn(hkv, (table.numel() + 1) * page, d, device=dev, dtype=dt)
    pool_v = torch.randn_like(pool_k)
    q = torch.randn(3, hq, width, d, device=dev, dtype=dt)
    assert prompt_flash_fits(q)
    k, v = (gather_pages(p, table, page, lengths, bucket) for p in (pool_k, pool_v))
    got = attend_prompt(q, k, v, lengths, splits)
    for row, n in enumerate(lengths.tolist()):
        slots = (table[row, :, None] * page + torch.arange(page, device=dev)).flatten()[:n]
        kr, vr = pool_k[None, :, slots], pool_v[None, :, slots]
        allowed = torch.arange(n, device=dev)[None] <= torch.arange(n - width, n, device=dev)[:, None]
        want = F.scaled_dot_product_attention(q[row:row + 1].float(), kr.float(), vr.float(), attn_mask=allowed,
                                              enable_gqa=True)
        assert (got[row:row + 1].float() - want).abs().max().item() < 2e-2, row


@pytest.mark.parametrize("splits", [0, 2])
def test_prompt_attention_is_captured_and_replayed_in_a_cuda_graph(splits):
    """The graphed prompt pass replays it with new lengths: the result follows the lengths on the device."""
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, 8, 32, 128, device=dev, dtype=dt)
    k, v = torch.randn(2, 1, 2, 512, 128, device=dev, dtype=dt)
    lengths = torch.tensor([512], device=dev)
    attend_prompt(q, k, v, lengths, splits)   # first use outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend_prompt(q, k, v, lengths, splits)
    for n in (512, 100, 32):
        lengths.fill_(n)
        graph.replay()
        # a bucket of n keys: the same arithmetic, but FlashAttention may split the keys differently
        want = attend_prompt(q, k[:, :, :n], v[:, :, :n], torch.tensor([n], device=dev))
        assert (out.float() - want.float()).abs().max().item() < 1e-2, n

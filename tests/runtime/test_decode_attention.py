"""The graphed decode path's attention forms agree with plain SDPA (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree_runtime.model.layers import attend_decode, attend_grouped


@pytest.mark.parametrize("t,length", [(1, 64), (17, 300), (17, 2048), (65, 128)])
def test_grouped_and_decode_attention_match_sdpa(t, length):
    g = torch.Generator().manual_seed(t * length)
    q = torch.randn(1, 8, t, 16, generator=g)
    k, v = (torch.randn(1, 2, length, 16, generator=g) for _ in range(2))
    allowed = torch.rand(t, length, generator=g) < 0.6
    allowed[:, 0] = True
    bias = torch.zeros(t, length).masked_fill(~allowed, float("-inf"))[None, None]
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=bias)
    torch.testing.assert_close(attend_grouped(q, k, v, bias), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attend_decode(q, k, v, bias), ref, rtol=1e-5, atol=1e-5)
    # per-row key lengths only cut the kernel's loop; the torch forms attend by the bias alone
    assert torch.equal(attend_decode(q, k, v, bias, torch.tensor([length])), attend_decode(q, k, v, bias))

"""The batched tree attention over the paged pool (model/kernels.py: decode_attention over a shared context)
on a CUDA GPU at the two served shapes' heads, with the split fitted to the rows' lengths (served) and
the bucket's: both against float64, rows of equal length and one long row among short ones. CI has no GPU
and skips this file, the GPU calls run it (test_triton_kernels.py checks the same kernels through
Triton's interpreter on the CPU, on smaller tiles)."""

from __future__ import annotations

import pytest
import torch

import ddtree_runtime.model.kernels as K

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels run on CUDA only")

PAGE, T = 16, 17
DEVICE = "cuda"


def batch(rows: int, heads: tuple[int, int, int], lengths: list[int], bucket: int, seed: int = 0):
    """A tree pass's attention inputs over a paged pool (each row's pages scattered), its bias (the context
    seen by every node, then the tree's ancestors) and the rows' caches laid out densely for the reference."""
    hq, hkv, d = heads
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    width = bucket // PAGE
    table = torch.randperm(rows * width, generator=gen, device=DEVICE).view(rows, width)
    pool = torch.randn(2, 1, hkv, rows * width * PAGE, d, generator=gen, device=DEVICE).to(torch.bfloat16)
    slots = (table[:, :, None] * PAGE + torch.arange(PAGE, device=DEVICE)).view(rows, bucket)   # [B, L]
    dense = pool[:, 0][:, :, slots].permute(0, 2, 1, 3, 4)                                       # [2, B, Hkv, L, D]
    q = torch.randn(rows, hq, T, d, generator=gen, device=DEVICE).to(torch.bfloat16)
    length = torch.tensor(lengths, device=DEVICE)
    keys = torch.arange(bucket, device=DEVICE)
    context = keys < (length - T)[:, None]                                                      # [B, L]
    ancestors = torch.rand(rows, T, T, generator=gen, device=DEVICE).tril() > 0.5
    ancestors |= torch.eye(T, dtype=torch.bool, device=DEVICE)
    rel = (keys - (length - T)[:, None]).clamp(0, T - 1)                                         # [B, L]
    own = ancestors.gather(2, rel[:, None, :].expand(-1, T, -1)) & ~context[:, None] & (keys < length[:, None])[:, None]
    bias = torch.where(context[:, None] | own, 0.0, float("-inf")).to(torch.bfloat16)[:, None]   # [B, 1, T, L]
    return q, pool, table, dense, bias, length


def reference(q: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    g = q.shape[1] // dense.shape[2]
    k, v = (x.repeat_interleave(g, 1).double() for x in dense)
    s = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return torch.softmax(s + bias.double(), -1) @ v


@pytest.mark.parametrize("heads", [(24, 4, 256), (32, 8, 128)], ids=["27b", "8b"])
@pytest.mark.parametrize("lengths", [[4100, 4090, 4077, 4100, 4066, 4099, 4080, 4095],
                                     [4100, 256, 300, 17, 512, 1000, 64, 200]], ids=["equal", "one-long"])
def test_the_fitted_and_the_buckets_split_both_match_float64(monkeypatch, heads, lengths):
    q, pool, table, dense, bias, length = batch(len(lengths), heads, lengths, 4608)
    want = reference(q, dense, bias)
    got, plans = {}, {}
    for fitted in (True, False):
        monkeypatch.setattr(K, "DECODE_FIT_SPLIT", fitted)
        plans[fitted] = K.tree_attention_plan(length, 4608, T, heads[0], heads[1], heads[2])
        got[fitted] = K.decode_attention(q, pool[0], pool[1], bias, length, table=table, page_size=PAGE,
                                         length=4608, shared=True, plan=plans[fitted])
        err = (got[fitted].double() - want).abs().max().item()
        assert err < 2e-2, (fitted, err)
    assert plans[False] is None and plans[True] is not None    # eight rows fill at most half a wave of 132
    assert plans[True].meta[0].item() < max(lengths)            # the longest row cut into spans
    # the fit's partial softmaxes sum in another order: the two agree to bf16's rounding
    assert (got[True].double() - got[False].double()).abs().max().item() < 2e-2

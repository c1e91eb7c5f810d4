"""The commit's conv tail kernel (model/gdn_kernels.conv_tail) on a CUDA GPU at the Qwen3.6-27B's width
(48 linear layers' tails of 3 x 10,240 channels, 16 rows): the kernel's threads read tail slots others
overwrite, which Triton's interpreter (test_triton_kernels.py) runs in order and cannot show. CI has no
GPU and skips this file; the GPU calls run it (h200.sh cuda-tests)."""

from __future__ import annotations

import pytest
import torch

import ddtree_runtime.model.gdn_kernels as G
from ddtree_runtime.model.gated_delta import conv_tail_torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels run on CUDA only")


@pytest.mark.parametrize("lengths", [[1] * 16, [2] * 16, [1, 2, 3, 4, 5, 8, 16, 17] * 2])
def test_the_conv_tail_kernel_equals_the_torch_commit_at_the_27b_width(lengths):
    n, b, k1, c, t = 48, 16, 3, 10240, 17
    gen = torch.Generator(device="cuda").manual_seed(sum(lengths))
    conv = torch.randn(n, b, k1, c, generator=gen, device="cuda").to(torch.bfloat16)
    inputs = torch.randn(n, b, t, c, generator=gen, device="cuda").to(torch.bfloat16)
    nodes = torch.stack([torch.randperm(t, generator=gen, device="cuda") for _ in range(b)])
    length = torch.tensor(lengths, device="cuda")
    expected, got = conv.clone(), conv.clone()
    conv_tail_torch(expected, inputs, nodes, length)
    G.conv_tail(got, inputs, nodes, length)
    assert torch.equal(got, expected)

"""The prompt piece's fused Gated DeltaNet path (model/gdn_prompt.py: Triton kernels around fla-core's
chunked calls) on a CUDA GPU: fla-core runs only there, so CI skips this file and the GPU calls run it
(the interpreter tests in test_triton_kernels.py check each kernel against torch on the CPU)."""

from __future__ import annotations

import pytest
import torch

import ddtree_runtime.model.qwen3_5 as qwen3_5
from ddtree_runtime.engine.kv_cache import HybridCache
from ddtree_runtime.model import Qwen35Config
from ddtree_runtime.model.gdn_chunk import PaddedPrompt, _fla_chunk
from ddtree_runtime.model.gdn_prompt import prompt_fits
from ddtree_runtime.model.layers import TreeInputs, fuse_projections
from ddtree_runtime.model.qwen3_5 import Qwen35ForCausalLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or _fla_chunk() is None,
                                reason="fla-core's kernels run on CUDA only")

# (start, real tokens, width, keep): from zeros and from a carried state; the state kept at the first
# token, at the piece's end, past a chunk, inside the conv's reach; a full piece; one token
PIECES = [(0, 5, 64, None), (0, 70, 128, 70), (9, 1, 64, 1), (9, 129, 256, 64), (40, 33, 64, 2),
          (300, 256, 256, None), (16, 256, 256, 100)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen35Config(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                       linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2,
                       linear_num_value_heads=4)
    model = Qwen35ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1, 1)
            if "norm" in name:
                p.normal_(1, 0.3)
    model.to("cuda", torch.bfloat16)
    fuse_projections(model)   # the in-projection's parts are strided views, as in service
    return model


def filled_cache(cfg: Qwen35Config) -> HybridCache:
    """Three rows of random tails and states; row 0 holds row 2's (one sequence, two places)."""
    cache = HybridCache(cfg, 8, "cuda", torch.bfloat16, batch=3, snapshots=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for t in cache._states():
        t.copy_(torch.randn(t.shape, generator=gen, device="cuda") * 0.5)
    cache.conv[:, 0], cache.state[:, 0] = cache.conv[:, 2], cache.state[:, 2]
    return cache


def padded(layer, x: torch.Tensor, cache: HybridCache, start: int, length: int, keep: int | None) -> torch.Tensor:
    prompt = PaddedPrompt(torch.tensor([2], device="cuda"), torch.tensor([start > 0], device="cuda"),
                          torch.tensor([length], device="cuda"),
                          None if keep is None else torch.tensor([keep], device="cuda"))
    return layer(x, cache, start, TreeInputs(None, None, 0, None, prompt=prompt))


@pytest.mark.parametrize("start,length,width,keep", PIECES)
@torch.inference_mode()
def test_fused_piece_is_the_torch_padded_piece_and_the_eager_pass(model, monkeypatch, start, length, width, keep):
    """The fused path's output, conv tails (the same bits), state and snapshot equal (to bf16's rounding)
    the torch padded path's over fla, and the eager prompt pass's (GatedDeltaNet._chain) over the real
    tokens; no other row changes."""
    layer = model.model.layers[0].linear_attn
    x = torch.randn(1, width, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert prompt_fits(x, layer.dk, layer.dv, layer.kernel)
    fused_cache = filled_cache(model.config)
    untouched = [t[:, 1].clone() for t in fused_cache._states()]
    got = padded(layer, x, fused_cache, start, length, keep)
    with monkeypatch.context() as patch:
        patch.setattr(qwen3_5, "prompt_fits", lambda *args: False)
        torch_cache = filled_cache(model.config)
        want = padded(layer, x, torch_cache, start, length, keep)
    eager_cache = filled_cache(model.config)
    eager = eager_cache.rows(0, 1)
    eager.keep_at = keep
    eager_out = layer(x[:, :length], eager, start, None)

    close = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[:, :length], want[:, :length], **close)
    torch.testing.assert_close(got[:, :length], eager_out, **close)
    states = fused_cache._states() if keep is not None else fused_cache._states()[:2]
    for ours, theirs in zip(states, torch_cache._states()):
        torch.testing.assert_close(ours[layer.slot], theirs[layer.slot], **close)
    for ours, theirs in zip(states, eager_cache._states()):
        torch.testing.assert_close(ours[layer.slot, 2], theirs[layer.slot, 0], **close)
    assert torch.equal(fused_cache.conv[layer.slot, 2], torch_cache.conv[layer.slot, 2])
    if keep is not None:
        assert torch.equal(fused_cache.snap_conv[layer.slot, 2], torch_cache.snap_conv[layer.slot, 2])
    assert all(torch.equal(t[:, 1], before) for t, before in zip(fused_cache._states(), untouched))


@torch.inference_mode()
def test_fused_piece_is_captured_and_replayed_in_a_cuda_graph(model):
    """PrefillRunner replays one graph for every piece of a width: the fused path follows the row, the
    length, the resume flag and `keep` on the device (no host sync, nothing fixed at capture)."""
    layer = model.model.layers[0].linear_attn
    width = 128
    cache = filled_cache(model.config)
    x = torch.zeros(1, width, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    row, resume, length, keep = (torch.zeros(1, device="cuda", dtype=dt) for dt in
                                 (torch.long, torch.bool, torch.long, torch.long))
    inputs = TreeInputs(None, None, 0, None, prompt=PaddedPrompt(row, resume, length, keep))
    length.fill_(width)
    keep.fill_(1)
    layer(x, cache, 1, inputs)   # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, cache, 1, inputs)
    for r, start, n, k in [(2, 9, 70, 64), (1, 0, 128, 128), (0, 40, 5, 1)]:
        x.copy_(torch.randn_like(x))
        want_cache = filled_cache(model.config)
        want = padded(layer, x, want_cache, start, n, k)
        replayed = filled_cache(model.config)
        for ours, theirs in zip(cache._states(), replayed._states()):
            ours.copy_(theirs)
        # the graph writes row r; the reference wrote row 2: put row r's content where row 2's is compared
        for t in cache._states():
            t[:, r] = t[:, 2]
        row.fill_(r)
        resume.fill_(start > 0)
        length.fill_(n)
        keep.fill_(k)
        graph.replay()
        torch.testing.assert_close(out[:, :n], want[:, :n], atol=1e-6, rtol=0)
        for ours, theirs in zip(cache._states(), want_cache._states()):
            torch.testing.assert_close(ours[layer.slot, r], theirs[layer.slot, 2], atol=1e-6, rtol=0)

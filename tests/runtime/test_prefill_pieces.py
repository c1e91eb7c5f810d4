"""A prompt prefilled in pieces (engine/prefill.py; later pieces attend causally aligned to the end of
the cached keys, a hybrid's linear layers resume from the cached state) is the same computation as one
forward: same hidden state, features and cache, and the engine's greedy tokens do not change."""

from __future__ import annotations

import pytest
import torch

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine import prefilling
from ddtree_runtime.engine.kv_cache import HybridCache, target_cache
from ddtree_runtime.engine.prefill import prefill
from ddtree_runtime.model import load_target


@pytest.fixture(params=["qwen3", "qwen3_5"])
def pair(request, tiny_models, tiny_hybrid_models):
    return tiny_models if request.param == "qwen3" else tiny_hybrid_models


def test_pieces_equal_one_forward(pair):
    target = load_target(pair / "target")
    target.feature_layers = [0, 1]
    ids = torch.randint(0, target.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(4))
    caches = [target_cache(target.config, 512, "cpu", torch.float32) for _ in range(2)]
    with torch.no_grad():
        whole = prefill(target, ids, caches[0], piece=1000)
        pieces = prefill(target, ids, caches[1], piece=37)   # 37 + 37 + 37 + 37 + 2
    for a, b in zip(whole, pieces):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert pieces[1].shape == (1, 150, 2 * target.config.hidden_size)
    # float32 rounding: fixture v2's hybrid keys reach |8|, and differ by up to 1.5e-5 between the two
    assert torch.allclose(caches[0].k[:, :, :, :150], caches[1].k[:, :, :, :150], atol=5e-5)
    assert torch.allclose(caches[0].v[:, :, :, :150], caches[1].v[:, :, :, :150], atol=5e-5)
    if isinstance(caches[0], HybridCache):
        assert torch.allclose(caches[0].state, caches[1].state, atol=1e-5)
        assert torch.allclose(caches[0].conv, caches[1].conv, atol=1e-5)


def test_engine_tokens_are_the_same_with_pieces(pair, monkeypatch):
    engine = Engine(EngineConfig(str(pair / "target"), str(pair / "draft"), max_context=512))
    prompt = torch.randint(0, 200, (120,), generator=torch.Generator().manual_seed(5)).tolist()

    def tokens(mode: str) -> list[int]:
        params = SamplingParams(max_new_tokens=24, mode=mode, tree_budget=16)
        return [t for out in engine.generate(prompt, params) for t in out.token_ids]
    whole = {mode: tokens(mode) for mode in ("ar", "ddtree")}
    monkeypatch.setattr(prefilling, "PREFILL_PIECE", 50)  # the engine's prefill steps go 50 tokens a forward
    assert {mode: tokens(mode) for mode in ("ar", "ddtree")} == whole
    assert whole["ar"] == whole["ddtree"] and len(whole["ar"]) == 24

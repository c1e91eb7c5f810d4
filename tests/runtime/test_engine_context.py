"""The context the engine serves: the model's positions by default, shortened to what memory holds
(with a warning), and a configured context that cannot fit refused at start with the longest that can."""

from __future__ import annotations

import logging

import pytest

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine.context import MIN_CONTEXT, serving_context


def linear(per_token: int, fixed: int = 0):
    return lambda context: fixed + per_token * context


def test_default_is_the_models_positions_when_they_fit():
    assert serving_context(None, 262144, linear(10), 262144 * 10, "cuda") == 262144


def test_default_is_shortened_to_the_longest_that_fits(caplog):
    with caplog.at_level(logging.WARNING):
        assert serving_context(None, 262144, linear(10, fixed=1000), 1000 + 10 * 100_000, "cuda:0") == 100_000
    assert "the target's 262144 positions needs" in caplog.text and "serving a context of 100000" in caplog.text


def test_configured_context_that_cannot_fit_names_the_longest_that_can():
    assert serving_context(131072, 262144, linear(10), 10 * 131072, "cuda") == 131072
    with pytest.raises(ValueError, match=r"max context 131072 needs 0\.0 GiB .* of cuda is free: the longest "
                                         r"context that fits is 92160 tokens"):
        serving_context(131072, 262144, linear(10), 10 * 92160 + 9, "cuda")
    with pytest.raises(ValueError, match="exceeds the target's max_position_embeddings 40960"):
        serving_context(131072, 40960, linear(10), 10 ** 12, "cuda")
    with pytest.raises(ValueError, match=f"not even {MIN_CONTEXT} tokens fit"):
        serving_context(None, 262144, linear(10), 10 * (MIN_CONTEXT - 1), "cuda")


@pytest.mark.parametrize("pair", ["tiny_models", "tiny_hybrid_models"])
def test_engine_serves_the_context_its_memory_holds(pair, request, monkeypatch):
    """The context chosen from free memory is one the pool then holds: both count every row the pool
    allocates (a hybrid's are large: each keeps its recurrent state), not one."""
    tiny_models = request.getfixturevalue(pair)
    full = Engine(EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft")))
    positions = full.target.config.max_position_embeddings
    assert full.max_context == positions
    half = full.needed_bytes(positions // 2)
    monkeypatch.setattr("ddtree_runtime.engine.memory.free_bytes", lambda device: half)
    engine = Engine(EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft")))
    assert engine.max_context == positions // 2
    tokens = [t for out in engine.generate([1, 2, 3], SamplingParams(max_new_tokens=5)) for t in out.token_ids]
    assert len(tokens) == 5
    with pytest.raises(ValueError, match=f"the longest context that fits is {positions // 2} tokens"):
        Engine(EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft"), max_context=positions))

"""The torch-free capacity arithmetic (ddtree_runtime/capacity.py) against what the runtime really holds:
the loaded models' parameters, the engine's cache and workspace sizes, and its constants, for both tiny
pairs (a Qwen3 target and a hybrid Qwen3.5 one) read from their config.json."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from ddtree_runtime import capacity  # noqa: E402
from ddtree_runtime.engine import context, prefill, runner  # noqa: E402
from ddtree_runtime.engine.kv_cache import target_cache_bytes  # noqa: E402
from ddtree_runtime.model import load_drafter, load_target  # noqa: E402


@pytest.fixture(params=["qwen3", "qwen3_5"])
def pair(request, tiny_models, tiny_hybrid_models):
    root = tiny_models if request.param == "qwen3" else tiny_hybrid_models
    target, draft = load_target(str(root / "target"), "cpu", "float32"), load_drafter(str(root / "draft"), "cpu", "float32")
    configs = [json.loads((root / name / "config.json").read_text()) for name in ("target", "draft")]
    return target, draft, *configs


def parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_the_parameters_are_the_loaded_models(pair):
    target, draft, tconfig, dconfig = pair
    assert capacity.Shape.from_config(tconfig).target_parameters() == parameters(target)
    # the drafter shares the target's embeddings and head
    shared = {id(p) for p in target.parameters()}
    own = sum(p.numel() for p in draft.parameters() if id(p) not in shared)
    assert capacity.Shape.from_config(dconfig).drafter_parameters() == own


def test_a_token_and_a_request_cost_what_the_engines_caches_take(pair):
    target, draft, tconfig, dconfig = pair
    shape, nodes, tokens = capacity.Shape.from_config(tconfig), 17, 1024
    for elem in (2, 4):
        engine = target_cache_bytes(target.config, tokens, nodes, elem)
        ours = tokens * shape.token_bytes(elem) + shape.state_bytes(elem) + shape.tree_scratch_bytes(nodes, elem)
        assert ours == engine
        drafter = capacity.Shape.from_config(dconfig)
        assert tokens * drafter.token_bytes(elem) == target_cache_bytes(draft.config, tokens, 1, elem)
        for n in (100, 40_000, 131_072):
            assert capacity.prefill_workspace_bytes(shape, n, drafter.feature_layers, elem) == (
                context.prefill_workspace_bytes(target.config, n, len(draft.config.target_layer_ids), elem))


def test_the_engines_constants_are_the_arithmetics():
    assert capacity.PREFILL_PIECE == prefill.PREFILL_PIECE and capacity.TREE_BUCKETS == runner.TREE_BUCKETS

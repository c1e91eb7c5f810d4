"""The torch-free capacity arithmetic (ddtree_runtime/capacity.py) against what the runtime really holds:
the loaded models' parameters, the engine's cache sizes, and the pool the engine sizes with its formulas,
for both tiny pairs (a Qwen3 target and a hybrid Qwen3.5 one) read from their config.json."""

from __future__ import annotations

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")

from ddtree_runtime import capacity  # noqa: E402
from ddtree_runtime.engine import Engine, EngineConfig  # noqa: E402
from ddtree_runtime.engine.block_manager import BlockManager, PageTable  # noqa: E402
from ddtree_runtime.engine.draft_cache import DraftCache  # noqa: E402
from ddtree_runtime.engine.kv_cache import target_cache_bytes  # noqa: E402
from ddtree_runtime.engine.memory import shape_of  # noqa: E402
from ddtree_runtime.model import load_drafter, load_target  # noqa: E402


@pytest.fixture(params=["qwen3", "qwen3_5", "qwen3-sliding"])
def pair(request, tiny_models, tiny_hybrid_models, tmp_path):
    """A tiny pair; qwen3-sliding: its drafter laid out as z-lab's (a sliding layer, then a full one),
    whose sliding layer keeps a ring per row instead of pages."""
    from ddtree_devtools.tiny import relaid_drafter

    root = tiny_hybrid_models if request.param == "qwen3_5" else tiny_models
    draft_dir = root / "draft"
    if request.param == "qwen3-sliding":
        draft_dir = relaid_drafter(draft_dir, tmp_path / "draft", 8)
    target, draft = load_target(str(root / "target"), "cpu", "float32"), load_drafter(str(draft_dir), "cpu", "float32")
    configs = [json.loads((d / "config.json").read_text()) for d in (root / "target", draft_dir)]
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
        for snapshots in (False, True):
            engine = target_cache_bytes(target.config, tokens, nodes, elem, snapshots=snapshots)
            assert tokens * shape.token_bytes(elem) + shape.request_bytes(nodes, elem, snapshots) == engine
        drafter, page = capacity.Shape.from_config(dconfig), 16
        for snapshots in (False, True):
            table = PageTable(BlockManager(tokens // page, page), 1, tokens // page, torch.device("cpu"))
            cache = DraftCache(draft.config, drafter.block_size, table, tokens, "cpu",
                               {2: torch.bfloat16, 4: torch.float32}[elem], snapshots)
            # the pages (and the scratch page) hold the full layers' KV; a row's rings the sliding layers'
            assert cache.paged.k.nbytes + cache.paged.v.nbytes == (tokens + page) * drafter.token_bytes(elem)
            assert sum(t.nbytes for t in cache._rings()) == drafter.ring_bytes(elem, drafter.block_size, snapshots)


def test_the_engine_reads_the_shapes_the_arithmetic_reads(pair):
    target, draft, tconfig, dconfig = pair
    # a drafter's block size is what the target's Shape does not use (config.json's, or 16 by default)
    assert shape_of(target.config) == dataclasses.replace(capacity.Shape.from_config(tconfig), block_size=0)
    assert shape_of(draft.config).token_bytes(2) == capacity.Shape.from_config(dconfig).token_bytes(2)


# the memory and settings the engine is sized on against the arithmetic's estimate
FREE, SETTINGS = 24 * 2**20, {"mem_fraction": 0.5, "max_running": 3, "max_context": 512, "tree_budget": 16}


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_the_engines_pool_is_the_arithmetics_estimate(pair, monkeypatch, prefix_cache):
    """The engine sizes its pool by capacity.py's formulas from the free memory it measures: on the same
    memory (its free memory plus the weights capacity.py counts), the pool holds what pool_capacity says."""
    target, draft, tconfig, dconfig = pair
    monkeypatch.setattr("ddtree_runtime.engine.memory.free_bytes", lambda device: FREE)
    engine = Engine(EngineConfig("tiny", None, device="cpu", dtype="float32", prefix_cache=prefix_cache,
                                 **SETTINGS), target=target, drafter=draft)
    estimate = capacity.pool_capacity(FREE + capacity.Shape.from_config(tconfig).target_parameters() * 4
                                      + capacity.Shape.from_config(dconfig).drafter_parameters() * 4,
                                      tconfig, dconfig, dtype="float32", prefix_cache=prefix_cache, **SETTINGS)
    tokens = engine.capacity()["tokens"]
    assert 0 < tokens < engine.rows * (512 + 1026)  # below the cap of every row at its largest tree
    assert tokens == estimate.pool_tokens // engine.page_size * engine.page_size
    assert engine.sizing.round_reserve(engine.tree_slots) == estimate.reserve_tokens


def test_a_draft_vocabulary_is_counted_as_the_head_rows_the_drafter_copies(pair, monkeypatch):
    """--draft-vocab: the drafter holds a copy of those rows of the target's head, which pool_capacity's
    draft_vocab counts with the weights: on the memory the engine had, the pool it sizes is the estimate's."""
    target, draft, tconfig, dconfig = pair
    monkeypatch.setattr("ddtree_runtime.engine.memory.free_bytes", lambda device: FREE)
    engine = Engine(EngineConfig("tiny", None, device="cpu", dtype="float32", draft_vocab="400", **SETTINGS),
                    target=target, drafter=draft)
    rows, hidden = engine.drafter.head.shape
    assert rows >= 400 and hidden == tconfig["hidden_size"]
    weights = (capacity.Shape.from_config(tconfig).target_parameters()
               + capacity.Shape.from_config(dconfig).drafter_parameters() + rows * hidden) * 4
    estimate = capacity.pool_capacity(FREE + weights, tconfig, dconfig, dtype="float32", draft_vocab=rows, **SETTINGS)
    assert estimate.weights_bytes == weights
    assert engine.capacity()["tokens"] == estimate.pool_tokens // engine.page_size * engine.page_size

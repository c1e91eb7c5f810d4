"""A prompt prefilled in pieces (engine/prefill.py; later pieces attend causally aligned to the end of
the cached keys, a hybrid's linear layers resume from the cached state) is the same computation as one
forward: same hidden state, features and cache, and the engine's greedy tokens do not change. The
drafter's context is written a piece at a time as the prefill goes (no features of the whole prompt are
kept): it equals what one drafter pass over the whole prompt's features writes."""

from __future__ import annotations

import pytest
import torch

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine import scheduler
from ddtree_runtime.engine.kv_cache import HybridCache, KVCache, target_cache
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
    """Alone and batched, in every mode: the same greedy tokens with prompts in pieces of 50 (the prefix
    cache off, so every run prefills its whole prompt)."""
    engine = Engine(EngineConfig(str(pair / "target"), str(pair / "draft"), max_context=512, prefix_cache=False))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (120, 70, 40)]
    modes = ("ar", "dflash", "ddtree")

    def params(mode: str) -> SamplingParams:
        return SamplingParams(max_new_tokens=24, mode=mode, tree_budget=16)

    def tokens(prompt: list[int], mode: str) -> list[int]:
        return [t for out in engine.generate(prompt, params(mode)) for t in out.token_ids]
    whole = {mode: tokens(prompts[0], mode) for mode in modes}
    monkeypatch.setattr(scheduler, "PREFILL_PIECE", 50)  # the engine's prefill steps go 50 tokens a forward
    assert {mode: tokens(prompts[0], mode) for mode in modes} == whole
    assert whole["ar"] == whole["ddtree"] == whole["dflash"] and len(whole["ar"]) == 24
    alone = [tokens(prompt, mode) for prompt, mode in zip(prompts, modes)]
    ids = [engine.submit(prompt, params(mode)) for prompt, mode in zip(prompts, modes)]
    batched = {i: [] for i in ids}
    while engine.has_work:
        for request_id, out in engine.step():
            batched[request_id] += out.token_ids
    assert [batched[i] for i in ids] == alone


def whole_prompt_draft_kv(engine: Engine, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's context k/v of `prompt` as the first draft wrote them before they were written in
    pieces: the whole prompt's features from one forward, then one drafter pass over them and a block."""
    n, bs = len(prompt), engine.block_size
    _, feats = prefill(engine.target, torch.tensor([prompt]), target_cache(engine.target.config, 512, "cpu",
                                                                              torch.float32))
    d = engine.drafter.config
    cache = KVCache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim, 512, "cpu", torch.float32)
    block = torch.full((1, bs), engine.mask_token_id)
    engine.drafter(engine.target.model.embed_tokens(block), torch.arange(n, n + bs)[None], feats,
                   torch.arange(n)[None], cache)
    return cache.held(0, n)


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@pytest.mark.parametrize("reuse", [False, True])
def test_draft_context_in_pieces_equals_the_whole_prompt_pass(pair, monkeypatch, tmp_path, reuse, sliding):
    """A long prompt in pieces of 50 (its last piece grouped with two short prompts on the attention-only
    target), beside an AR request: each drafting row's drafter context equals the whole-prompt pass's to
    1e-5, and the AR row's holds nothing. With `reuse`, the long prompt continues a finished request's
    (its reused prefix's drafter context comes with the pages). `sliding`: the drafter's first layer
    slides over 48 positions, so its ring (128 slots, engine/draft_cache.py) holds the prompt's last 47
    positions, those the first draft reads, and nothing before them."""
    draft = pair / "draft"
    if sliding:
        from ddtree_devtools.tiny import relaid_drafter
        draft = relaid_drafter(draft, tmp_path / "draft", 48)
    engine = Engine(EngineConfig(str(pair / "target"), str(draft), max_context=512, prefix_cache=reuse))
    monkeypatch.setattr(scheduler, "PREFILL_PIECE", 50)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (130, 30, 45)]
    if reuse:
        for _ in engine.generate(prompts[0][:70], SamplingParams(max_new_tokens=4, mode="ddtree", tree_budget=16)):
            pass
    # the hybrid's target features from a reused state differ from one forward's by float32 rounding
    # (1.5e-5 at most here; the caches' in test_pieces_equal_one_forward)
    atol = 2e-5 if reuse and engine.arch == "qwen3_5" else 1e-5
    modes = ["ddtree", "ar", "dflash"]
    ids = [engine.submit(p, SamplingParams(max_new_tokens=32, mode=m, tree_budget=16)) for p, m in zip(prompts, modes)]
    with torch.no_grad():
        while any(engine.scheduler.find(i).n_ctx == 0 for i in ids):
            engine.step()
        reqs = [engine.scheduler.find(i) for i in ids]
        if reuse and engine.arch == "qwen3":
            assert reqs[0].reused > 0
        for req, prompt, mode in zip(reqs, prompts, modes):
            held = engine.runner.draft_cache.held(req.slot, len(prompt))
            if mode == "ar":
                assert all(not t.any() for t in held)
                continue
            want = whole_prompt_draft_kv(engine, prompt)
            for layer in range(engine.drafter.config.num_hidden_layers):
                if engine.runner.draft_cache.windowed(layer):  # before the window: not kept
                    for t in want:
                        t[layer, :, :max(0, len(prompt) - engine.runner.draft_cache.reach)] = 0
            for got, w in zip(held, want):
                assert torch.allclose(got, w, atol=atol), (got - w).abs().max()

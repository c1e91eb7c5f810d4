"""Admission and the pool: a request that can never be served is refused at submit (ValueError, the
server's 400); one that must wait waits; the pool's slots come from the memory there is; the scheduler
keeps the running requests in the first slots; the adaptive policy shares a round's nodes."""

from __future__ import annotations

import pytest

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine.policy import round_budgets
from ddtree_runtime.engine.scheduler import Scheduler
from ddtree_runtime.engine.modes import mode_named
from ddtree_runtime.engine.types import BatchStats, RequestState


@pytest.fixture(scope="module")
def engine(tiny_models) -> Engine:
    return Engine(EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft"), max_context=256,
                               max_running=4))


def _chat(engine: Engine, q: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)


def _serve(engine: Engine) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    while engine.has_work:
        for i, out in engine.step():
            tokens.setdefault(i, []).extend(out.token_ids)
    return tokens


def test_a_request_that_can_never_fit_is_refused_at_submit(engine):
    with pytest.raises(ValueError, match="this model.s context is 256 tokens, but 200 prompt tokens"):
        engine.submit([1] * 200, SamplingParams(max_new_tokens=100))
    with pytest.raises(ValueError):
        engine.submit([1, 2], SamplingParams(max_new_tokens=4, mode="beam"))
    assert not engine.has_work


def test_generate_needs_an_idle_engine(engine):
    engine.submit([1, 2], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate([1, 2], SamplingParams(max_new_tokens=2))
    _serve(engine)


def test_a_bigger_tree_than_configured_runs_beside_the_others(engine):
    """The paged pool addresses any tree (a block table covers the largest one; a hybrid's tree scratch
    is what still needs a re-size): a request for a much bigger tree than configured is admitted while
    others run, taking pages for its round, and every output is still the AR reference."""
    prompt = _chat(engine, "Count from 1 to 60.")
    reference = [t for r in engine.generate(prompt, SamplingParams(max_new_tokens=30, mode="ar")) for t in r.token_ids]
    first = engine.submit(prompt, SamplingParams(max_new_tokens=30))
    early = [t for _ in range(2) for _, out in engine.step() for t in out.token_ids]
    big = engine.submit(prompt, SamplingParams(max_new_tokens=30, tree_budget=300))
    after = engine.submit(prompt, SamplingParams(max_new_tokens=30, mode="dflash"))
    joined = {i: out.token_ids for i, out in engine.step()}
    assert not engine.scheduler.waiting and len(engine.scheduler.running) == 3
    tokens = _serve(engine)
    assert early + joined[first] + tokens[first] == reference
    assert joined[big] + tokens[big] == reference and joined[after] + tokens[after] == reference


def test_pool_pages_come_from_free_memory(tiny_models, monkeypatch):
    """The pool is counted in pages: mem_fraction of the free memory less a prefill's activations, in
    pages of both models' KV; every row of max_running has a block table; too little memory for one
    request of the full context is refused at start, plainly."""
    config = EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft"), max_context=256, max_running=8,
                          mem_fraction=0.5)
    probe = Engine(EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft"), max_context=256))
    page, prefill = probe.sizing.page_bytes(), probe.sizing.prefill_bytes(256)
    monkeypatch.setattr("ddtree_runtime.engine.memory.free_bytes", lambda device: 2 * (prefill + page * 100))
    eng = Engine(config)
    assert eng.pages.num_pages == 100 and eng.capacity()["tokens"] == 100 * eng.page_size
    assert eng.slots == 8 and eng.runner.target_cache.slots == 8 and eng.runner.draft_cache.slots == 8
    one = probe.needed_bytes(256)
    monkeypatch.setattr("ddtree_runtime.engine.memory.free_bytes", lambda device: one - 1)
    with pytest.raises(ValueError, match="GiB for the caches and a prefill's activations, but .* GiB of cpu is free"):
        Engine(config)


def _request(i: int) -> RequestState:
    return RequestState(id=i, prompt_ids=[1], mode=mode_named("ar"), budget=1,
                        params=SamplingParams(max_new_tokens=1), stop_ids=frozenset(), uniforms=None)


def _scheduler(slots: int, max_queue: int = 16) -> Scheduler:
    """A scheduler whose pool takes any request (no engine behind it)."""
    s = Scheduler(slots, max_queue, pool=None, stats=BatchStats())
    s.admissible = lambda req, batch=None: True
    return s


def test_scheduler_keeps_running_requests_in_the_first_slots():
    s = _scheduler(slots=3)
    reqs = [_request(i) for i in range(5)]
    for r in reqs:
        s.add(r)
    for _ in range(3):
        s.start_running(s.next_prefill())
    assert [r.slot for r in s.running] == [0, 1, 2]
    assert s.next_prefill() is None  # no free slot: the rest wait
    assert s.leave(reqs[0]) == [(2, 0)]  # the last running one moves into the freed slot
    assert [r.id for r in s.running] == [2, 1] and [r.slot for r in s.running] == [0, 1]
    prefilling = s.next_prefill()
    assert prefilling is reqs[3] and prefilling.slot == 2
    assert s.leave(reqs[2]) == [(1, 0), (2, 1)]  # and the prefilling one follows down
    assert [r.id for r in s.running] == [1] and prefilling.slot == 1
    assert s.leave(reqs[4]) == [] and s.leave(prefilling) == [] and len(s) == 1
    assert s.find(1) is reqs[1] and s.find(3) is None


def test_the_queue_holds_max_queue_beyond_the_free_rows():
    s = _scheduler(slots=2, max_queue=1)
    reqs = [_request(i) for i in range(4)]
    for r in reqs[:3]:  # two for the free rows, one queued
        assert s.has_room()
        s.add(r)
    assert not s.has_room() and s.queued(2)
    s.start_running(s.next_prefill())
    assert not s.has_room()  # a row taken, a place freed: still full
    assert s.has_room(arriving=0) is False and s.queued(1) and not s.queued(0)
    s.leave(reqs[0])
    assert s.has_room() and not s.has_room(arriving=1)


def test_round_budgets_share_the_round_nodes():
    assert round_budgets([16, 32, 4], 3, None) == [16, 32, 4]           # fixed: each its own
    assert round_budgets([16, 32, 4], 3, 272) == [16, 32, 4]            # 90 nodes each: 65 - 1 >= all
    assert round_budgets([16] * 16, 16, 272) == [16] * 16               # 17 each
    assert round_budgets([16] * 32, 32, 272) == [7] * 32                # 8 each: the 8-node bucket
    assert round_budgets([16] * 64, 64, 128) == [1] * 64                # at least the root and one node


def test_a_round_that_fails_leaves_the_engine_serving(engine, monkeypatch):
    """A batched round raising (a device error, say): the caller drops the batch (the server's worker
    answers each request 500 and cancels it); the next requests are served as if nothing happened."""
    prompts = [_chat(engine, q) for q in ("Count from 1 to 60.", "What is 2+3?", "Name three colours.")]
    params = SamplingParams(max_new_tokens=20)
    alone = [[t for r in engine.generate(p, params) for t in r.token_ids] for p in prompts]
    ids = [engine.submit(p, params) for p in prompts]
    engine.step()  # all three prefilled
    real_run = engine.runner.run

    def fail(*args, **kwargs):
        raise RuntimeError("simulated device error")
    monkeypatch.setattr(engine.runner, "run", fail)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.step()
    for i in ids:
        engine.cancel(i)
    assert not engine.has_work
    monkeypatch.setattr(engine.runner, "run", real_run)
    ids = [engine.submit(p, params) for p in prompts]
    tokens = _serve(engine)
    assert [tokens[i] for i in ids] == alone

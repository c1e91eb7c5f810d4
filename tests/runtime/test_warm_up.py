"""Engine.warm_up, both tiny pairs: it runs a prefill group and a round at each batch size asked for,
then leaves the pool, the cached sequences and every counter as it found them, and the engine's outputs
(greedy and seeded sampling, requests arriving together) are the same as a fresh engine's; it refuses a
busy engine; on the CPU (no graphs, nothing to compile) its default is one request."""

from __future__ import annotations

import dataclasses

import pytest

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_devtools.engine_runs import serve
from ddtree_devtools.tiny_corpus import mixed_prompts


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def models(request):
    return request.getfixturevalue("tiny_models" if request.param == "qwen3" else "tiny_hybrid_models")


def make(models, **config) -> Engine:
    return Engine(EngineConfig(str(models / "target"), str(models / "draft"), max_running=4, page_size=8, **config))


def pool_state(engine: Engine) -> tuple:
    return (engine.capacity(), dataclasses.asdict(engine.stats), len(engine.prefix),
            engine.page_table.block.tolist(), [list(p) for p in engine.page_table.pages])


def test_warm_up_leaves_the_pool_and_counters_as_they_were_and_outputs_unchanged(models):
    fresh, warmed = make(models), make(models)
    before = pool_state(warmed)
    rounds = []
    warmed.phase_hook = rounds.append  # put back afterwards; the warm-up's own phases are not reported
    done = warmed.warm_up([4, 2, 1])
    assert (done.batches, done.requests, done.graph_captures) == ((4, 2, 1), 7, 0)  # CPU: no graphs
    # each size's share (each rounded to 10 ms, so their sum may exceed the whole by 5 ms each)
    assert len(done.per_batch_s) == 3 and 0 < sum(done.per_batch_s) <= done.seconds + 0.005 * 3
    assert pool_state(warmed) == before and rounds == [] and warmed.phase_hook == rounds.append
    prompts = mixed_prompts(warmed.tokenizer, chats=2, chat_seed=3, plain=1, plain_seed=5, cut=4)
    jobs = [(prompts[0], SamplingParams(max_new_tokens=12)),
            (prompts[1], SamplingParams(max_new_tokens=12, temperature=0.8, seed=7)),
            (prompts[2], SamplingParams(max_new_tokens=12, mode="ar"))]
    assert serve(warmed, jobs) == serve(fresh, jobs)


def test_warm_up_runs_its_batch_sizes_and_refuses_a_busy_engine(models):
    engine = make(models, tree_policy="fixed")  # no cost sweep: its own rounds alone
    sizes = []
    original = engine.runner._round
    engine.runner._round = lambda reqs, budgets: sizes.append(len(reqs)) or original(reqs, budgets)
    assert engine.warm_up().batches == (1,)  # the CPU's default: nothing to compile or capture
    assert engine.warm_up([4, 2]).requests == 6
    assert sizes == [1, 4, 2]
    engine.submit([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.warm_up()

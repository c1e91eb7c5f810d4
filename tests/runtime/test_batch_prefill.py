"""A burst of short prompts is prefilled in one target pass (engine._prefill): each row at its own
offset over its own cache row, padded to the longest. Greedy output must equal each request served
alone, for mixed lengths and modes, a row that starts from a reused prefix, and a long prompt in the
middle of the burst (it is prefilled alone, between two groups). The hybrid target keeps one pass a
prompt (its recurrent state would run over the padding)."""

from __future__ import annotations

import pytest

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine import scheduler
from ddtree_devtools.tiny_corpus import mixed_prompts

MODES = [("ddtree", 16), ("ar", None), ("dflash", None), ("ddtree", 4)]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def engine(request) -> Engine:
    models = request.getfixturevalue("tiny_models" if request.param == "qwen3" else "tiny_hybrid_models")
    return Engine(EngineConfig(str(models / "target"), str(models / "draft"), tree_budget=16, max_running=8,
                               max_batched_tokens=64))


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    out = mixed_prompts(engine.tokenizer, 4, 5, 4, 8, cut=3)
    assert len({len(p) for p in out}) > 3 and all(len(p) <= 64 for p in out), [len(p) for p in out]
    return out


def params(i: int) -> SamplingParams:
    mode, budget = MODES[i % len(MODES)]
    return SamplingParams(max_new_tokens=24, mode=mode, tree_budget=budget)


def alone(engine: Engine, prompt: list[int], p: SamplingParams) -> list[int]:
    return [t for r in engine.generate(prompt, p) for t in r.token_ids]


def burst(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> tuple[list[list[int]], int]:
    """Submit every job at once and serve them; returns their tokens and the first step's prefill passes."""
    ids = [engine.submit(p, q) for p, q in jobs]
    tokens = {i: [] for i in ids}
    passes = None
    while engine.has_work:
        for request_id, out in engine.step():
            tokens[request_id] += out.token_ids
        passes = engine.stats.prefill_passes if passes is None else passes
    return [tokens[i] for i in ids], passes


def test_a_burst_shares_one_prefill_pass_and_each_output_equals_alone(engine, prompts):
    jobs = [(p, params(i)) for i, p in enumerate(prompts)]
    outs, passes = burst(engine, jobs)
    if engine.arch == "qwen3":
        assert passes == 1
    else:  # a pass a prompt at least (a chat prompt is cut where its state is kept for reuse)
        assert passes >= len(jobs)
    for (prompt, p), out in zip(jobs, outs):
        assert out == alone(engine, prompt, p), f"{p.mode}@{p.tree_budget}, {len(prompt)} tokens"


def test_a_row_from_a_reused_prefix_and_a_long_prompt_inside_the_burst(engine, prompts):
    first = prompts[0]
    answer = alone(engine, first, params(0))           # its row stays behind as a cached sequence
    follow_up = first + answer + prompts[5][:10]       # starts with it: prefilled from past the prefix
    long = (prompts[6] * 20)[:150]                     # over the chunk: prefilled alone, in pieces
    jobs = [(prompts[1], params(1)), (follow_up, params(0)), (prompts[2], params(2)), (long, params(3)),
            (prompts[3], params(1)), (prompts[4], params(0))]
    hits = engine.stats.prefix_hits
    outs, _ = burst(engine, jobs)
    assert engine.stats.prefix_hits > hits, "the follow-up should have reused the first request's row"
    for (prompt, p), out in zip(jobs, outs):
        assert out == alone(engine, prompt, p), f"{p.mode}@{p.tree_budget}, {len(prompt)} tokens"


def test_a_lone_prompt_wider_than_a_groups_bias_is_prefilled_alone(engine, prompts, monkeypatch):
    """A last piece within the step's budget whose own attention bias exceeds a group's (a 32K prompt
    under a 32K budget; here a limit no piece fits) starts no group: it is one pass, with the tokens
    served under the real limit (regression: an empty group was passed to the runner)."""
    prompt, p = max(prompts, key=len), SamplingParams(max_new_tokens=8, mode="ar")
    expected = alone(engine, prompt, p)
    monkeypatch.setattr(scheduler, "GROUP_BIAS", 0)
    outs, passes = burst(engine, [(prompt, p)])
    assert outs == [expected] and passes == 1

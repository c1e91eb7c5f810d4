"""Continuous batching, greedy: every request's output in a batch is token-identical to the same request
served alone and to transformers' greedy decode, for the Qwen3 and the hybrid target, with mixed
prompts, lengths, modes and budgets, requests arriving mid-batch, others cancelled mid-batch, long
prompts prefilled in chunks beside running streams, and (the deep-rejection case) trees whose top
branch is rejected deep, with neighbours in the batch."""

from __future__ import annotations

import pytest
import torch

import ddtree_runtime.engine.model_runner as rounds_module
from ddtree_runtime.engine import modes
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine.tree import Walk
from ddtree_devtools.tiny_corpus import mixed_prompts

MAX_NEW = 40
# (mode, tree_budget) per request, cycled over the prompts: a batch always mixes them
MIXES = [("ddtree", None), ("ar", None), ("dflash", None), ("ddtree", 4), ("ddtree", 32)]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def models(request):
    return request.getfixturevalue("tiny_models" if request.param == "qwen3" else "tiny_hybrid_models")


@pytest.fixture(scope="module")
def engine(models) -> Engine:
    # a small prefill chunk: the plain-text prompts below take several steps to prefill
    return Engine(EngineConfig(str(models / "target"), str(models / "draft"), tree_budget=32, max_running=6,
                               max_batched_tokens=16))


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    return mixed_prompts(engine.tokenizer, 8, 321, 6, 77, cut=2)


@pytest.fixture(scope="module")
def reference(models, prompts, engine) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(models / "target"), dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                            eos_token_id=sorted(engine.eos_ids), pad_token_id=engine.tokenizer.pad_token_id)
        out.append(g[0, len(p):].tolist())
    return out


def long_prompt(prompts: list[list[int]]) -> list[int]:
    """120 tokens: eight prefill chunks of the engine fixture's 16."""
    return (prompts[-1] * 120)[:120]


def params(i: int, **kw) -> SamplingParams:
    mode, budget = MIXES[i % len(MIXES)]
    return SamplingParams(max_new_tokens=MAX_NEW, mode=mode, tree_budget=budget, **kw)


def alone(engine: Engine, prompt: list[int], p: SamplingParams) -> list[int]:
    return [t for r in engine.generate(prompt, p) for t in r.token_ids]


def serve(engine: Engine, arrivals: dict[int, list[tuple[list[int], SamplingParams]]],
          cancel_at: dict[int, int] | None = None) -> tuple[list[list[int]], list[bool]]:
    """Step the engine; at step s submit arrivals[s] (in order) and cancel the request numbered
    n at step cancel_at[n]. Returns every submitted request's tokens and whether it finished."""
    ids, tokens, finished = [], {}, {}
    cancel_at = cancel_at or {}
    step = 0
    while engine.has_work or any(s >= step for s in arrivals):
        for prompt, p in arrivals.get(step, []):
            ids.append(engine.submit(prompt, p))
            tokens[ids[-1]], finished[ids[-1]] = [], False
        for n, s in cancel_at.items():
            if s == step:
                engine.cancel(ids[n])
        for request_id, out in engine.step():
            tokens[request_id] += out.token_ids
            finished[request_id] |= out.finished
        step += 1
    return [tokens[i] for i in ids], [finished[i] for i in ids]


def test_batch_is_lossless_with_arrivals_and_cancellations(engine, prompts, reference):
    n = len(prompts)
    # half arrive together, the rest one every other step while the first ones decode
    arrivals: dict[int, list] = {0: [(prompts[i], params(i)) for i in range(n // 2)]}
    for k, i in enumerate(range(n // 2, n)):
        arrivals[2 * k + 1] = [(prompts[i], params(i))]
    # two more (repeats of the long prompts) arrive mid-batch and are cancelled mid-batch
    arrivals[3].append((prompts[-1], params(0)))
    arrivals[5].append((prompts[-2], params(1)))
    submitted = [prompt for s in sorted(arrivals) for prompt, _ in arrivals[s]]
    cancelled = [n // 2 + 2, n // 2 + 4]  # their places in submission order
    assert submitted[cancelled[0]] is prompts[-1] and submitted[cancelled[1]] is prompts[-2]
    outs, finished = serve(engine, arrivals, cancel_at={cancelled[0]: 9, cancelled[1]: 7})
    expected = reference
    kept = [k for k in range(len(submitted)) if k not in cancelled]
    for k, ref in zip(kept, expected):
        assert finished[k]
        assert outs[k] == ref, f"request {k} diverged from the target's greedy decode"
    assert not any(finished[k] for k in cancelled), "cancelled requests must not finish"
    assert not engine.has_work and engine.scheduler.running == []


def test_batch_output_equals_alone_for_every_mix(engine, prompts):
    """Each request of a full batch (every mode and budget at once) against itself served alone."""
    batch = [(prompts[i], params(i + 2)) for i in range(engine.slots)]
    outs, _ = serve(engine, {0: batch})
    for (prompt, p), out in zip(batch, outs):
        assert out == alone(engine, prompt, p), f"{p.mode}@{p.tree_budget} differs batched vs alone"


def test_requests_beyond_the_slots_wait_and_long_prompts_do_not_stall(engine, prompts, reference):
    """A long prompt prefilled in chunks while others decode lets them emit at every step of its
    prefill; requests beyond the slots wait, then run, and no more than the slots ever run at once."""
    # AR past any stop (a token a step, MAX_NEW steps): the first ones still run while the rest arrive
    keep = SamplingParams(max_new_tokens=MAX_NEW, mode="ar", ignore_eos=True)
    expected = [alone(engine, prompts[i], keep) for i in range(8)]
    ids = [engine.submit(prompts[i], keep) for i in range(engine.slots - 1)]
    tokens = {i: [] for i in ids}
    most_running, neighbours_during_long_prefill, waited, step, long_id = 0, [], False, 0, None
    while engine.has_work:
        if step == 4:  # the last slot: prefilled 16 tokens a step beside the decoding ones
            long_id = engine.submit(long_prompt(prompts), SamplingParams(max_new_tokens=8))
            extra = [engine.submit(prompts[i], keep) for i in range(3)]  # no slot left: they wait
            ids += extra
            tokens.update({i: [] for i in [long_id, *extra]})
        long_prefilling = long_id is not None and getattr(engine.scheduler.prefilling, "id", None) == long_id
        outs = engine.step()
        most_running = max(most_running, len(engine.scheduler.running))
        waited |= bool(engine.scheduler.waiting) and len(engine.scheduler.running) == engine.slots
        assert len(engine.scheduler.running) + (engine.scheduler.prefilling is not None) <= engine.slots
        if long_prefilling:
            neighbours_during_long_prefill.append(sum(i != long_id for i, _ in outs))
        for i, out in outs:
            tokens[i] += out.token_ids
        step += 1
    assert most_running == engine.slots and waited
    for k, i in enumerate(ids):
        assert tokens[i] == expected[k if k < engine.slots - 1 else k - (engine.slots - 1)]
    assert len(tokens[long_id]) == 8
    assert len(neighbours_during_long_prefill) >= 3 and all(neighbours_during_long_prefill)


def test_cancel_while_prefilling_then_serve(engine, prompts, reference):
    keep = SamplingParams(max_new_tokens=MAX_NEW, mode="ar", ignore_eos=True)  # decodes all along
    expected = alone(engine, prompts[0], keep)
    running = engine.submit(prompts[0], keep)
    tokens = [t for _, out in engine.step() for t in out.token_ids]
    long_id = engine.submit(long_prompt(prompts), params(0))
    for step in range(3):
        tokens += [t for i, out in engine.step() for t in out.token_ids if i == running]
    assert engine.scheduler.prefilling is not None and engine.scheduler.prefilling.id == long_id
    engine.cancel(long_id)
    while engine.has_work:
        tokens += [t for i, out in engine.step() for t in out.token_ids if i == running]
    assert tokens == expected
    outs, _ = serve(engine, {0: [(p, params(i)) for i, p in enumerate(prompts[:3])]})
    assert outs == reference[:3]


def test_a_lone_ar_request_runs_ahead_alone_and_settles_when_joined(engine, prompts):
    """The one round keeps a lone AR request's run-ahead (its next step queued before this one's token
    is read) and drops it, committing the pass already run, once another request decodes beside it."""
    keep = SamplingParams(max_new_tokens=MAX_NEW, mode="ar", ignore_eos=True)
    expected = alone(engine, prompts[0], keep)
    lone = engine.submit(prompts[0], keep)

    def step() -> list[int]:
        return [t for i, out in engine.step() for t in out.token_ids if i == lone]
    tokens = step() + step()  # the prefill, then a lone round
    assert engine.scheduler.find(lone).ahead is not None
    engine.submit(prompts[1], keep)
    while engine.stats.batch_size < 2:  # the newcomer prefills while the lone request runs on ahead
        tokens += step()
    assert engine.scheduler.find(lone).ahead is None  # a round of two: settled
    while engine.has_work:
        tokens += step()
    assert tokens == expected


def test_a_branch_rejected_deep_leaves_nothing_behind_with_neighbours(engine, prompts, reference, monkeypatch):
    """As test_engine_lossless's deep-rejection test, in batches: the tree's top branch goes wrong
    at depth 3 and grows on below it (k/v and, on the hybrid, recurrent states of nodes then
    rejected) while neighbours share the pass. Output must not change."""
    swapped_depth = 3
    original_build, original_walk = engine.runner.trees.build, rounds_module.walk
    diverged_then_continued = 0

    def build(draft_logits, budget):  # the requests of one budget, built together
        logits = draft_logits.clone()
        for row in logits[:, swapped_depth - 1]:
            first, second = row.topk(2).indices.tolist()
            row[first], row[second] = row[second].clone(), row[first].clone()
        return original_build(logits, budget)

    def walk(tokens, parents, depths, mask, target, max_depth):
        nonlocal diverged_then_continued
        result = original_walk(tokens, parents, depths, mask, target, max_depth)
        for row in range(tokens.shape[0]):
            path = Walk.read(result[row].tolist(), max_depth).path
            top, rows_parents = [0], parents[row].tolist()
            for node in range(1, len(rows_parents)):
                if rows_parents[node] == top[-1]:
                    top.append(node)
            if (len(path) > swapped_depth + 1 and len(top) > swapped_depth + 1
                    and path[:swapped_depth] == top[:swapped_depth] and path[swapped_depth] != top[swapped_depth]):
                diverged_then_continued += 1
        return result

    monkeypatch.setattr(engine.runner.trees, "build", build)
    monkeypatch.setattr(rounds_module, "walk", walk)
    deep = SamplingParams(max_new_tokens=MAX_NEW, mode="ddtree", tree_budget=32)
    # two batchings of the same requests: some arriving later, then all at once
    for arrivals in ({0: [(p, deep) for p in prompts[:6]], 4: [(p, deep) for p in prompts[6:]]},
                     {0: [(p, deep) for p in prompts]}):
        outs, _ = serve(engine, arrivals)
        for i, (out, ref) in enumerate(zip(outs, reference)):
            assert out == ref, f"prompt {i} diverged"
    print(f"\nbatched rounds accepted past a top branch rejected at depth {swapped_depth}: {diverged_then_continued}")
    assert diverged_then_continued >= 10


def test_the_engine_serves_cleanly_after_cancelling_everything(engine, prompts, reference):
    arrivals = {0: [(p, params(i)) for i, p in enumerate(prompts[:engine.slots + 2])]}
    serve(engine, arrivals, cancel_at={i: 1 + i % 3 for i in range(engine.slots + 2)})
    assert not engine.has_work
    outs, _ = serve(engine, {0: [(p, params(i)) for i, p in enumerate(prompts[:4])]})
    assert outs == reference[:4]


def test_drafts_of_one_batched_pass_reach_the_tree_build_without_a_copy():
    """A batched round's drafts are rows of the drafter pass's output: the tree build reads them in
    place (a view), and any other set of drafts is stacked."""
    buffer = torch.randn(4, 15, 50)
    rows = [buffer[i, :7] for i in range(4)]
    view = modes._stacked(rows)
    assert torch.equal(view, torch.stack(rows)) and view.data_ptr() == buffer.data_ptr()
    mixed = [buffer[0, :7], torch.randn(15, 50)[:7], buffer[2, :7]]
    copy = modes._stacked(mixed)
    assert torch.equal(copy, torch.stack(mixed)) and copy.data_ptr() != buffer.data_ptr()
    skipping = [buffer[0, :7], buffer[2, :7], buffer[3, :7]]
    assert torch.equal(modes._stacked(skipping), torch.stack(skipping))

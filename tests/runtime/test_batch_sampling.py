"""Continuous batching, T > 0: a request with a seed gives the same tokens alone or in a batch (each
request samples with its own per-position draws, from its own rows), and tree sampling in batches is still
distributed like plain sampling from the target (the chi-square test of test_engine_sampling, with
the tree samples drawn eight requests at a time), for the Qwen3 and the hybrid target."""

from __future__ import annotations

from collections import Counter

import pytest

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from test_engine_sampling import N_SEEDS, homogeneity_pvalue

BATCH = 8


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def engine(request) -> Engine:
    models = request.getfixturevalue("tiny_models" if request.param == "qwen3" else "tiny_hybrid_models")
    return Engine(EngineConfig(str(models / "target"), str(models / "draft"), tree_budget=16, max_running=BATCH))


def run_batch(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> tuple[list[list[int]], int]:
    """Every request's tokens, and the draft tokens accepted in all."""
    ids = [engine.submit(p, q) for p, q in requests]
    tokens, accepted = {i: [] for i in ids}, 0
    while engine.has_work:
        for i, out in engine.step():
            tokens[i] += out.token_ids
            accepted += out.accepted
    return [tokens[i] for i in ids], accepted


def test_a_seed_gives_the_same_text_alone_or_batched(engine):
    tok = engine.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in
               ("cat dog", "The weather today", "Once upon a time", "1 2 3 4")]
    requests = []
    for i in range(BATCH):
        mode = ("ddtree", "ar", "dflash")[i % 3]
        requests.append((prompts[i % len(prompts)],
                         SamplingParams(max_new_tokens=24, temperature=(1.0, 0.7)[i % 2], top_p=(1.0, 0.9)[i % 2],
                                        seed=1000 + i, mode=mode)))
    # greedy neighbours too: their rows are chosen by argmax beside the sampled ones
    requests += [(prompts[0], SamplingParams(max_new_tokens=24))]
    alone = [[t for r in engine.generate(p, q) for t in r.token_ids] for p, q in requests]
    batched, _ = run_batch(engine, requests)
    assert batched == alone
    assert len({tuple(a) for a in alone}) > len(prompts), "different seeds must give different texts"


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_batched_tree_sampling_matches_target_distribution(engine, temperature, top_p):
    prompt = engine.tokenizer("cat dog", add_special_tokens=False)["input_ids"]
    tree, accepted = run_batch(engine, [(prompt, SamplingParams(max_new_tokens=4, seed=20_000 + s, mode="ddtree",
                                                      temperature=temperature, top_p=top_p))
                              for s in range(N_SEEDS)])
    assert accepted > N_SEEDS // 2, "the trees must actually accept draft tokens for this to test anything"
    plain = []
    for s in range(N_SEEDS):  # plain sampling, one request at a time
        plain.append([t for r in engine.generate(prompt, SamplingParams(
            max_new_tokens=4, seed=60_000 + s, mode="ar", temperature=temperature, top_p=top_p)) for t in r.token_ids])
    pad = [o + [-1] * (4 - len(o)) for o in tree], [o + [-1] * (4 - len(o)) for o in plain]
    for pos in (1, 2, 3):
        p, dof = homogeneity_pvalue(Counter(o[pos] for o in pad[0]), Counter(o[pos] for o in pad[1]))
        print(f"\nbatched T={temperature} top_p={top_p} position {pos + 1}: p={p:.3f} dof={dof}")
        assert dof >= 1
        assert p > 1e-3
    assert engine.stats.batch_size <= BATCH

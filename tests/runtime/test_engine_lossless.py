"""Greedy losslessness: ddtree / dflash / ar output must be token-identical to the target's own greedy
decode (transformers generate), across many prompts and tree budgets, for the Qwen3 target and the
hybrid Qwen3.5-style one. Deep acceptance exercises the KV compaction and, on the hybrid, the recurrent
state advanced along the accepted path: a wrong one corrupts every later token."""

from __future__ import annotations

import pytest
import torch

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine.tree import Walk
from ddtree_devtools.tiny_corpus import documents, heldout_questions

N_PROMPTS = 50
MAX_NEW = 40


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def models(request):
    return request.getfixturevalue("tiny_models" if request.param == "qwen3" else "tiny_hybrid_models")


@pytest.fixture(scope="module")
def engine(models) -> Engine:
    return Engine(EngineConfig(str(models / "target"), str(models / "draft")))


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    tok = engine.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
             for q in heldout_questions(N_PROMPTS - 15, seed=123)]
    # plain-text prefixes (first half of unseen documents) run to max_new_tokens: long outputs
    plain = [h[: len(h) // 2] for h, _ in documents(400, seed=99) if not h.startswith("<|")][:15]
    return chats + [tok(p, add_special_tokens=False)["input_ids"] for p in plain]


@pytest.fixture(scope="module")
def reference(models, prompts, engine) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(models / "target"), dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=MAX_NEW, eos_token_id=sorted(engine.eos_ids),
                            pad_token_id=engine.tokenizer.pad_token_id)
        out.append(g[0, len(p):].tolist())
    return out


def run(engine: Engine, prompt: list[int], **kw) -> tuple[list[int], list[int]]:
    tokens, accepted = [], []
    for r in engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW, **kw)):
        tokens += r.token_ids
        accepted.append(r.accepted)
    return tokens, accepted[1:]  # the first round is the prefill's token


def test_ar_matches_transformers(engine, prompts, reference):
    for p, ref in zip(prompts, reference):
        assert run(engine, p, mode="ar")[0] == ref


@pytest.mark.parametrize("mode,budget",
                         [("dflash", None), ("ddtree", 4), ("ddtree", 15), ("ddtree", 16), ("ddtree", 64)])
def test_speculative_greedy_is_lossless(engine, prompts, reference, mode, budget):
    """Each budget's trees verify at their own bucket: root + 2^k nodes (4, 16, 64), 2^k (15: 16 nodes)."""
    accepted: list[int] = []
    for i, (p, ref) in enumerate(zip(prompts, reference)):
        out, acc = run(engine, p, mode=mode, tree_budget=budget)
        assert out == ref, f"prompt {i}: {mode}@{budget} diverged from the target's greedy decode"
        accepted += acc
    mean_len = 1 + sum(accepted) / len(accepted)
    print(f"\n{mode} budget={budget}: mean acceptance length {mean_len:.2f} over {len(accepted)} rounds,"
          f" max accepted {max(accepted)}")
    assert mean_len >= (2.5 if budget == 4 else 3.0)
    # deep acceptances happened (compaction moved many rows): up to the tree's depth limit
    assert max(accepted) >= (4 if budget == 4 else 12)


def test_a_branch_rejected_deep_leaves_nothing_behind(engine, prompts, reference, monkeypatch):
    """Swap the drafter's top two tokens at depth 3: wherever the drafter was right, the tree's top
    branch now goes wrong at depth 3 and grows on below it (k/v, on the hybrid recurrent states, for
    nodes that are then rejected), while the target's token sits in the sibling branch. Output must
    not change, however often that happens."""
    import ddtree_runtime.engine.model_runner as rounds_module

    swapped_depth = 3
    original_build, original_walk = engine.runner.trees.build, rounds_module.walk
    diverged_then_continued = 0

    def build(draft_logits, budget):  # a lone request's draft: a batch of one
        logits = draft_logits.clone()
        row = logits[0, swapped_depth - 1]
        first, second = row.topk(2).indices.tolist()
        row[first], row[second] = row[second].clone(), row[first].clone()
        return original_build(logits, budget)

    def walk(tokens, parents, depths, mask, target, max_depth):
        nonlocal diverged_then_continued
        result = original_walk(tokens, parents, depths, mask, target, max_depth)
        path = Walk.read(result[0].tolist(), max_depth).path
        top = [0]  # the top branch: each node's first (best-ranked) child
        parents = parents[0].tolist()
        for node in range(1, len(parents)):
            if parents[node] == top[-1]:
                top.append(node)
        if (len(path) > swapped_depth + 1 and len(top) > swapped_depth + 1
                and path[:swapped_depth] == top[:swapped_depth] and path[swapped_depth] != top[swapped_depth]):
            diverged_then_continued += 1
        return result

    monkeypatch.setattr(engine.runner.trees, "build", build)
    monkeypatch.setattr(rounds_module, "walk", walk)
    for i, (p, ref) in enumerate(zip(prompts, reference)):
        assert run(engine, p, mode="ddtree", tree_budget=32)[0] == ref, f"prompt {i} diverged"
    print(f"\nrounds accepted past a top branch rejected at depth {swapped_depth}: {diverged_then_continued}")
    assert diverged_then_continued >= 10  # fixture v2: 14 on qwen3 (its answers stop; v1 ran on)


MIN_TOKENS = 30


def test_min_tokens_and_logprobs_match_transformers_in_every_mode(models, engine, prompts, reference):
    """min_tokens (the end token masked until that many tokens) and the returned log-probabilities
    (the raw distribution's) against transformers' own min_new_tokens and logits: the same tokens and
    log-probabilities in ar, dflash and ddtree, alone and batched."""
    from transformers import AutoModelForCausalLM

    chats = [i for i in range(N_PROMPTS - 15) if len(reference[i]) < MIN_TOKENS][:6]
    assert len(chats) >= 3, "the test needs replies that end before min_tokens"
    hf = AutoModelForCausalLM.from_pretrained(str(models / "target"), dtype=torch.float32).eval()
    batched = Engine(EngineConfig(str(models / "target"), str(models / "draft"), max_running=4))
    params = [SamplingParams(max_new_tokens=MAX_NEW, mode=mode, min_tokens=MIN_TOKENS, logprobs=2)
              for mode in ("ar", "dflash", "ddtree")]
    ids = {(i, j): batched.submit(prompts[i], q) for i in chats for j, q in enumerate(params)}
    together: dict[int, list] = {n: [] for n in ids.values()}
    while batched.has_work:
        for n, out in batched.step():
            together[n] += zip(out.token_ids, out.logprobs)
    for i in chats:
        prompt = torch.tensor([prompts[i]])
        with torch.no_grad():
            g = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=MAX_NEW,
                            min_new_tokens=MIN_TOKENS, eos_token_id=sorted(engine.eos_ids),
                            pad_token_id=engine.tokenizer.pad_token_id, output_logits=True, return_dict_in_generate=True)
        ref = g.sequences[0, prompt.shape[1]:].tolist()
        assert len(ref) > len(reference[i])
        raw = [torch.log_softmax(step[0].float(), dim=-1) for step in g.logits]
        for j, q in enumerate(params):
            alone = [(t, lp) for out in engine.generate(prompts[i], q) for t, lp in zip(out.token_ids, out.logprobs)]
            for got in (alone, together[ids[(i, j)]]):
                assert [t for t, _ in got] == ref, f"prompt {i}, {q.mode}"
                for (t, lp), dist in zip(got, raw):
                    assert lp.logprob == pytest.approx(dist[t].item(), abs=1e-3)
                    top = dist.topk(2)
                    assert [tok for tok, _ in lp.top] == top.indices.tolist()
                    assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-3)

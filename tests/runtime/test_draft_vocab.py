"""The drafter's vocabulary (--draft-vocab, draft_vocab.py): what the values mean and which are refused,
that the drafter's trees hold only those tokens, mapped to the target's ids, and that output is the
target's own whatever the vocabulary (greedy alone and batched, seeded sampling), on both tiny pairs."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import httpx
import pytest
import torch

from ddtree_runtime.draft_vocab import DraftVocabError, draft_vocab_ids
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine.tree import TreeBuilder, build_chain, scored_trees
from ddtree_devtools.server_process import ServerProcess
from ddtree_devtools.tiny_corpus import heldout_questions

# Of the tiny tokenizer's 812 tokens (ids 0-5 and 808-811 added), the 400 lowest: a vocabulary that
# leaves out tokens the target does write, so rounds are rejected that the whole one would accept
SMALL = "400"
MAX_NEW = 32


# ---- the values -------------------------------------------------------------------------------------

def test_a_count_is_the_lowest_ids_then_the_added_tokens_then_eos():
    assert draft_vocab_ids("4", 100, added=[90, 2, 91], eos=[99, 91]) == [0, 1, 2, 3, 90, 91, 99]
    assert draft_vocab_ids("100", 100) == list(range(100))


def test_a_file_keeps_its_order_and_adds_eos(tmp_path):
    listed = tmp_path / "hot.json"
    listed.write_text(json.dumps([7, 3, 7, 5]))
    assert draft_vocab_ids(str(listed), 10, added=[9], eos=[1]) == [7, 3, 5, 1]  # added tokens: a count's only
    lines = tmp_path / "hot.txt"
    lines.write_text("7\n3\n\n5\n")
    assert draft_vocab_ids(str(lines), 10) == [7, 3, 5]
    tensor = tmp_path / "hot.pt"
    torch.save(torch.tensor([4, 8, 2]), tensor)  # SGLang's token map
    assert draft_vocab_ids(str(tensor), 10) == [4, 8, 2]


def _saved(tmp_path, value) -> str:
    path = tmp_path / "map.pt"
    torch.save(value, path)
    return str(path)


@pytest.mark.parametrize("make, message", [
    (lambda p: "1", "expected a count from 2 to the target's 100 tokens"),
    (lambda p: "101", "expected a count from 2"),
    (lambda p: str(p / "missing.json"), "no such file"),
    (lambda p: (p / "m.json").write_text("[1, 2.5]") and str(p / "m.json"), "2.5 is not a token id"),
    (lambda p: (p / "m.json").write_text("[1, true]") and str(p / "m.json"), "True is not a token id"),
    (lambda p: (p / "m.json").write_text("[1, 2") and str(p / "m.json"), "not a JSON list of token ids"),
    (lambda p: (p / "m.txt").write_text("1 x 3") and str(p / "m.txt"), "'x' is not a token id"),
    (lambda p: (p / "m.txt").write_text("1 100") and str(p / "m.txt"), "token id 100 is outside"),
    (lambda p: (p / "m.txt").write_text("5") and str(p / "m.txt"), "1 token id(s)"),
    (lambda p: _saved(p, torch.tensor([[1, 2]])), "expected a 1-D tensor of token ids"),
    (lambda p: _saved(p, torch.tensor([1.0, 2.0])), "expected a 1-D tensor of token ids"),
    (lambda p: (p / "m.pt").write_text("not a tensor") and str(p / "m.pt"), "cannot load it as a tensor"),
])
def test_unusable_values_say_why_in_one_line(tmp_path, make, message):
    with pytest.raises(DraftVocabError) as err:
        draft_vocab_ids(make(tmp_path), 100)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_map_counted_from_text_is_its_most_frequent_tokens(tiny_models, tmp_path, capsys):
    from transformers import AutoTokenizer

    from ddtree_runtime.draft_vocab import main

    text = tmp_path / "sample.txt"
    text.write_text("the cat sat on the mat\nthe dog sat\n" * 3 + "a zebra\n")
    out = tmp_path / "map.json"
    assert main(["--target", str(tiny_models / "target"), "--top", "6", "--out", str(out), str(text)]) == 0
    tok = AutoTokenizer.from_pretrained(str(tiny_models / "target"))
    counts = {}
    for line in text.read_text().splitlines(keepends=True):
        for t in tok(line, add_special_tokens=False)["input_ids"]:
            counts[t] = counts.get(t, 0) + 1
    expected = sorted(counts, key=lambda t: (-counts[t], t))[:6]
    assert json.loads(out.read_text()) == expected and counts[expected[-1]] >= max(
        n for t, n in counts.items() if t not in expected)
    assert draft_vocab_ids(str(out), 1024) == expected
    assert main(["--target", str(tiny_models / "target"), "--top", "1", str(text)]) == 2
    assert main(["--target", str(tiny_models / "target"), str(tmp_path / "none.txt")]) == 2
    assert capsys.readouterr().err.count("error:") == 2


# ---- the trees --------------------------------------------------------------------------------------

def test_trees_over_a_draft_vocabulary_hold_the_target_ids_of_its_logits():
    """Logit j of a draft is token ids[j]: the trees are the ones built over the draft logits, each token
    mapped through ids (a tree over the same logits placed at those ids of the whole vocabulary)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(500, generator=gen)[:60]
    drafts = torch.randn(3, 7, 60, generator=gen)
    nodes, scores = TreeBuilder(torch.device("cpu"), ids).build(drafts, 16)
    plain, plain_scores = scored_trees(drafts, 16)
    assert torch.equal(nodes[:, 0], ids[plain[:, 0]]) and torch.equal(nodes[:, 1:], plain[:, 1:])
    assert torch.equal(scores, plain_scores)
    whole = torch.full((3, 7, 500), -1e4).index_copy_(2, ids, drafts)
    assert torch.equal(scored_trees(whole, 16)[0], nodes)
    chain = TreeBuilder(torch.device("cpu"), ids).chain(drafts[0])
    assert torch.equal(chain.tokens, ids[drafts[0].argmax(-1)])
    assert torch.equal(chain.nodes[1:], build_chain(drafts[0]).nodes[1:])


# ---- the engine -------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def models(request):
    return request.getfixturevalue("tiny_models" if request.param == "qwen3" else "tiny_hybrid_models")


def _engine(models, draft_vocab: str | None) -> Engine:
    return Engine(EngineConfig(str(models / "target"), str(models / "draft"), tree_budget=16, max_running=6,
                               draft_vocab=draft_vocab))


@pytest.fixture(scope="module")
def whole(models) -> Engine:
    return _engine(models, None)


@pytest.fixture(scope="module")
def small(models) -> Engine:
    return _engine(models, SMALL)


@pytest.fixture(scope="module")
def prompts(whole) -> list[list[int]]:
    tok = whole.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in heldout_questions(6, seed=5)]


def alone(engine: Engine, prompt: list[int], params: SamplingParams | None = None, **kw) -> tuple[list[int], int]:
    tokens, accepted = [], 0
    for r in engine.generate(prompt, params or SamplingParams(max_new_tokens=MAX_NEW, **kw)):
        tokens += r.token_ids
        accepted += r.accepted
    return tokens, accepted


def batched(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    ids = [engine.submit(p, q) for p, q in requests]
    tokens = {i: [] for i in ids}
    while engine.has_work:
        for i, out in engine.step():
            tokens[i] += out.token_ids
    return [tokens[i] for i in ids]


def test_the_drafter_proposes_only_its_vocabulary(small, prompts, monkeypatch):
    vocab = set(small.drafter.vocab_ids.tolist())
    assert small.info.draft_vocab == len(vocab) == 400 + 4  # the added tokens past the 400 lowest: 808-811
    proposed: list[torch.Tensor] = []
    builder = small.runner.trees
    build, chain = builder.build, builder.chain

    def kept(made, tokens: torch.Tensor):
        proposed.append(tokens.clone())
        return made

    monkeypatch.setattr(builder, "build", lambda *a: (lambda made: kept(made, made[0][:, 0]))(build(*a)))
    monkeypatch.setattr(builder, "chain", lambda d: (lambda made: kept(made, made.tokens))(chain(d)))
    for mode in ("ddtree", "dflash"):
        alone(small, prompts[0], mode=mode)
    assert proposed and set(torch.cat([t.flatten() for t in proposed]).tolist()) <= vocab
    assert max(t.max() for t in proposed) >= 256, "the trees must hold merged tokens, not bytes alone"


def test_greedy_output_is_the_targets_alone_and_batched(whole, small, prompts):
    ar = [alone(whole, p, mode="ar")[0] for p in prompts]
    accepted = {}
    for name, engine in (("whole", whole), ("small", small)):
        for mode in ("ddtree", "dflash"):
            runs = [alone(engine, p, mode=mode) for p in prompts]
            assert [tokens for tokens, _ in runs] == ar, f"{mode} with the {name} vocabulary"
            accepted[name, mode] = sum(a for _, a in runs)
    assert accepted["small", "ddtree"] < accepted["whole", "ddtree"], "the small vocabulary must miss tokens"
    mixed = [(p, SamplingParams(max_new_tokens=MAX_NEW, mode=("ddtree", "dflash", "ar")[i % 3]))
             for i, p in enumerate(prompts)]
    assert batched(small, mixed) == ar


def test_a_seed_gives_the_targets_text_whatever_the_vocabulary(whole, small, prompts):
    def params(i: int, mode: str) -> SamplingParams:
        return SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.95, seed=70 + i, mode=mode)

    plain = [alone(whole, p, params(i, "ar"))[0] for i, p in enumerate(prompts)]
    assert [alone(small, p, params(i, "ddtree"))[0] for i, p in enumerate(prompts)] == plain
    assert batched(small, [(p, params(i, "ddtree")) for i, p in enumerate(prompts)]) == plain


def test_the_whole_vocabulary_in_any_order_drafts_as_the_head_does(models, whole, prompts, tmp_path):
    """A file of every token id, shuffled: the drafter's head rows permuted, its trees mapped back, so
    every round accepts what the whole head's does."""
    ids = list(range(whole.target.config.vocab_size))
    random.Random(3).shuffle(ids)
    path = tmp_path / "all.json"
    path.write_text(json.dumps(ids))
    shuffled = _engine(models, str(path))
    for p in prompts[:3]:
        assert alone(shuffled, p, mode="ddtree") == alone(whole, p, mode="ddtree")


# ---- the server -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_served_with_a_draft_vocabulary(tiny_models, tmp_path):
    path = tmp_path / "hot.json"
    path.write_text(json.dumps(list(range(300, 700))))
    argv = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"), "--draft-vocab", str(path)]
    with ServerProcess(argv) as srv:
        assert srv.wait_ready()["draft_vocab"] == 400 + 1  # and the eos id
        texts = [httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "target", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
            "speculative": {"mode": mode}}).json()["choices"][0]["text"] for mode in ("ar", "ddtree")]
        assert texts[0] == texts[1] and texts[0]


@pytest.mark.parametrize("extra, message", [
    (["--draft-vocab", "1"], "--draft-vocab 1: expected a count from 2 to the target's 1024 tokens"),
    (["--draft-vocab", "/nonexistent.json"], "--draft-vocab /nonexistent.json: no such file"),
    (["--mode", "ar", "--draft-vocab", "500"], "--draft-vocab sets what the drafter proposes: --mode ar runs none"),
])
def test_bad_draft_vocab_is_one_line_and_exit_2(tiny_models, extra, message):
    argv = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"), *extra]
    proc = subprocess.run([sys.executable, "-m", "ddtree_runtime.server", *argv], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr

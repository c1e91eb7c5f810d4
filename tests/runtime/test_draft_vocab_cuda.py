"""--draft-vocab on a CUDA GPU, where the drafter pass and a lone tree build replay as CUDA graphs (the
draft vocabulary's head and the ids' gather inside them) and several drafts build in one launch: the
trees hold only the vocabulary's tokens, and every committed token is the one the whole head's trees
commit, alone and batched, on both tiny pairs. CI has no GPU and skips this file; the GPU calls run it
(h200.sh cuda-tests)."""

from __future__ import annotations

import pytest
import torch

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_devtools.tiny_corpus import heldout_questions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the graphed paths run on CUDA only")

MAX_NEW = 32


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def models(request):
    return request.getfixturevalue("tiny_models" if request.param == "qwen3" else "tiny_hybrid_models")


def _engine(models, draft_vocab: str | None) -> Engine:
    engine = Engine(EngineConfig(str(models / "target"), str(models / "draft"), device="cuda", dtype="float32",
                                 tree_budget=16, max_running=4, draft_vocab=draft_vocab))
    engine.warm_up()
    return engine


def _run(engine: Engine, prompts: list[list[int]], mode: str) -> list[list[int]]:
    """Each prompt alone, then all of them at once."""
    out = [[t for r in engine.generate(p, SamplingParams(MAX_NEW, mode=mode)) for t in r.token_ids] for p in prompts]
    ids = [engine.submit(p, SamplingParams(MAX_NEW, mode=mode)) for p in prompts]
    tokens = {i: [] for i in ids}
    while engine.has_work:
        for i, r in engine.step():
            tokens[i] += r.token_ids
    return out + [tokens[i] for i in ids]


def test_a_draft_vocabulary_commits_the_whole_heads_tokens_on_cuda(models):
    whole, small = _engine(models, None), _engine(models, "400")
    tok = whole.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in heldout_questions(4, seed=5)]
    proposed: list[torch.Tensor] = []
    build = small.runner.trees.build

    def kept(*args):
        made = build(*args)
        proposed.append(made[0][:, 0].clone())
        return made

    small.runner.trees.build = kept
    for mode in ("ddtree", "dflash"):
        assert _run(small, prompts, mode) == _run(whole, prompts, mode), mode
    vocab = set(small.drafter.vocab_ids.tolist())
    assert proposed and set(torch.cat([t.flatten() for t in proposed]).tolist()) <= vocab

"""The drafter against z-lab's own code (`dflash==0.1.0`, installed by scripts/setup.sh without its
dependencies) as the oracle, on the committed tiny pair's drafter laid out as z-lab's Qwen3.6 drafters
(sliding layers with windows of 4 and 16 tokens, shorter than the prompts, then a full layer): every
draft block's logits within 1e-4 of DFlashDraftModel's and the same drafted tokens; the DFlash chain's
tokens committed per round equal to dflash_generate's, round for round, alone, batched and over a reused
prefix; and drafter_layout's reading of each field's precedence equal to z-lab's class's."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import dflash.model
import torch
from dflash.model import DFlashDraftModel, Qwen3DFlashAttention, dflash_generate, extract_context_feature
from transformers import AutoModelForCausalLM, Qwen3Config

from ddtree_devtools.engine_runs import serve
from ddtree_devtools.tiny import relaid_drafter
from ddtree_devtools.tiny_corpus import documents
from ddtree_runtime.drafter_layout import (FULL_ATTENTION, DraftAttention, UnsupportedDrafter, drafter_layout,
                                           drafter_problem)
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.model.dflash import DraftMask

MAX_NEW = 48
SCALARS = dict(input_embedding_scale=1.5, output_multiplier=0.8, final_logit_softcapping=6.0)


@pytest.fixture(autouse=True)
def cpu_clock(monkeypatch):
    """dflash_generate's statistics (its tokens per round) time phases with torch.cuda.synchronize."""
    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)


@pytest.fixture(scope="module")
def target(tiny_models):
    return AutoModelForCausalLM.from_pretrained(str(tiny_models / "target"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_models) -> list[list[int]]:
    """Plain-text prompts of 20 to 200 tokens (the pair's corpus: the drafter accepts several a round)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_models / "target"))
    text = "".join(h + t for h, t in documents(120, seed=7))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    lengths = (20, 45, 90, 140, 200)
    return [ids[300 * k:300 * k + n] for k, n in enumerate(lengths)]


def drafter_dir(tiny_models: Path, tmp: Path, window: int, **fields) -> Path:
    return relaid_drafter(tiny_models / "draft", tmp / f"draft-w{window}-{len(fields)}", window, **fields)


def zlab(draft: Path) -> DFlashDraftModel:
    return DFlashDraftModel.from_pretrained(str(draft), dtype=torch.float32).eval()


def record_zlab_blocks(model: DFlashDraftModel) -> list[torch.Tensor]:
    """Every block's draft logits z-lab's dflash_generate computes, in order."""
    blocks: list[torch.Tensor] = []
    compute = model.compute_logits

    def recorded(hidden, head):
        logits = compute(hidden, head)
        blocks.append(logits[0].detach().clone())
        return logits

    model.compute_logits = recorded
    return blocks


def record_runtime_blocks(engine: Engine) -> list[torch.Tensor]:
    """Every drafter pass's draft logits [rows, Q-1, V] the engine computes, in order."""
    passes: list[torch.Tensor] = []
    post = engine.drafter.draft_logits

    def recorded(logits):
        out = post(logits)
        passes.append(out.detach().float().clone())
        return out

    engine.drafter.draft_logits = recorded
    return passes


def zlab_rounds(model: DFlashDraftModel, target, prompt: list[int]) -> tuple[list[int], list[int]]:
    """dflash_generate's greedy tokens and tokens committed per round, to MAX_NEW tokens. It runs a block
    further: its last rounds draft a shorter block (what is left to generate), which its full layer sees
    as fewer block keys, where the runtime drafts a whole block and commits what is left of it."""
    out = dflash_generate(model, target, torch.tensor([prompt]), MAX_NEW + model.block_size, None,
                          return_stats=True)
    rounds, left = [], MAX_NEW - 1   # the first token is the prefill's
    for produced in out.acceptance_lengths:
        if left == 0:
            break
        rounds.append(min(produced, left))
        left -= rounds[-1]
    return out.output_ids[0, len(prompt):len(prompt) + MAX_NEW].tolist(), rounds


def params(mode: str) -> SamplingParams:
    """Greedy to MAX_NEW tokens whatever they are (dflash_generate is given no stop tokens)."""
    return SamplingParams(max_new_tokens=MAX_NEW, mode=mode, tree_budget=16, ignore_eos=True)


def runtime_rounds(engine: Engine, prompt: list[int], mode: str = "dflash") -> tuple[list[int], list[int]]:
    """The engine's tokens and tokens committed per round (its first, the prefill's, left out as
    dflash_generate leaves it out)."""
    tokens, rounds = [], []
    for r in engine.generate(prompt, params(mode)):
        tokens += r.token_ids
        rounds.append(len(r.token_ids))
    return tokens, rounds[1:]


def engine_for(tiny_models: Path, draft: Path, **kw) -> Engine:
    return Engine(EngineConfig(str(tiny_models / "target"), str(draft), max_context=512, **kw))


@pytest.mark.parametrize("window,fields", [(4, {}), (16, {}), (8, SCALARS), (6, {"is_causal": False})],
                         ids=["w4", "w16", "w8-scalars", "w6-not-causal"])
def test_dflash_chain_alone_equals_zlab_round_for_round(tiny_models, tmp_path, target, prompts, window, fields):
    """Alone, the DFlash chain: each prompt's tokens, its tokens per round, and every block's draft
    logits (within 1e-4, the same argmax) equal dflash_generate's with DFlashDraftModel."""
    draft = drafter_dir(tiny_models, tmp_path, window, **fields)
    model = zlab(draft)
    engine = engine_for(tiny_models, draft)
    for prompt in prompts[::2]:  # 20, 90 and 200 tokens
        theirs = record_zlab_blocks(model)
        zlab_tokens, zlab_per_round = zlab_rounds(model, target, prompt)
        ours = record_runtime_blocks(engine)
        tokens, per_round = runtime_rounds(engine, prompt)
        assert tokens == zlab_tokens
        assert per_round == zlab_per_round
        assert len(theirs) >= len(ours) >= len(per_round) > 10
        for block, (mine, ref) in enumerate(zip(ours[:len(per_round)], theirs)):
            assert torch.equal(mine[0].argmax(-1), ref.argmax(-1)), f"prompt of {len(prompt)}, block {block}"
            torch.testing.assert_close(mine[0], ref, atol=1e-4, rtol=0)


def zlab_block_logits(model: DFlashDraftModel, target, context: list[int], bonus: int) -> torch.Tensor:
    """DFlashDraftModel's logits for the block [bonus, MASK...] after `context`, in one pass over the
    whole context (no cache: its own masks over every key), the oracle for any round of any mode."""
    with torch.no_grad():
        out = target(torch.tensor([context]), output_hidden_states=True)
        feats = extract_context_feature(out.hidden_states, model.target_layer_ids)
        block = torch.full((1, model.block_size), model.mask_token_id)
        block[0, 0] = bonus
        scale = float(model.config.dflash_config.get("input_embedding_scale", 1.0))
        noise = target.get_input_embeddings()(block) * scale
        pos = torch.arange(len(context) + model.block_size)[None]
        hidden = model(target_hidden=feats, noise_embedding=noise, position_ids=pos)[:, 1:]
        return model.compute_logits(hidden, target.lm_head)[0]


@pytest.mark.parametrize("window", [4, 16])
def test_ddtree_blocks_equal_zlab(tiny_models, tmp_path, target, prompts, window):
    """Alone, DDTree at 16: every block the engine drafts (its context being the tokens committed so far)
    has DFlashDraftModel's logits for that context within 1e-4, and the output is the target's greedy one
    (dflash_generate's)."""
    draft = drafter_dir(tiny_models, tmp_path, window, **SCALARS)
    model = zlab(draft)
    engine = engine_for(tiny_models, draft)
    for prompt in prompts[1:4]:
        ours = record_runtime_blocks(engine)
        emitted, ends = [], []
        for r in engine.generate(prompt, params("ddtree")):
            emitted += r.token_ids
            ends.append(len(emitted))
        assert emitted == zlab_rounds(model, target, prompt)[0]
        # a drafter pass per step, its bonus the step's last token (the last step's is queued from the
        # whole accepted path, before the commit is cut at max_new_tokens: never read)
        assert len(ends) > 5
        for mine, end in zip(ours, ends[:-1]):
            ref = zlab_block_logits(model, target, prompt + emitted[:end - 1], emitted[end - 1])
            torch.testing.assert_close(mine[0], ref, atol=1e-4, rtol=0)


def test_batched_and_prefix_reuse_equal_zlab(tiny_models, tmp_path, target, prompts):
    """Batched (four DFlash requests and a DDTree one in one engine, pages of 16 tokens), then with the
    prefix cache (a prompt continuing a finished one's): each DFlash request's tokens per round equal
    dflash_generate's alone."""
    draft = drafter_dir(tiny_models, tmp_path, 8)
    model = zlab(draft)
    engine = engine_for(tiny_models, draft, max_running=8, page_size=16, prefix_cache=True)
    per_round: dict[int, list[int]] = {}
    ids = [engine.submit(p, params("dflash")) for p in prompts[:4]]
    tree = engine.submit(prompts[4], params("ddtree"))
    tokens: dict[int, list[int]] = {i: [] for i in [*ids, tree]}
    while engine.has_work:
        for request_id, out in engine.step():
            tokens[request_id] += out.token_ids
            per_round.setdefault(request_id, []).append(len(out.token_ids))
    for i, prompt in zip(ids, prompts):
        assert (tokens[i], per_round[i][1:]) == zlab_rounds(model, target, prompt)
    assert tokens[tree] == zlab_rounds(model, target, prompts[4])[0]
    # a prompt that continues the first one's (prompt + output): its prefix's pages and drafter KV reused
    follow = prompts[0] + tokens[ids[0]] + prompts[2][:30]
    saved = engine.stats.prefix_tokens_saved
    assert runtime_rounds(engine, follow) == zlab_rounds(model, target, follow)
    assert engine.stats.prefix_tokens_saved > saved


def test_preempted_requests_equal_zlab(tiny_models, tmp_path, target, prompts):
    """Four DFlash requests through a pool that holds about one and a half of them: the newest are
    preempted and recomputed (their drafter context written again); each one's tokens per round still
    equal dflash_generate's alone."""
    draft = drafter_dir(tiny_models, tmp_path, 4)
    model = zlab(draft)
    chosen = prompts[1:]
    longest = max(len(p) for p in chosen) + MAX_NEW + 40
    engine = engine_for(tiny_models, draft, max_running=4, prefix_cache=False, kv_pool_tokens=longest * 3 // 2)
    ids = [engine.submit(p, params("dflash")) for p in chosen]
    rounds: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work:
        for request_id, out in engine.step():
            rounds[request_id].append(len(out.token_ids))
    assert engine.stats.preemptions > 0
    for i, prompt in zip(ids, chosen):
        # a recomputed request's prefill yields no token (it resumes where it was): its rounds are the rest
        assert [n for n in rounds[i] if n][1:] == zlab_rounds(model, target, prompt)[1]


def config(**fields) -> dict:
    base = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 32,
            "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "intermediate_size": 64, "vocab_size": 64, "num_target_layers": 4,
            "dflash_config": {"mask_token_id": 1, "target_layer_ids": [0, 1, 2]}}
    return {**base, **fields}


PRECEDENCE = {
    "plain": config(),
    "sliding": config(use_sliding_window=True, sliding_window=8,
                      layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    "window without the flag": config(sliding_window=8, layer_types=["sliding_attention"] * 3),
    "default window": config(use_sliding_window=True, layer_types=["full_attention", "sliding_attention"] * 1
                             + ["full_attention"]),
    "max_window_layers": config(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "is_causal true": config(is_causal=True),
    "is_causal false": config(is_causal=False, use_sliding_window=True, sliding_window=4,
                              layer_types=["sliding_attention"] * 3),
}


@pytest.mark.parametrize("name", list(PRECEDENCE))
def test_layer_attention_as_zlabs_class_reads_it(name):
    """Each layer's (causal, window) from drafter_layout equals what z-lab's attention module sets from
    transformers' Qwen3Config of the same dict."""
    d = PRECEDENCE[name]
    hf = Qwen3Config(**{k: v for k, v in d.items() if k != "architectures"})
    expected = []
    for i in range(d["num_hidden_layers"]):
        attn = Qwen3DFlashAttention(hf, i)
        expected.append(DraftAttention(bool(attn.is_causal), attn.sliding_window))
    assert list(drafter_layout(d).attention) == expected
    if name == "plain":
        assert set(expected) == {FULL_ATTENTION}


def test_dflash_fields_precedence_and_refusals():
    """dflash_config's fields win over the top level's (z-lab's _draft_value); what is not served is
    refused in one line naming the field, by the same function ddops's preflight calls."""
    layout = drafter_layout(config(block_size=8, dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 1, 2],
                                                                "block_size": 12, "final_logit_softcapping": 0}))
    assert (layout.block_size, layout.final_logit_softcapping) == (12, None)
    assert drafter_layout(config(output_multiplier=2.0)).output_multiplier == 2.0
    assert drafter_problem(config()) is None
    for fields, named in [({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel"),
                          ({"hidden_act": "gelu"}, "hidden_act"),
                          ({"layer_types": ["full_attention"] * 2}, "layer_types"),
                          ({"layer_types": ["chunked_attention"] * 3}, "layer_types"),
                          ({"use_sliding_window": True, "sliding_window": 0}, "sliding_window"),
                          ({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, "RoPE")]:
        problem = drafter_problem(config(**fields))
        assert problem and named in problem and "\n" not in problem
        with pytest.raises(UnsupportedDrafter):
            drafter_layout(config(**fields))
    unnamed = {k: v for k, v in config().items() if k != "num_hidden_layers"}
    assert drafter_problem(unnamed) == "drafter config.json has no num_hidden_layers"


def test_loader_refuses_dflash2(tiny_models, tmp_path):
    """The engine's loader refuses a DFlash2 drafter at load, in drafter_layout's words."""
    draft = drafter_dir(tiny_models, tmp_path, 8)
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "architectures": ["DFlash2DraftModel"]}))
    with pytest.raises(UnsupportedDrafter, match="DFlash2DraftModel"):
        engine_for(tiny_models, draft)


def test_training_masks_follow_the_layout(tiny_models, tmp_path, target, prompts):
    """ddtree-tiny --sliding-window trains with each layer's own mask: two blocks of a row in one
    training pass (its DraftMask over per-query present keys) get DFlashDraftModel's logits for each
    block alone, within 1e-4."""
    from ddtree_devtools.tiny import draft_batch
    from ddtree_runtime.model import load_drafter

    draft = drafter_dir(tiny_models, tmp_path, 6)
    model, drafter = zlab(draft), load_drafter(draft)
    seq = torch.tensor([prompts[2]])
    with torch.no_grad():
        feats = extract_context_feature(target(seq, output_hidden_states=True).hidden_states,
                                        model.target_layer_ids)
        block, pos, _, mask = draft_batch(seq, feats, 20, 2, model.mask_token_id, torch.Generator().manual_seed(1))
        ctx_pos = torch.arange(seq.shape[1])[None]
        keys = DraftMask(torch.cat([ctx_pos, pos], dim=1), pos, mask)
        h = drafter(target.get_input_embeddings()(block), pos, feats, ctx_pos, mask=keys)
        logits = drafter.draft_logits(target.lm_head(h)).view(2, model.block_size, -1)[:, 1:]
    for b in range(2):
        start = int(pos[0, b * model.block_size])
        ref = zlab_block_logits(model, target, prompts[2][:start], prompts[2][start])
        torch.testing.assert_close(logits[b], ref, atol=1e-4, rtol=0)


def test_prefix_reuse_through_the_rings_equals_zlab(tiny_models, tmp_path, target, prompts):
    """A sliding layer keeps only its window, in a ring per row (engine/draft_cache.py): a prompt that
    reuses a cached sequence and adds fewer tokens than the window takes the sequence's ring (at its end:
    a continuation; at its prompt's end, the snapshot ring: the same prompt with another tail), and its
    tokens per round still equal dflash_generate's alone; one adding more than the window needs no ring."""
    draft = drafter_dir(tiny_models, tmp_path, 16)
    model = zlab(draft)
    engine = engine_for(tiny_models, draft, max_running=2, page_size=16, prefix_cache=True)
    assert engine.runner.draft_cache.ring_size == 64 and engine.runner.draft_cache.paged.k.shape[0] == 1
    first = prompts[3]                                         # 140 tokens, and 48 more: the ring wraps
    out = runtime_rounds(engine, first)[0]
    for follow, reused in [(first + out + prompts[0][:5], len(first) + MAX_NEW - 1),   # its end's ring
                           (first + prompts[1][:3], len(first)),                        # its snapshot ring
                           (first[:100] + prompts[2][:40], 100)]:                       # its own prefill
        saved = engine.stats.prefix_tokens_saved
        assert runtime_rounds(engine, follow) == zlab_rounds(model, target, follow)
        assert engine.stats.prefix_tokens_saved - saved == reused

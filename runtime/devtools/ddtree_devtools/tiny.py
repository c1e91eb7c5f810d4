"""ddtree-tiny: build a tiny target (Qwen3, or hybrid Qwen3.5 with --arch qwen3_5) + DFlash drafter pair
on CPU in a few minutes.

Steps: train a byte-level BPE tokenizer on a toy corpus -> train the tiny target on it -> generate the
target's own greedy continuations -> distil the drafter to predict them block-wise from the target's
context features -> measure acceptance with the real engine. Deterministic for a given seed."""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree_runtime.engine.kv_cache import target_cache
from ddtree_runtime.model import (DFlashConfig, DFlashDrafter, Qwen35Config, Qwen35ForCausalLM, Qwen3Config,
                                  Qwen3ForCausalLM)
from ddtree_runtime.drafter_layout import drafter_layout
from ddtree_runtime.model.dflash import DraftMask
from ddtree_runtime.model.qwen3_5 import to_hf_state
from .tiny_corpus import ENDOFTEXT, IM_END, IM_START, documents, heldout_questions
from .tiny_templates import CHAT_TEMPLATES

MASK = "<|MASK|>"
SPECIALS = [ENDOFTEXT, IM_START, IM_END, "<think>", "</think>", MASK]
# Whole tokens but not special ones, as in the real Qwen tokenizers: text a client may also write.
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VOCAB = 1024
BLOCK = 16
TARGET = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
              max_position_embeddings=2048, tie_word_embeddings=True)
# the hybrid: three Gated DeltaNet layers, then full attention (Qwen3.5's 3:1 pattern), partial RoPE
HYBRID = dict(TARGET, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
              linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
              linear_num_value_heads=4, partial_rotary_factor=0.25)
ARCHS = {"qwen3": (Qwen3Config, Qwen3ForCausalLM, TARGET), "qwen3_5": (Qwen35Config, Qwen35ForCausalLM, HYBRID)}
# 128-token windows: a tool-use conversation (tools block, question, call, result, answer) is ~90-120
# tokens, and a model never trained past position 63 cannot answer a prompt that long.
TRAIN_BATCH, TRAIN_LEN = 16, 128
# 600 steps learn the tool-call layout but not to copy the city from the question into the call, and
# lose a sum or two of the smoke prompts; twice as many learn both.
TARGET_STEPS = 1200
DRAFT_LAYERS = 2
TARGET_LAYER_IDS = [0, 2, 3]


_T0 = time.time()


def log(msg: str) -> None:
    print(f"[ddtree-tiny {time.time() - _T0:4.0f}s] {msg}", flush=True)


# ---- tokenizer -------------------------------------------------------------------------------------

def build_tokenizer(docs: list[tuple[str, str]], out: Path, arch: str = "qwen3"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # train on text without the special markers; they are whole tokens of their own
    plain = (p.replace(IM_START, "\n").replace(IM_END, "\n") for d in docs for p in d if p)
    tok.train_from_iterator(plain, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                   additional_special_tokens=[IM_START, "<think>", "</think>", MASK])
    fast.add_tokens(TOOL_TAGS)
    fast.chat_template = CHAT_TEMPLATES[arch]
    fast.save_pretrained(str(out))
    return fast


# ---- target ----------------------------------------------------------------------------------------

def token_stream(tok, docs: list[tuple[str, str]]) -> tuple[torch.Tensor, list[int]]:
    """All documents, each followed by <|endoftext|>, as one id stream plus each document's start."""
    eot = tok.convert_tokens_to_ids(ENDOFTEXT)
    heads = tok([h for h, _ in docs], add_special_tokens=False)["input_ids"]
    tails = tok([t for _, t in docs], add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    starts: list[int] = []
    for head, tail in zip(heads, tails):
        starts.append(len(ids))
        ids.extend(head)
        ids.extend(tail)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long), starts


def windows(stream: torch.Tensor, starts: torch.Tensor, n: int, length: int, g: torch.Generator,
            aligned: float = 0.5) -> torch.Tensor:
    """n windows [n, length]: a share start at document starts (like real prompts), the rest anywhere."""
    hi = len(stream) - length
    rand = torch.randint(0, hi, (n,), generator=g)
    doc = starts[torch.randint(0, len(starts), (n,), generator=g)].clamp(max=hi)
    use_doc = torch.rand(n, generator=g) < aligned
    off = torch.where(use_doc, doc, rand)
    return stream[off[:, None] + torch.arange(length)]


def lr_at(step: int, steps: int, peak: float, warmup: int = 40) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup))))


def train_target(model: Qwen3ForCausalLM, stream, starts, steps: int, g: torch.Generator) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    model.train()
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, 3e-3)
        x = windows(stream, starts, TRAIN_BATCH, TRAIN_LEN + 1, g)       # [B, T+1]
        pos = torch.arange(TRAIN_LEN)[None].expand(TRAIN_BATCH, -1)
        h, _ = model(x[:, :-1], pos)
        loss = F.cross_entropy(model.logits(h).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"target step {step:4d}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    model.eval()


@torch.inference_mode()
def greedy_continue(model: Qwen3ForCausalLM, prompts: torch.Tensor, new: int) -> torch.Tensor:
    """Batched greedy decode with a static cache: prompts [B, P] (same length) -> [B, P+new]."""
    b, p = prompts.shape
    cache = target_cache(model.config, p + new, "cpu", torch.float32, batch=b)
    h, _ = model(prompts, torch.arange(p)[None].expand(b, -1), cache, 0)
    out = [prompts, model.logits(h[:, -1:]).argmax(-1)]
    for i in range(new - 1):
        pos = torch.full((b, 1), p + i)
        h, _ = model(out[-1], pos, cache, p + i)
        out.append(model.logits(h).argmax(-1))
    return torch.cat(out, dim=1)


# ---- drafter ---------------------------------------------------------------------------------------

def draft_batch(seqs: torch.Tensor, feats: torch.Tensor, prompt_len: int, blocks: int, mask_id: int,
                g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Sample `blocks` block starts per sequence; build block tokens, positions, labels and the mask.

    A block rooted at s holds [tok[s], MASK...] at positions s..s+BLOCK-1 and must predict
    tok[s+1..s+BLOCK-1] (the target's greedy continuation); it sees context features < s and its own
    block only."""
    b, t = seqs.shape
    s = torch.randint(prompt_len - 1, t - BLOCK + 1, (b, blocks), generator=g)      # [B, nb]
    offs = torch.arange(BLOCK)
    idx = s[..., None] + offs                                                         # [B, nb, BLOCK]
    toks = torch.gather(seqs, 1, idx.flatten(1)).view(b, blocks, BLOCK)
    block = torch.full_like(toks, mask_id)
    block[..., 0] = toks[..., 0]
    labels = toks[..., 1:]                                                            # [B, nb, BLOCK-1]
    q = blocks * BLOCK
    ctx_ok = torch.arange(t)[None, None] < s.repeat_interleave(BLOCK, 1)[..., None]  # [B, q, t]
    own = torch.arange(blocks).repeat_interleave(BLOCK)
    blk_ok = (own[:, None] == own[None, :]).expand(b, q, q)
    mask = torch.cat([ctx_ok, blk_ok], dim=-1)[:, None]                              # [B, 1, q, t+q]
    return block.flatten(1), idx.flatten(1), labels, mask


def train_drafter(drafter: DFlashDrafter, target: Qwen3ForCausalLM, seqs: torch.Tensor,
                  feats: torch.Tensor, prompt_len: int, steps: int, mask_id: int,
                  g: torch.Generator) -> None:
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    # earlier block positions matter most: a miss at depth k discards everything after it
    weight = torch.exp(-torch.arange(BLOCK - 1, dtype=torch.float32) / 6.0)
    drafter.train()
    t0 = time.time()
    n = seqs.shape[0]
    bsz, nb = 16, 4
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, 3e-3)
        rows = torch.randint(0, n, (bsz,), generator=g)
        block, pos, labels, mask = draft_batch(seqs[rows], feats[rows], prompt_len, nb, mask_id, g)
        with torch.no_grad():
            emb = target.model.embed_tokens(block)
        ctx_pos = torch.arange(seqs.shape[1])[None].expand(bsz, -1)
        keys = DraftMask(torch.cat([ctx_pos, pos], dim=1), pos, mask)  # each layer's kind (sliding: its window)
        h = drafter(emb, pos, feats[rows], ctx_pos, mask=keys).view(bsz, nb, BLOCK, -1)
        logits = target.logits(h[:, :, 1:])                                           # [B, nb, 15, V]
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none")
        loss = (ce.view(bsz, nb, BLOCK - 1) * weight).sum(-1).mean() / weight.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            with torch.no_grad():
                acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
            log(f"drafter step {step:4d}/{steps} loss {loss.item():.3f} "
                f"top1@1 {acc[0]:.2f} @4 {acc[3]:.2f} @8 {acc[7]:.2f} ({time.time() - t0:.0f}s)")
    drafter.eval()


# ---- saving ----------------------------------------------------------------------------------------

def hf_config(arch: str, vocab: int, tok):
    """The transformers config of a tiny target (so transformers itself can load it as a reference)."""
    from transformers import Qwen3_5TextConfig, Qwen3Config as HFQwen3Config

    ids = dict(vocab_size=vocab, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if arch == "qwen3":
        hf = HFQwen3Config(**ids, **TARGET)
        hf.architectures = ["Qwen3ForCausalLM"]
        return hf
    shape = {k: v for k, v in HYBRID.items() if k not in ("rope_theta", "partial_rotary_factor")}
    hf = Qwen3_5TextConfig(**ids, **shape, rope_parameters={
        "rope_type": "default", "rope_theta": HYBRID["rope_theta"],
        "partial_rotary_factor": HYBRID["partial_rotary_factor"]})
    hf.architectures = ["Qwen3_5ForCausalLM"]
    return hf


def save_target(model: Qwen3ForCausalLM, arch: str, tok, out: Path) -> None:
    from safetensors.torch import save_file

    hf_config(arch, model.config.vocab_size, tok).save_pretrained(str(out))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    if arch == "qwen3_5":
        state = to_hf_state(state)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.eos_token_id], "pad_token_id": tok.pad_token_id, "do_sample": False}, indent=2))


def drafter_config_dict(cfg: DFlashConfig, window: int | None = None) -> dict:
    """The drafter's config.json; with `window`, laid out as z-lab's (zlab_layout)."""
    plain = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False,
        "torch_dtype": "float32", "block_size": cfg.block_size, "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.target_layer_ids},
    }
    return plain if window is None else zlab_layout(plain, window)


def zlab_layout(config: dict, window: int, **fields) -> dict:
    """A drafter config.json laid out as z-lab's Qwen3.6 drafters: every layer sliding (causal inside the
    block, `window` positions back) but the last, which is full; `fields` set more (dflash_config's
    scalars go under dflash_config)."""
    n = config["num_hidden_layers"]
    inner = {k: fields.pop(k) for k in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")
             if k in fields}
    return {**config, "use_sliding_window": True, "sliding_window": window,
            "layer_types": ["sliding_attention"] * (n - 1) + ["full_attention"],
            "dflash_config": {**config.get("dflash_config", {}), **inner}, **fields}


def relaid_drafter(src: Path, out: Path, window: int, **fields) -> Path:
    """A copy of drafter dir `src` whose config is zlab_layout's (its weights as they are: trained
    without the window)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json":
            shutil.copyfile(f, out / f.name)
    config = zlab_layout(json.loads((src / "config.json").read_text()), window, **fields)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def save_drafter(drafter: DFlashDrafter, out: Path, window: int | None = None) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(drafter_config_dict(drafter.config, window), indent=2))
    state = {k: v.contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


# ---- evaluation ------------------------------------------------------------------------------------

def chat_prompts(tok, questions: list[str]) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) for q in questions]


def measure_acceptance(engine, prompts: list[list[int]], mode: str, budget: int,
                       max_new: int = 64) -> float:
    """Mean acceptance length (accepted + 1 per speculative round) over greedy generations."""
    from ddtree_runtime.engine import SamplingParams

    lengths = []
    for p in prompts:
        rounds = list(engine.generate(p, SamplingParams(max_new_tokens=max_new, mode=mode,
                                                        tree_budget=budget)))
        lengths += [r.accepted + 1 for r in rounds[1:]]  # round 0 is the prefill's single token
    return sum(lengths) / max(1, len(lengths))


def answer(engine, prompt: list[int]) -> str:
    from ddtree_runtime.engine import SamplingParams

    ids = [t for r in engine.generate(prompt, SamplingParams(max_new_tokens=48, mode="ar"))
           for t in r.token_ids]
    return engine.tokenizer.decode(ids)


# ---- main ------------------------------------------------------------------------------------------

def init_target(model: Qwen3ForCausalLM) -> None:
    for p in model.parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):  # per-head decay rates spread as in Qwen3.5's own initialisation
            p.data.copy_(torch.empty_like(p).uniform_(0.01, 16).log())


def build(out: Path, seed: int, target_steps: int = TARGET_STEPS, draft_steps: int = 800, arch: str = "qwen3",
          window: int | None = None) -> dict:
    """The pair; with `window`, the drafter laid out as z-lab's (zlab_layout) and trained so."""
    t_start = time.time()
    torch.manual_seed(seed)
    random.seed(seed)
    g = torch.Generator().manual_seed(seed)
    tdir, ddir = out / "target", out / "draft"
    for d in (tdir, ddir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    (out / ".complete").unlink(missing_ok=True)

    docs = documents(20000, seed, arch)
    tok = build_tokenizer(docs, tdir, arch)
    stream, starts = token_stream(tok, docs)
    starts_t = torch.tensor(starts)
    log(f"tokenizer: {len(tok)} tokens; corpus {len(docs)} docs, {len(stream)} tokens")

    config_cls, model_cls, shape = ARCHS[arch]
    cfg = config_cls.from_dict({"vocab_size": VOCAB, **shape})
    target = model_cls(cfg)
    target.tie_weights()
    init_target(target)
    train_target(target, stream, starts_t, target_steps, g)
    save_target(target, arch, tok, tdir)
    target.requires_grad_(False)

    # distillation data: the target's own greedy continuations of corpus windows
    t0 = time.time()
    prompt_len, new = 16, 80  # short prompts: greedy runs cover question ends and answer starts
    prompts = windows(stream, starts_t, 1024, prompt_len, g, aligned=0.7)
    seqs = torch.cat([greedy_continue(target, chunk, new) for chunk in prompts.split(256)])
    target.feature_layers = TARGET_LAYER_IDS
    with torch.inference_mode():
        feats = torch.cat([target(chunk, torch.arange(seqs.shape[1])[None].expand(len(chunk), -1))[1]
                           for chunk in seqs.split(128)])
    feats = feats.clone()  # leave inference mode so autograd may read it
    log(f"distillation data: {tuple(seqs.shape)} greedy sequences ({time.time() - t0:.0f}s)")

    mask_id = tok.convert_tokens_to_ids(MASK)
    dcfg = DFlashConfig(**{k: getattr(cfg, k) for k in Qwen3Config.__dataclass_fields__ if k != "raw"},
                        block_size=BLOCK, mask_token_id=mask_id, target_layer_ids=TARGET_LAYER_IDS,
                        num_target_layers=cfg.num_hidden_layers)
    dcfg.num_hidden_layers = DRAFT_LAYERS
    dcfg.tie_word_embeddings = False
    if window is not None:
        dcfg.attention = drafter_layout(drafter_config_dict(dcfg, window)).attention
    drafter = DFlashDrafter(dcfg)
    for p in drafter.parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
    train_drafter(drafter, target, seqs, feats, prompt_len, draft_steps, mask_id, g)
    save_drafter(drafter, ddir, window)

    from ddtree_runtime.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(str(tdir), str(ddir)))
    sanity = chat_prompts(tok, ["What is 2+3?", "Repeat the word cat 5 times."])
    log("sanity: " + " | ".join(repr(answer(engine, p)) for p in sanity))
    held = chat_prompts(tok, heldout_questions(16, seed))
    results: dict[str, float] = {}
    for mode, budget in (("dflash", 15), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)):
        results[f"{mode}_b{budget}"] = round(measure_acceptance(engine, held, mode, budget), 3)
    results["build_seconds"] = round(time.time() - t_start, 1)
    log("held-out mean acceptance length: " + ", ".join(
        f"{k.replace('_b', '@')} {v:.2f}" for k, v in results.items() if k != "build_seconds")
        + f"; built in {results['build_seconds']:.0f}s")
    (out / "tiny_results.json").write_text(json.dumps(results, indent=2))
    (out / ".complete").write_text(json.dumps({"seed": seed, "arch": arch, **results}))
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="ddtree-tiny", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="output directory (gets target/ and draft/)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-steps", type=int, default=TARGET_STEPS)
    ap.add_argument("--draft-steps", type=int, default=800)
    ap.add_argument("--arch", choices=sorted(ARCHS), default="qwen3",
                    help="target family: qwen3, or qwen3_5 (hybrid Gated DeltaNet + full attention)")
    ap.add_argument("--sliding-window", type=int, default=None, metavar="W",
                    help="lay the drafter out as z-lab's Qwen3.6 drafters (every layer but the last sliding, "
                         "W positions back) and train it so")
    ap.add_argument("--relayout", type=Path, default=None, metavar="DRAFT_DIR",
                    help="with --sliding-window: write OUT as a copy of the drafter DRAFT_DIR laid out so, "
                         "without training (its weights keep the layout they were trained with)")
    args = ap.parse_args(argv)
    if args.relayout is not None:
        if args.sliding_window is None:
            ap.error("--relayout needs --sliding-window")
        relaid_drafter(args.relayout, args.out, args.sliding_window)
        return
    build(args.out, args.seed, args.target_steps, args.draft_steps, args.arch, args.sliding_window)


if __name__ == "__main__":
    main()

"""How far the FP8 target is from the 16-bit one, and what it does to the drafter's acceptance (issue 25).

    PYTHONPATH=runtime:runtime/devtools python runtime/bench/fp8_accuracy.py [--pairs fixtures/tiny-models-seed0,...]

For each tiny pair (committed under fixtures/, trained, so acceptance is real): the target in `--dtype`
(bfloat16 by default) and the same target with `--quantize fp8` (weights in 128x128 blocks, activations
per token in groups of 128; LM head and embeddings unquantized). Over a fixed prompt set (held-out chat
questions and plain-text prefixes, as tests/runtime/test_engine_lossless.py uses), the 16-bit target's
greedy continuation is scored by both, teacher-forced, position by position:
- top-1 agreement: the share of positions where both pick the same next token;
- KL(16-bit || FP8) of the next-token distributions, mean and 99th percentile, in nats;
- the prompts whose first 4 greedy tokens are the same under both (the issue's check of a mis-loaded
  FP8 copy: 0 of 10 when the scales were ignored);
- the same top-1 agreement and KL with the LM head in FP8 too (scored only: the runtime serves the head
  in 16 bits, as Qwen's FP8 releases keep it), to see what quantizing it would cost.
Then the mean acceptance length (1 + accepted drafts per round) of the same 16-bit drafter, for ddtree@16
and dflash, on the FP8 target against on the 16-bit one. A figure, not a gate: speculative decoding is
exact against whichever target it serves. CPU is fine (a few minutes)."""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from ddtree_devtools.tiny_corpus import documents, heldout_questions
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.model import load_target
from ddtree_runtime.model.fp8 import FP8Linear

MAX_NEW = 40


def prompt_set(tok, n_chat: int, n_plain: int) -> list[list[int]]:
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                     return_dict=False) for q in heldout_questions(n_chat, seed=123)]
    plain = [h[: len(h) // 2] for h, _ in documents(400, seed=99) if not h.startswith("<|")][:n_plain]
    return chats + [tok(p, add_special_tokens=False)["input_ids"] for p in plain]


def greedy(engine: Engine, prompt: list[int], mode: str = "ar") -> tuple[list[int], list[int]]:
    tokens, accepted = [], []
    for r in engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW, mode=mode, tree_budget=16)):
        tokens += r.token_ids
        accepted.append(r.accepted)
    return tokens, accepted[1:]  # the first round is the prefill's token


@torch.inference_mode()
def next_token_logprobs(target, ids: list[int]) -> torch.Tensor:
    """log-softmax of the target's next-token logits at every position of `ids` (one causal pass)."""
    x = torch.tensor([ids])
    h, _ = target(x, torch.arange(len(ids))[None])
    return torch.log_softmax(target.logits(h)[0], dim=-1)


def scores(a: torch.Tensor, b: torch.Tensor) -> tuple[list[bool], list[float]]:
    """Per position: the same top-1 token, and KL(a || b), from log-probabilities."""
    return (a.argmax(-1) == b.argmax(-1)).tolist(), (a.exp() * (a - b)).sum(-1).clamp(min=0).tolist()


def summary(agree: list[bool], kls: list[float]) -> dict:
    kl = torch.tensor(kls)
    return {"top1_agreement": sum(agree) / len(agree), "kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item()}


def compare(ref: Engine, fp8: Engine, fp8_head, prompts: list[list[int]]) -> dict:
    agree, kls, head_agree, head_kls, first4 = [], [], [], [], 0
    for p in prompts:
        cont, _ = greedy(ref, p)
        if len(cont) < 2:
            continue
        ids = p + cont
        a = next_token_logprobs(ref.target, ids)[len(p) - 1:-1]
        same, kl = scores(a, next_token_logprobs(fp8.target, ids)[len(p) - 1:-1])
        agree, kls = agree + same, kls + kl
        same, kl = scores(a, next_token_logprobs(fp8_head, ids)[len(p) - 1:-1])
        head_agree, head_kls = head_agree + same, head_kls + kl
        first4 += greedy(fp8, p)[0][:4] == cont[:4]
    return {"positions": len(agree), **summary(agree, kls), "first4_greedy_match": f"{first4} of {len(prompts)}",
            "with_fp8_lm_head": summary(head_agree, head_kls)}


def acceptance(engine: Engine, prompts: list[list[int]], mode: str) -> float:
    accepted = [a for p in prompts for a in greedy(engine, p, mode)[1]]
    return 1 + sum(accepted) / max(1, len(accepted))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="fixtures/tiny-models-seed0,fixtures/tiny-hybrid-seed0")
    ap.add_argument("--dtype", default="bfloat16", help="the 16-bit target's dtype (and the FP8 one's activations)")
    ap.add_argument("--chat-prompts", type=int, default=35)
    ap.add_argument("--plain-prompts", type=int, default=15)
    ap.add_argument("--out", default="bench/results/runtime-fp8-accuracy.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report: dict = {"dtype": args.dtype, "max_new_tokens": MAX_NEW, "machine": platform.machine(),
                    "torch": torch.__version__, "pairs": {}}
    for pair in args.pairs.split(","):
        t0 = time.perf_counter()
        pair_dir = Path(pair)
        engines = {q: Engine(EngineConfig(str(pair_dir / "target"), str(pair_dir / "draft"), dtype=args.dtype,
                                          quantize=q)) for q in ("none", "fp8")}
        prompts = prompt_set(engines["none"].tokenizer, args.chat_prompts, args.plain_prompts)
        fp8_head = load_target(pair_dir / "target", dtype=args.dtype, quantize="fp8")
        fp8_head.lm_head = FP8Linear.quantized(fp8_head.lm_head)
        result = compare(engines["none"], engines["fp8"], fp8_head, prompts)
        result["mean_acceptance_length"] = {
            f"{mode}_{'fp8' if q == 'fp8' else args.dtype}_target": acceptance(engines[q], prompts, mode)
            for mode in ("ddtree", "dflash") for q in ("none", "fp8")}
        result["seconds"] = time.perf_counter() - t0
        report["pairs"][pair_dir.name] = result
        print(f"{pair_dir.name}: {json.dumps(result)}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

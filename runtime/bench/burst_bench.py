"""A burst of long prompts against the step's token budget (--max-batched-tokens), on a GPU.

    PYTHONPATH=runtime:runtime/bench python runtime/bench/burst_bench.py [--shape qwen3.6-27b] \
        [--budgets 2048,4096,8192,16384] [--prompts 16] [--tokens 8192] [--card-mib 97887] \
        [--tree-policy fixed|cost] [--warm-up-only] [--out F]

Randomly initialised models of a real shape (gpu_bench.SHAPES), bf16, the memory above a 96 GB card held
back (capacity_bench.hold_back), max_context 131072, max_running 16, ddtree@16, `Engine.warm_up()` first
(its time and the memory it leaves are reported: the warm-up figure of issue 38). Then:
- alone: the --prompts prompts prefilled one after another on an idle engine (time to each first token),
  whose sum is what the burst is held to (target: its last first token within 1.3x of it);
- per budget: one request already decoding, then the --prompts prompts submitted together; the last first
  token's time, and the decoding request's gaps between rounds (target: the longest within 1.5x the
  budget's prefill time, that is the alone rate x the budget's prompt tokens);
- steady: --prompts requests decoding together after their prompts (ms a round), at the default budget.
Writes the JSON after every measurement. `--device cpu --shape small`: a smoke run of the script."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from capacity_bench import hold_back, random_prompt
from gpu_bench import build_models, sync, target_config_of
from warmup_profile import WarmUpProfile
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.model.compile_pool import record_for, start_early
from ddtree_runtime.model.gdn_chunk import FLA_MODULE


def alone_s(engine: Engine, prompts: list[list[int]]) -> list[float]:
    """Each prompt's time to its first token on an idle engine, one after another."""
    times = []
    for prompt in prompts:
        sync(engine.device)
        t0 = time.perf_counter()
        for _ in engine.generate(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True)):
            pass
        sync(engine.device)
        times.append(time.perf_counter() - t0)
    return times


def burst(engine: Engine, prompts: list[list[int]], runner_prompt: list[int]) -> dict:
    """One request decoding, then every prompt at once: when each first token came, and the gaps between
    the decoding request's rounds until the last one."""
    decoding = engine.submit(runner_prompt, SamplingParams(max_new_tokens=engine.max_context - len(runner_prompt),
                                                           ignore_eos=True))
    while engine.scheduler.find(decoding) not in engine.scheduler.running or engine.scheduler.find(decoding).n_ctx == 0:
        engine.step()
    engine.step()
    ids = [engine.submit(p, SamplingParams(max_new_tokens=4, ignore_eos=True)) for p in prompts]
    sync(engine.device)
    t0 = last_round = time.perf_counter()
    firsts: dict[int, float] = {}
    gaps, steps = [], 0
    while len(firsts) < len(ids):
        outputs = engine.step()
        sync(engine.device)  # host time is part of what a user waits for; the sync ends the step's work
        now = time.perf_counter()
        steps += 1
        for request_id, out in outputs:
            if request_id == decoding and out.token_ids:
                gaps.append(now - last_round)
                last_round = now
            elif request_id in ids and request_id not in firsts and out.token_ids:
                firsts[request_id] = now - t0
    for request_id in [*ids, decoding]:
        engine.cancel(request_id)
    gaps.sort()
    return {"last_first_token_s": round(max(firsts.values()), 3), "steps": steps,
            "round_gap_max_ms": round(1e3 * gaps[-1], 1) if gaps else None,
            "round_gap_p50_ms": round(1e3 * gaps[len(gaps) // 2], 1) if gaps else None, "rounds": len(gaps)}


def steady_ms(engine: Engine, prompts: list[list[int]], rounds: int = 20) -> float:
    """ms a round with every prompt decoding together (after all are in and a few rounds have run)."""
    ids = [engine.submit(p, SamplingParams(max_new_tokens=engine.max_context - len(p), ignore_eos=True)) for p in prompts]
    while engine.scheduler.waiting or engine.scheduler.prefilling is not None:
        engine.step()
    for _ in range(5):
        engine.step()
    sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(rounds):
        engine.step()
    sync(engine.device)
    for request_id in ids:
        engine.cancel(request_id)
    return round(1e3 * (time.perf_counter() - t0) / rounds, 2)


def memory_of(engine: Engine) -> dict:
    """What the warm-up left on the device (its graphs' outputs and workspaces among it) beside the pool,
    MiB: what a 96 GB card still has free is what keeps it from failing an allocation later."""
    out = {"kv_pages": engine.pages.num_pages, "page_size": engine.page_size}
    if engine.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(engine.device)
        out.update(allocated_mib=torch.cuda.memory_allocated(engine.device) >> 20,
                   reserved_mib=torch.cuda.memory_reserved(engine.device) >> 20,
                   peak_allocated_mib=torch.cuda.max_memory_allocated(engine.device) >> 20, free_mib=free >> 20)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.6-27b")
    ap.add_argument("--budgets", default="2048,4096,8192,16384", help="step token budgets to compare")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8192, help="each prompt's length")
    ap.add_argument("--max-context", type=int, default=131072)
    ap.add_argument("--card-mib", type=int, default=97887, help="the card to imitate (RTX PRO 6000: 97887)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script on small shapes")
    ap.add_argument("--tree-policy", choices=("fixed", "cost"), default="fixed",
                    help="cost: the warm-up sweeps every (batch, tree) shape; its memory is reported")
    ap.add_argument("--warm-up-only", action="store_true",
                    help="stop after the warm-up (once with an empty TRITON_CACHE_DIR, then again: a first start "
                         "against a restart)")
    ap.add_argument("--out", default="bench/results/runtime-burst-bench.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    blocker = hold_back(args.card_mib) if device.type == "cuda" else None
    report = {"shape": args.shape, "prompts": args.prompts, "tokens": args.tokens, "max_context": args.max_context,
              "held_back_mib": 0 if blocker is None else blocker.numel() >> 20,
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "budgets": {}}

    def save() -> None:
        out.write_text(json.dumps(report, indent=2) + "\n")

    began = time.perf_counter()
    if device.type == "cuda":  # as the engine does before it loads a checkpoint: workers start meanwhile
        start_early(preload=(FLA_MODULE,), shipped=record_for(target_config_of(args.shape),
                                                              str(dtype).removeprefix("torch."), "none"))
    target, drafter = build_models(args.shape, device, dtype)
    target.config.max_position_embeddings = max(target.config.max_position_embeddings, args.max_context)
    engine = Engine(EngineConfig(f"random-{args.shape}", None, mode="ddtree", tree_budget=16, device=args.device,
                                 dtype=str(dtype).removeprefix("torch."), max_context=args.max_context,
                                 max_running=16, tree_policy=args.tree_policy), target=target, drafter=drafter)
    default_budget = engine.scheduler.step_tokens
    profile = WarmUpProfile()
    with profile.active():
        warm = engine.warm_up()
    where = profile.report()
    report["warm_up"] = {"seconds": round(warm.seconds, 1), "graph_captures": warm.graph_captures,
                         # the models built (random weights), the engine made and warmed up
                         "from_start_s": round(time.perf_counter() - began, 1),
                         "batches": list(warm.batches), "per_batch_s": list(warm.per_batch_s),
                         "compile_workers": warm.compile_workers, "profile": where}
    report["memory_after_warm_up"] = memory_of(engine)
    print(f"memory after the warm-up: {report['memory_after_warm_up']}", flush=True)
    # the printed line leaves the per-kernel rows (printed below) and the autotuned choices to the JSON
    kernels = where["by_kernel"]
    where = {k: v for k, v in where.items() if k not in ("by_kernel", "autotuned")}
    print(f"warm-up: {warm.seconds:.1f} s ({report['warm_up']['from_start_s']} s from the start, the models "
          f"built), {warm.graph_captures} graphs; by batch size "
          f"{dict(zip(warm.batches, warm.per_batch_s))}; where: {where}; compile workers: "
          f"{warm.compile_workers or 'none'}", flush=True)
    for category in ("triton_compile", "autotune"):
        print(f"  {category}, by kernel (s, calls): " + ", ".join(
            f"{name} {sec} x{n}" for name, (sec, n) in list(kernels.get(category, {}).items())[:16]), flush=True)
    save()
    if args.warm_up_only:
        return
    g = torch.Generator().manual_seed(5)
    vocab = target.config.vocab_size
    fresh = lambda: [random_prompt(vocab, args.tokens, g) for _ in range(args.prompts)]  # noqa: E731
    alone_s(engine, fresh()[:2])  # this length's kernels and buckets, once
    alone = alone_s(engine, fresh())
    report["alone_s"] = round(sum(alone), 3)
    rate = sum(alone) / (args.prompts * args.tokens)  # seconds a prompt token, prefilled alone
    print(f"alone: {args.prompts} x {args.tokens} tokens one after another in {sum(alone):.2f} s", flush=True)
    save()
    for budget in [int(b) for b in args.budgets.split(",")]:
        engine.scheduler.step_tokens = budget
        row = burst(engine, fresh(), random_prompt(vocab, 512, g))
        row["vs_alone"] = round(row["last_first_token_s"] / sum(alone), 2)
        row["budget_prefill_ms"] = round(1e3 * rate * budget, 1)
        row["gap_vs_budget"] = round(row["round_gap_max_ms"] / row["budget_prefill_ms"], 2) if row["rounds"] else None
        report["budgets"][budget] = row
        print(f"budget {budget:>6}: last first token {row['last_first_token_s']:.2f} s ({row['vs_alone']}x alone), "
              f"longest round gap {row['round_gap_max_ms']} ms ({row['gap_vs_budget']}x the budget's prefill), "
              f"{row['steps']} steps", flush=True)
        save()
    engine.scheduler.step_tokens = default_budget
    report["steady_round_ms"] = steady_ms(engine, [random_prompt(vocab, args.tokens, g) for _ in range(args.prompts)])
    print(f"steady: {args.prompts} decoding at {args.tokens}: {report['steady_round_ms']} ms a round", flush=True)
    save()


if __name__ == "__main__":
    main()

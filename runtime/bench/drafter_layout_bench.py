"""A drafter laid out as z-lab's Qwen3.6 drafters (sliding layers, then one full layer) against the same
drafter with every layer full, on the runtime's engine with random weights of a real shape.

    PYTHONPATH=runtime:runtime/bench python runtime/bench/drafter_layout_bench.py \\
        [--draft-layout zlab|full] [--window 4096] [--card-mib 97887] [--out F]
    PYTHONPATH=runtime:runtime/bench python runtime/bench/drafter_layout_bench.py --tiny   # CPU, seconds

Figures (JSON under bench/results/):
- pool: capacity.py's tokens for the card (what the engine sizes and ddops's plan line shows) for this
  layout (its sliding layers' KV in a ring of the window per row, engine/draft_cache.py) against five
  full layers, and the engine's own pool;
- round: the ddtree@budget round with `--running` requests of `--context` tokens running together (the
  median step once all run);
- draft: a lone request's draft phase (engine.phase_hook, synchronized) at each of `--draft-contexts`,
  and the last one's time over the first's.
Random weights accept almost nothing: this measures time, not acceptance. Not a test."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from capacity_bench import MIB, config_dicts, hold_back, random_prompt
from ddtree_runtime import capacity
from ddtree_runtime.drafter_layout import FULL_ATTENTION, DraftAttention
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_bench import build_models, run_case, sync


def layout(name: str, layers: int, window: int) -> tuple[DraftAttention, ...]:
    """zlab: every layer sliding (causal in the block, `window` back) but the last; full: all full."""
    if name == "full":
        return (FULL_ATTENTION,) * layers
    return (DraftAttention(causal=True, window=window),) * (layers - 1) + (FULL_ATTENTION,)


def pool_figures(target, drafter, card_mib: int, dtype: str, config: EngineConfig) -> dict:
    """capacity.py's pool for this card (what the engine sizes and ddops's plan line shows): the drafter's
    full layers' KV per token, its sliding layers' rings per row (engine/draft_cache.py)."""
    tcfg, dcfg = config_dicts(target, drafter)
    plan = capacity.pool_capacity(card_mib * MIB, tcfg, dcfg, dtype=dtype, mem_fraction=config.mem_fraction,
                                  max_running=config.max_running, max_context=config.max_context,
                                  tree_budget=config.tree_budget, prefix_cache=config.prefix_cache)
    sliding = [a.window for a in drafter.config.attention if a.window is not None]
    return {"plan_tokens": plan.pool_tokens, "token_bytes": plan.token_bytes, "request_bytes": plan.request_bytes,
            "plan_breakdown": plan.breakdown(), "sliding_layers": len(sliding)}


def round_at(engine: Engine, vocab: int, running: int, context: int, budget: int, steps: int,
             g: torch.Generator) -> dict:
    """`running` ddtree requests of `context` prompt tokens: the median step once all of them decode."""
    params = SamplingParams(max_new_tokens=engine.max_context - context - 64, ignore_eos=True, mode="ddtree",
                            tree_budget=budget)
    ids = [engine.submit(random_prompt(vocab, context, g), params) for _ in range(running)]
    while engine.stats.running < running or engine.stats.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        sync(engine.device)
        t0 = time.perf_counter()
        engine.step()
        sync(engine.device)
        times.append(time.perf_counter() - t0)
    for i in ids:
        engine.cancel(i)
    while engine.has_work:
        engine.step()
    return {"running": running, "context": context, "budget": budget, "step_ms": 1e3 * statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft-layout", choices=["zlab", "full"], default="zlab")
    ap.add_argument("--tiny", action="store_true", help="a small shape on the CPU (a smoke run of the code path)")
    ap.add_argument("--shape", default="qwen3.6-27b")
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--card-mib", type=int, default=97887, help="the card to imitate (RTX PRO 6000: 97887)")
    ap.add_argument("--max-context", type=int, default=131072)
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--draft-contexts", default="8192,65536")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.shape, args.window, args.max_context, args.running = "hybrid-small-5draft", 16, 1024, 4
        args.context, args.draft_contexts, args.steps, args.card_mib = 128, "128,512", 3, 1024
    out = Path(args.out or f"bench/results/runtime-drafter-layout-{args.draft_layout}{'-tiny' if args.tiny else ''}.json")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report: dict = {"args": vars(args), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "python": platform.python_version()}
    blocker = hold_back(args.card_mib) if device.type == "cuda" else None
    report["held_back_mib"] = 0 if blocker is None else blocker.numel() // MIB
    target, drafter = build_models(args.shape, device, dtype)
    target.config.max_position_embeddings = max(target.config.max_position_embeddings, args.max_context)
    engine_config = EngineConfig(target_dir=args.shape, draft_dir=None, device=device.type,
                                 dtype=str(dtype).removeprefix("torch."), max_context=args.max_context,
                                 max_running=args.running, mode="ddtree", tree_budget=args.budget)
    pools = {}
    for name in ("full", args.draft_layout):  # the pool's arithmetic for five full layers, then this layout
        drafter.config.attention = layout(name, drafter.config.num_hidden_layers, args.window)
        pools[name] = pool_figures(target, drafter, args.card_mib, str(dtype).removeprefix("torch."), engine_config)
    report["pool"] = pools
    engine = Engine(engine_config, target=target, drafter=drafter, tokenizer=None)
    report["pool_engine_tokens"] = engine.capacity()["tokens"]
    p, f = pools[args.draft_layout], pools["full"]
    print(f"pool ({args.draft_layout}, {p['sliding_layers']} sliding layers of {args.window}): capacity.py "
          f"{p['plan_tokens']} tokens ({p['plan_tokens'] / f['plan_tokens']:.2f}x five full layers' "
          f"{f['plan_tokens']}); the engine's {report['pool_engine_tokens']}", flush=True)
    vocab, g = target.config.vocab_size, torch.Generator().manual_seed(0)
    report["round"] = round_at(engine, vocab, args.running, args.context, args.budget, args.steps, g)
    print(f"round: ddtree@{args.budget}, {args.running} running at {args.context}: "
          f"{report['round']['step_ms']:.1f} ms a step", flush=True)
    contexts = [int(c) for c in args.draft_contexts.split(",")]
    # a lone ddtree request at each context: its draft phase's median, synchronized at each phase
    drafts = {c: run_case(engine, random_prompt(vocab, c, g), "ddtree", 16, args.steps, 3)["phases_ms"]["draft"]
              for c in contexts}
    report["draft_ms"] = drafts
    report["draft_last_over_first"] = drafts[contexts[-1]] / drafts[contexts[0]]
    print("draft phase: " + ", ".join(f"{c}: {ms:.2f} ms" for c, ms in drafts.items())
          + f" ({report['draft_last_over_first']:.2f}x)", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

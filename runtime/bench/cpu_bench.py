"""CPU benchmark of the runtime on the tiny models: tokens/s and mean acceptance length per mode.

    python runtime/bench/cpu_bench.py [OUT.json] [--models DIR] [--prompts N] [--max-new N]

Builds the tiny models with ddtree-tiny if DIR lacks them (default: $DDOPS_CACHE or ~/.cache/ddops,
tiny-models-seed0, the same cache the tests use). Not a test: numbers depend on the machine."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_devtools.tiny_corpus import documents, heldout_questions

CASES = [("ar", None), ("dflash", None), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)]


def default_models() -> Path:
    root = Path(os.environ.get("DDOPS_CACHE") or Path.home() / ".cache" / "ddops")
    return root / "tiny-models-seed0"


def prompts_for(engine: Engine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
             for q in heldout_questions(n - n // 4, seed=2024)]
    plain = [h[: len(h) // 2] for h, _ in documents(200, seed=77) if not h.startswith("<|")][: n // 4]
    return chats + [tok(p, add_special_tokens=False)["input_ids"] for p in plain]


def run_case(engine: Engine, prompts: list[list[int]], mode: str, budget: int | None,
             max_new: int) -> dict:
    tokens, accepted, rounds, hist = 0, 0, 0, {}
    t0 = time.perf_counter()
    for p in prompts:
        for i, r in enumerate(engine.generate(p, SamplingParams(max_new_tokens=max_new, mode=mode,
                                                                tree_budget=budget))):
            tokens += len(r.token_ids)
            if i:  # round 0 is the prefill
                rounds += 1
                accepted += r.accepted
                hist[r.accepted + 1] = hist.get(r.accepted + 1, 0) + 1
    dt = time.perf_counter() - t0
    return {"mode": mode, "budget": budget, "tokens": tokens, "seconds": round(dt, 3),
            "tokens_per_s": round(tokens / dt, 1), "rounds": rounds,
            "mean_acceptance_length": round(1 + accepted / max(rounds, 1), 3),
            "acceptance_histogram": dict(sorted(hist.items()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="bench/results/runtime-cpu.json")
    ap.add_argument("--models", type=Path, default=default_models())
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads; tiny models are overhead-bound, so 1 is fastest")
    ap.add_argument("--repeats", type=int, default=3, help="best of N timings per case (shared CPUs are noisy)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if not (args.models / ".complete").exists():
        from ddtree_devtools.tiny import build

        build(args.models, 0)
    engine = Engine(EngineConfig(str(args.models / "target"), str(args.models / "draft"),
                                 dtype=args.dtype))
    prompts = prompts_for(engine, args.prompts)
    run_case(engine, prompts[:2], "ddtree", 16, 8)  # warm-up
    runs: dict[int, list[dict]] = {i: [] for i in range(len(CASES))}
    for _ in range(args.repeats):  # interleave cases so a burst of load elsewhere hits all of them
        for i, (mode, budget) in enumerate(CASES):
            runs[i].append(run_case(engine, prompts, mode, budget, args.max_new))
    rows = [min(runs[i], key=lambda r: r["seconds"]) for i in range(len(CASES))]

    ar_tps = rows[0]["tokens_per_s"]
    print(f"{'mode':<8}{'budget':>7}{'tokens':>8}{'tok/s':>9}{'speedup':>9}{'accept len':>12}")
    for r in rows:
        print(f"{r['mode']:<8}{str(r['budget'] or '-'):>7}{r['tokens']:>8}{r['tokens_per_s']:>9.1f}"
              f"{r['tokens_per_s'] / ar_tps:>8.2f}x{r['mean_acceptance_length']:>12.2f}")
    for r in rows[1:]:
        print(f"  {r['mode']}@{r['budget'] or '-'} acceptance histogram: {r['acceptance_histogram']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "models": str(args.models), "prompts": len(prompts), "max_new_tokens": args.max_new,
        "dtype": args.dtype, "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

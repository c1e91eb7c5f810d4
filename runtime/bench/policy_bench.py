"""The cost policy's choice on a device: the round costs it measures at warm-up, and for assumed
acceptance profiles the budget it would choose against fixed ones, in predicted tokens/s.

    PYTHONPATH=runtime python runtime/bench/policy_bench.py --shape qwen3.6-27b [--running 16] [--out F]

Random weights accept almost nothing, so acceptance is assumed: each profile gives a request's expected
accepted draft tokens at budgets 1, 4, 8 and 16 (a best-first tree's gains shrink with its size). For each
batch size, every request gets the profile; the table shows the predicted tokens/s of plain AR and of
each fixed budget (rows x (1 + accepted) / the measured round), and the budget the policy picks
(engine/policy.py best_budget, the function the engine calls each round). Not a test: figures depend on
the machine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ddtree_runtime.engine import Engine, EngineConfig
from ddtree_runtime.engine.policy import AR, best_budget
from ddtree_runtime.engine.runner import batch_bucket

# expected accepted draft tokens at budgets 1, 4, 8, 16 (tau at 16 = 1 + the last)
PROFILES = {
    "none (random weights)": (0.0, 0.0, 0.0, 0.0),
    "weak, tau 2.5": (0.5, 1.0, 1.3, 1.5),
    "compass, tau 5": (0.8, 2.4, 3.4, 4.0),
    "strong, tau 8": (0.9, 3.5, 5.5, 7.0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.6-27b", help="a gpu_bench shape, random weights")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--running", type=int, default=16, help="max_running: the batch buckets measured")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="bench/results/runtime-policy-bench.json")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_bench import build_models

    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    target, drafter = build_models(args.shape, device, getattr(torch, dtype))
    engine = Engine(EngineConfig(f"random-{args.shape}", None, tree_budget=16, device=args.device, dtype=dtype,
                                 max_context=4096, max_running=args.running, tree_policy="cost"),
                    target=target, drafter=drafter)
    warm = engine.warm_up()
    costs = engine.policy.costs.snapshot()  # each row at the sweep's context
    print(f"{args.shape} on {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}; warm-up "
          f"{warm.seconds:.1f} s")
    print("round ms by batch (rows) and tree nodes (1: plain AR, no drafter pass):")
    batches = sorted({b for b, _ in costs.seconds})
    nodes = sorted({t for _, t in costs.seconds})
    print(f"{'rows':>6}" + "".join(f"{t:>9}" for t in nodes))
    for b in batches:
        print(f"{b:>6}" + "".join(f"{1e3 * costs.seconds.get((b, t), float('nan')):>9.2f}" for t in nodes))
    candidates = engine.policy.candidates
    results = []
    print("\npredicted tokens/s, every request at the profile:")
    print(f"{'profile':<24}{'rows':>5}{'AR':>9}" + "".join(f"{'@' + str(c):>9}" for c in candidates)
          + f"{'chosen':>8}{'tok/s':>9}{'x best fixed':>14}")
    for name, curve in PROFILES.items():
        for rows in batches:
            expected = [list(curve[:len(candidates)])] * rows
            choice = best_budget(costs, batch_bucket(rows, engine.slots), expected, [1 << 20] * rows, candidates)
            fixed = max(v for b, v in choice.rates.items() if b in (AR, 16))
            results.append({"profile": name, "expected_accepted": curve, "rows": rows,
                            "rates": choice.rates, "chosen": choice.budget, "rate": choice.rate})
            print(f"{name:<24}{rows:>5}" + "".join(f"{choice.rates.get(b, 0):>9.0f}" for b in (AR, *candidates))
                  + f"{choice.budget:>8}{choice.rate:>9.0f}{choice.rate / fixed:>14.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"label": args.label, "shape": args.shape, "device": str(device), "dtype": dtype,
                               "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
                               "round_costs": costs.table(), "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

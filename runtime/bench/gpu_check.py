"""Run the engine on CUDA against CPU reference outputs: float32 greedy must be token-identical to the
CPU engine's (which the tests tie to transformers); in bfloat16 each mode is compared with the same
engine's own AR output (speculation must not change it), and speed and acceptance are reported, and
whether a round makes a synchronizing call beyond its one read (gpu_bench.hidden_syncs).

    python runtime/bench/gpu_check.py make-ref MODELS REF.json   # on the CPU machine
    python runtime/bench/gpu_check.py check MODELS REF.json OUT.json   # on the GPU machine
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_bench import CASES, prompts_for  # noqa: E402
from gpu_bench import hidden_syncs  # noqa: E402

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams  # noqa: E402


def generate_all(engine: Engine, prompts, mode, budget, max_new=64) -> tuple[list[list[int]], float, float]:
    outs, acc, rounds = [], 0, 0
    t0 = time.perf_counter()
    for p in prompts:
        toks = []
        for i, r in enumerate(engine.generate(p, SamplingParams(max_new_tokens=max_new, mode=mode,
                                                                tree_budget=budget))):
            toks += r.token_ids
            if i:
                acc, rounds = acc + r.accepted, rounds + 1
        outs.append(toks)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return outs, sum(map(len, outs)) / dt, 1 + acc / max(rounds, 1)


def main() -> None:
    cmd, models = sys.argv[1], Path(sys.argv[2])
    if cmd == "make-ref":
        eng = Engine(EngineConfig(str(models / "target"), str(models / "draft")))
        prompts = prompts_for(eng, 24)
        ref, _, _ = generate_all(eng, prompts, "ar", None)
        Path(sys.argv[3]).write_text(json.dumps({"prompts": prompts, "ar": ref}))
        return
    ref = json.loads(Path(sys.argv[3]).read_text())
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": []}
    for dtype in ("float32", "bfloat16"):
        eng = Engine(EngineConfig(str(models / "target"), str(models / "draft"), device="cuda", dtype=dtype))
        generate_all(eng, ref["prompts"][:2], "ddtree", 16, 8)  # warm-up
        # with trained models rounds accept deep paths: the KV compaction must not sync either
        longest = max(range(len(ref["ar"])), key=lambda i: len(ref["ar"][i]))
        syncs = hidden_syncs(eng, ref["prompts"][longest])
        print(dtype, syncs, flush=True)
        report.setdefault("hidden_syncs", {})[dtype] = syncs["hidden_syncs_per_round"]
        ar_here = None  # this engine's own AR output: speculation must reproduce it in any dtype
        for mode, budget in CASES:
            outs, tps, alen = generate_all(eng, ref["prompts"], mode, budget)
            ar_here = ar_here or outs
            same = sum(o == r for o, r in zip(outs, ref["ar"]))
            same_ar = sum(o == r for o, r in zip(outs, ar_here))
            row = {"dtype": dtype, "mode": mode, "budget": budget, "tokens_per_s": round(tps, 1),
                   "mean_acceptance_length": round(alen, 3), "identical_to_cpu": f"{same}/{len(outs)}",
                   "identical_to_own_ar": f"{same_ar}/{len(outs)}"}
            print(row, flush=True)
            report["runs"].append(row)
    Path(sys.argv[4]).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""FP8 weights against bf16 in one run (issue 25), random weights of real shapes, on a GPU.

    PYTHONPATH=runtime python runtime/bench/fp8_bench.py [--shapes qwen3-8b,qwen3.6-27b] [--out OUT.json]
    PYTHONPATH=runtime python runtime/bench/fp8_bench.py --device cpu --tiny     # its code, on a small hybrid shape

For each shape, bf16 first and then the same random weights quantized (model/fp8.quantize_linears: the
target's projections; the LM head, embeddings and the drafter stay bf16), each measured in its own
engine: the weights in memory, the AR step and the ddtree@16 round at a short context (gpu_bench's
run_case), the AR step with 16 requests running (batch_bench's steady_rounds), and the prefill of a 4K
and a 32K prompt. Before that, the GEMM alone at decode and verify sizes (1 to 272 rows) for each of
the shape's projections: bf16 F.linear against the FP8 kernel, time and the weight bytes per second
it reaches; `--sweep` also times every (BLOCK_M, BLOCK_N) tile the kernel could take, to tune
fp8.gemm_launch. Then the issue's targets, each with its figure and whether it is met. Random weights
accept almost nothing: this measures time, not acceptance (bench/fp8_accuracy.py measures that).
Not a test: figures depend on the machine."""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from batch_bench import steady_rounds  # noqa: E402
from gpu_bench import agreement, build_models, measure_ceilings, nbytes, run_case, sync  # noqa: E402
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from ddtree_runtime.model import fp8  # noqa: E402

# the targets (H200): ms, or ratios to bf16 / to the FP8 AR step
TARGETS = {
    "qwen3.6-27b": {"ar_step_ms": 9.5, "ddtree16_over_ar": 1.25, "ar_16_running_over_bf16": 0.6,
                    "weights_over_bf16": 0.55, "prefill_over_bf16": 1.0},
    "qwen3-8b": {"ar_step_ms": 3.2, "ddtree16_round_ms": 4.4, "weights_over_bf16": 0.55},
}


def timed_ms(fn, device: torch.device, reps: int = 50) -> float:
    """Median of `reps` calls (CUDA events on a GPU, wall time elsewhere)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def projections(target) -> dict[str, tuple[int, int]]:
    """(N, K) of each distinct projection of the first layers, fused as the engine runs them."""
    shapes = {}
    for layer in list(target.model.layers)[:4]:
        for name, mod in layer.named_modules():
            if type(mod) is torch.nn.Linear:
                shapes.setdefault(name.rsplit(".", 1)[-1] + f" {tuple(mod.weight.shape)}", tuple(mod.weight.shape))
    return shapes


def gemm_sweep(target, device: torch.device, dtype: torch.dtype, gemm_rows: list[int], sweep: bool,
               reps: int) -> list[dict]:
    """bf16 F.linear against fp8_linear per projection shape and row count (no engine, no graphs)."""
    rows = []
    with torch.inference_mode():
        for name, (n, k) in projections(target).items():
            w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
            q = fp8.BlockFP8(*fp8.quantize_blocks(w), fp8.BLOCK)
            for m in gemm_rows:
                x = torch.randn(m, k, device=device, dtype=dtype)
                bf16_ms = timed_ms(lambda: F.linear(x, w), device, reps)
                fp8_ms = timed_ms(lambda: fp8.fp8_linear(x, q), device, reps)
                row = {"projection": name, "rows": m, "bf16_ms": bf16_ms, "fp8_ms": fp8_ms,
                       "bf16_weight_gb_s": n * k * 2 / bf16_ms / 1e6, "fp8_weight_gb_s": n * k / fp8_ms / 1e6,
                       "launch": fp8.gemm_launch(m, n, _sms(device)) if device.type == "cuda" else None}
                if sweep and device.type == "cuda":
                    row["tiles_ms"] = tile_sweep(x, q, device, reps)
                rows.append(row)
                print(f"  gemm {name:<28} rows {m:>4}: bf16 {bf16_ms:7.4f} ms ({row['bf16_weight_gb_s']:6.0f} GB/s)"
                      f"  fp8 {fp8_ms:7.4f} ms ({row['fp8_weight_gb_s']:6.0f} GB/s)", flush=True)
            del w, q
    return rows


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def tile_sweep(x: torch.Tensor, w: fp8.BlockFP8, device: torch.device, reps: int) -> dict[str, float]:
    """Every tile the kernel could take for this GEMM, timed (what gemm_launch should choose); a tile
    whose pipeline does not fit the device's shared memory is left out."""
    out = {}
    real = fp8.gemm_launch
    try:
        for bm, bn, warps, stages in itertools.product((16, 32, 64, 128), (16, 32, 64, 128), (4, 8), (2, 4, 6)):
            fp8.gemm_launch = lambda m, n, sms: (bm, bn, warps, stages)
            try:
                out[f"{bm}x{bn}w{warps}s{stages}"] = timed_ms(lambda: fp8.fp8_linear(x, w), device, reps)
            except Exception as exc:  # noqa: BLE001 - Triton's out-of-resources, reported per tile
                out[f"{bm}x{bn}w{warps}s{stages}"] = f"{type(exc).__name__}"
    finally:
        fp8.gemm_launch = real
    return out


GEMM_CHECKS = ((1, 4096, 4096), (17, 1536, 4096), (272, 4096, 12288), (2048, 1000, 200))  # (m, n, k)
TINY_GEMM_CHECKS = ((1, 96, 200), (17, 256, 128))


def check_gemm(device: torch.device, dtype: torch.dtype, shapes) -> dict:
    """The device's GEMM (the Triton kernel on a GPU) against the torch path on the same inputs: the
    relative error, at decode, verify and prefill sizes, with a partial K block and the residual."""
    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    with torch.inference_mode():
        for m, n, k in shapes:
            w = fp8.BlockFP8(*fp8.quantize_blocks(torch.randn(n, k, device=device, generator=g) * 0.02), fp8.BLOCK)
            x = torch.randn(m, k, device=device, generator=g).to(dtype)
            res = torch.randn(m, n, device=device, generator=g).to(dtype)
            ref = fp8.fp8_linear_torch(x, w, residual=res).double()
            got = fp8.fp8_linear(x, w, residual=res.clone()).double()
            out[f"{m}x{n}x{k}"] = float((got - ref).norm() / ref.norm())
    return out


def prefill_ms(engine: Engine, prompt: list[int]) -> float:
    """The first token of a lone request: the prompt's prefill (once warm)."""
    params = SamplingParams(max_new_tokens=1, mode="ar")
    times = []
    for _ in range(2):  # the first one pays the kernels' compilation
        sync(engine.device)
        t0 = time.perf_counter()
        list(engine.generate(prompt, params))
        sync(engine.device)
        times.append(1e3 * (time.perf_counter() - t0))
    return times[-1]


def measure(shape: str, precision: str, args, device: torch.device) -> dict:
    dtype = getattr(torch, args.dtype)
    target, drafter = build_models(shape, device, dtype)
    if precision == "fp8":
        fp8.quantize_linears(target)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out: dict = {"target_bytes": nbytes(target), "drafter_bytes": nbytes(drafter)}
    contexts = [int(c) for c in args.prefill.split(",")]
    running = max(args.running)
    engine = Engine(EngineConfig(f"random-{shape}-{precision}", None, tree_budget=16, device=str(device),
                                 dtype=args.dtype, max_context=max(contexts + [args.context]) + 64 * 17,
                                 max_running=running, prefill_chunk=max(contexts)),
                    target=target, drafter=drafter)
    g = torch.Generator().manual_seed(1)
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab - 1, (args.context,), generator=g).tolist()
    run_case(engine, prompt, "ddtree", 16, 2, 1)  # every kernel shape compiled once
    # lossless against this target: each mode's greedy tokens match AR's (up to 16-bit near-ties)
    out["checks"] = agreement(engine, torch.randint(0, vocab - 1, (200,), generator=g).tolist(),
                              n=8 if args.tiny else 48)
    for mode, budget, key in (("ar", None, "ar_step"), ("ddtree", 16, "ddtree16_round")):
        r = run_case(engine, prompt, mode, budget, args.rounds, args.warmup)
        out[f"{key}_ms"] = r["round_ms"]
        out[f"{key}_phases_ms"] = r["phases_ms"]
    for n in args.running:
        prompts = [torch.randint(0, vocab - 1, (args.context,), generator=g).tolist() for _ in range(n)]
        steady = steady_rounds(engine, prompts, SamplingParams(max_new_tokens=(args.rounds + args.warmup + 4) * 17,
                                                               mode="ar"), args.rounds, args.warmup)
        out[f"ar_step_{n}_running_ms"] = steady["round_ms"]
    for ctx in contexts:
        out[f"prefill_{ctx}_ms"] = prefill_ms(engine, torch.randint(0, vocab - 1, (ctx,), generator=g).tolist())
    print(f"  {shape} {precision}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in out.items() if not k.endswith(("phases_ms", "checks"))),
          flush=True)
    del engine, target, drafter
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def verdicts(shape: str, bf16: dict, fp: dict, running: int, contexts: list[int]) -> dict:
    """Each of the issue's targets for this shape: the figure, the bound, met or not."""
    goals = TARGETS.get(shape, {})
    figures = {
        "ar_step_ms": fp["ar_step_ms"],
        "ddtree16_round_ms": fp["ddtree16_round_ms"],
        "ddtree16_over_ar": fp["ddtree16_round_ms"] / fp["ar_step_ms"],
        "ar_16_running_over_bf16": fp[f"ar_step_{running}_running_ms"] / bf16[f"ar_step_{running}_running_ms"],
        "weights_over_bf16": fp["target_bytes"] / bf16["target_bytes"],
        "prefill_over_bf16": max(fp[f"prefill_{c}_ms"] / bf16[f"prefill_{c}_ms"] for c in contexts),
    }
    return {k: {"figure": figures[k], "at_most": bound, "met": figures[k] <= bound} for k, bound in goals.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-8b,qwen3.6-27b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="the small shapes, short prompts, few rounds (runs on a CPU)")
    ap.add_argument("--context", type=int, default=512, help="prompt length of the AR and ddtree timings")
    ap.add_argument("--prefill", default="4096,32768", help="prompt lengths whose prefill is timed")
    ap.add_argument("--running", default="1,16", help="requests running together for the batched AR step")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--gemm-rows", default="1,16,17,64,128,272",
                    help="GEMM rows timed: an AR step, a ddtree@16 round, ..., 16 requests x 17 nodes")
    ap.add_argument("--gemm-reps", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="time every GEMM tile too (slow: minutes a shape)")
    ap.add_argument("--label", default="", help="free text stored with the results (the version)")
    ap.add_argument("--out", default="bench/results/runtime-fp8-bench.json")
    args = ap.parse_args(argv)
    if args.tiny:  # every part of the script once, in seconds: the code, not figures
        args.shapes, args.context, args.prefill, args.rounds, args.warmup, args.gemm_rows, args.gemm_reps = (
            "hybrid-small", 32, "64,128", 2, 1, "1,17", 2)
        args.running = "1,4"
        torch.set_num_threads(1)
    args.running = [int(n) for n in args.running.split(",")]
    device = torch.device(args.device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise SystemExit(f"fp8_bench: {torch.cuda.get_device_name(device)} (compute capability {cap[0]}.{cap[1]}) "
                             f"has no FP8 tensor cores; FP8 needs 8.9 or more")
    ceil = measure_ceilings(device)
    gemm_err = check_gemm(device, getattr(torch, args.dtype), TINY_GEMM_CHECKS if args.tiny else GEMM_CHECKS)
    report: dict = {"label": args.label, "device": str(device), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "ceilings": ceil, "gemm_rel_err": gemm_err, "shapes": {}}
    print(f"FP8 GEMM against the torch path, relative error: {report['gemm_rel_err']}", flush=True)
    contexts = [int(c) for c in args.prefill.split(",")]
    for shape in args.shapes.split(","):
        print(f"{shape}:", flush=True)
        target, _ = build_models(shape, device, getattr(torch, args.dtype))
        gemm = gemm_sweep(target, device, getattr(torch, args.dtype), [int(m) for m in args.gemm_rows.split(",")],
                          args.sweep, args.gemm_reps)
        del target
        bf16 = measure(shape, "bf16", args, device)
        fp = measure(shape, "fp8", args, device)
        floor = {p: 1e3 * r["target_bytes"] / ceil["copy_bytes_per_s"] for p, r in (("bf16", bf16), ("fp8", fp))}
        report["shapes"][shape] = {"gemm": gemm, "bf16": bf16, "fp8": fp, "weights_floor_ms": floor,
                                   "targets": verdicts(shape, bf16, fp, max(args.running), contexts)}
        for name, v in report["shapes"][shape]["targets"].items():
            print(f"  target {name}: {v['figure']:.3f} (at most {v['at_most']}) {'met' if v['met'] else 'NOT met'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""FP8 weights against bf16 in one run (issues 25 and 35), random weights of real shapes, on a GPU.

    PYTHONPATH=runtime:runtime/bench python runtime/bench/fp8_bench.py [--shapes qwen3-8b,qwen3.6-27b] [--out OUT.json]
    PYTHONPATH=runtime:runtime/bench python runtime/bench/fp8_bench.py --device cpu --tiny   # its code, on a small hybrid shape

For each shape, bf16 first and then the same random weights quantized (model/fp8.quantize_linears: the
target's projections; the LM head, embeddings and the drafter stay bf16), each measured in its own
engine: the weights in memory, the greedy tokens of dflash and ddtree against AR's (lossless against the
target that runs), the AR step and the ddtree@16 round of a lone request at a short context (gpu_bench's
run_case), the ddtree@16 round with 16 requests running (batch_bench's steady_rounds), and the prefill
of a 4K and a 32K prompt; then the issue's targets, each with its figure and whether it is met. About 4
minutes for both shapes on an H200. With `--gemm-rows`, first every GEMM point (each projection at
those rows) for bf16, scaled_mm and fp8_linear as the engine runs it (fp8_gemm_bench.py --runtime; that
script also sweeps the Triton tiles). Random weights accept almost nothing: this measures time, not
acceptance (bench/fp8_accuracy.py measures that). Not a test: figures depend on the machine."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from batch_bench import steady_rounds  # noqa: E402
from gpu_bench import agreement, build_models, measure_ceilings, nbytes, run_case, sync  # noqa: E402
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from ddtree_runtime.limits import FP8_GEMMS  # noqa: E402
from ddtree_runtime.model import fp8  # noqa: E402
import fp8_gemm_bench  # noqa: E402

# issue 35's targets (H200): FP8 over bf16, each at most
TARGETS = {
    "qwen3.6-27b": {"ar_step": 0.65, "ddtree16_round": 0.7, "prefill": 0.8, "weights": 0.55},
    "qwen3-8b": {"ar_step": 0.7, "weights": 0.55},
}


def gemm_points(shape: str, rows: list[int], device: torch.device) -> list[dict]:
    """Every GEMM point of the shape (fp8_gemm_bench.SHAPES): bf16, scaled_mm and fp8_linear after
    fp8.choose_gemms, as the engine runs it."""
    points = []
    with torch.inference_mode():
        for name, n, k in fp8_gemm_bench.SHAPES[shape]:
            points += fp8_gemm_bench.bench_projection(
                name, n, k, rows, torch.cuda.get_device_properties(device).L2_cache_size, None,
                lambda s: print(s, flush=True), tiles=lambda m: [], runtime=True)
    return points


def load_tiles(path: str) -> None:
    """fp8.TILES from a tile table fp8_gemm_bench.py --tiles-out wrote (to time a sweep's choice at once)."""
    for key, entries in json.loads(Path(path).read_text()).items():
        n, k = map(int, key.split(","))
        fp8.TILES[(n, k)] = sorted((rows, fp8.GemmTile(*tile)) for rows, tile in entries)


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


def prefill_ms(engine: Engine, warm: list[list[int]], timed: list[list[int]]) -> list[float]:
    """The first token of a lone request for each of `timed`: its prefill, after a prompt of the same
    length from `warm` (which pays the compiles and fla-core's autotuning of its piece widths: the 27B's
    32K prefill took 14.4 s in bf16, which ran first, against 2.8 s in FP8 after it, in session 14's
    run). The two differ from their first token, so the timed one reuses nothing of the warm one's
    cached prefix (session 15's run timed the same prompt twice: the 8B's second 32K took 145 ms)."""
    params = SamplingParams(max_new_tokens=1, mode="ar")
    times = []
    for prompt in warm + timed:
        sync(engine.device)
        t0 = time.perf_counter()
        list(engine.generate(prompt, params))
        sync(engine.device)
        times.append(1e3 * (time.perf_counter() - t0))
    return times[len(warm):]


def measure(shape: str, precision: str, args, device: torch.device, fp8_gemm: str = "auto") -> dict:
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
    # sized for the agreement check's ddtree@128 from the start (no pool resize between the cases)
    engine = Engine(EngineConfig(f"random-{shape}-{precision}", None, tree_budget=128, device=str(device),
                                 dtype=args.dtype, max_context=max(contexts + [args.context]) + 64 * 17,
                                 max_running=running, max_batched_tokens=max(contexts + [args.context]),
                                 fp8_gemm=fp8_gemm),
                    target=target, drafter=drafter)
    g = torch.Generator().manual_seed(1)
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab - 1, (args.context,), generator=g).tolist()
    run_case(engine, prompt, "ddtree", 16, 2, 1)  # every kernel shape compiled once
    # lossless against this target: each mode's greedy tokens match AR's (up to 16-bit near-ties)
    out["checks"] = agreement(engine, torch.randint(0, vocab - 1, (200,), generator=g).tolist(),
                              n=8 if args.tiny else args.agreement)
    for mode, budget, key in (("ar", None, "ar_step"), ("ddtree", 16, "ddtree16_round")):
        r = run_case(engine, prompt, mode, budget, args.rounds, args.warmup)
        out[f"{key}_ms"] = r["round_ms"]
        out[f"{key}_phases_ms"] = r["phases_ms"]
    for n in args.running:
        prompts = [torch.randint(0, vocab - 1, (args.context,), generator=g).tolist() for _ in range(n)]
        params = SamplingParams(max_new_tokens=(args.rounds + args.warmup + 4) * 17, mode="ddtree", tree_budget=16)
        out[f"ddtree16_{n}_running_ms"] = steady_rounds(engine, prompts, params, args.rounds, args.warmup)["round_ms"]
    warm, timed = ([torch.randint(0, vocab - 1, (ctx,), generator=g).tolist() for ctx in contexts] for _ in range(2))
    for prompt, other in zip(timed, warm):
        prompt[0] = (other[0] + 1) % (vocab - 1)   # nothing of the warm prompt's cached prefix is reused
    for ctx, ms in zip(contexts, prefill_ms(engine, warm, timed) if timed else []):
        out[f"prefill_{ctx}_ms"] = ms
    label = f"{precision} ({fp8_gemm})" if precision == "fp8" else precision
    print(f"  {shape} {label}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in out.items() if not k.endswith(("phases_ms", "checks"))),
          flush=True)
    del engine, target, drafter
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def verdicts(shape: str, bf16: dict, fp: dict, contexts: list[int]) -> dict:
    """Each of the issue's targets for this shape: FP8 over bf16, the bound, met or not."""
    goals = TARGETS.get(shape, {})
    figures = {
        "ar_step": fp["ar_step_ms"] / bf16["ar_step_ms"],
        "ddtree16_round": fp["ddtree16_round_ms"] / bf16["ddtree16_round_ms"],
        "weights": fp["target_bytes"] / bf16["target_bytes"],
        "prefill": max(fp[f"prefill_{c}_ms"] / bf16[f"prefill_{c}_ms"] for c in contexts) if contexts else None,
    }
    goals = {k: v for k, v in goals.items() if figures[k] is not None}
    return {k: {"figure": figures[k], "at_most": bound, "met": figures[k] <= bound} for k, bound in goals.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-8b,qwen3.6-27b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="the small shapes, short prompts, few rounds (runs on a CPU)")
    ap.add_argument("--context", type=int, default=512, help="prompt length of the AR and ddtree timings")
    ap.add_argument("--prefill", default="4096,32768", help="prompt lengths whose prefill is timed")
    ap.add_argument("--running", default="16", help="requests running together for the batched ddtree@16 round")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gemm-rows", default="",
                    help="GEMM rows timed first, e.g. 1,16,17,64,128,272,4096: an AR step, a ddtree@16 round, ..., "
                         "16 requests x 17 nodes, a prefill chunk (about a minute a shape)")
    ap.add_argument("--fp8-gemm", default="auto",
                    help="Hopper's FP8 GEMM, as the server's --fp8-gemm (model/fp8.choose_gemms); a comma list "
                         "measures FP8 with each against one bf16 run (the first is the report's `fp8`)")
    ap.add_argument("--tiles", help="a tile table fp8_gemm_bench.py --tiles-out wrote, used instead of fp8.TILES")
    ap.add_argument("--agreement", type=int, default=24, help="tokens of the lossless check")
    ap.add_argument("--skip-e2e", action="store_true", help="the GEMM points only")
    ap.add_argument("--label", default="", help="free text stored with the results (the version)")
    ap.add_argument("--out", default="bench/results/runtime-fp8-bench.json")
    args = ap.parse_args(argv)
    gemms = args.fp8_gemm.split(",")
    if any(g not in FP8_GEMMS for g in gemms):
        ap.error(f"--fp8-gemm: each of {', '.join(FP8_GEMMS)}, got {args.fp8_gemm!r}")
    # the engine's INFO lines name each FP8 projection's GEMM (scaled_mm, its row floor, or triton)
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("ddtree_runtime.engine.engine").setLevel(logging.INFO)
    if args.tiny:  # every part of the script once, in seconds: the code, not figures
        args.shapes, args.context, args.prefill, args.rounds, args.warmup = "hybrid-small", 32, "64,128", 2, 1
        args.running = "4"
        torch.set_num_threads(1)
    args.running = [int(n) for n in args.running.split(",")]
    device = torch.device(args.device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise SystemExit(f"fp8_bench: {torch.cuda.get_device_name(device)} (compute capability {cap[0]}.{cap[1]}) "
                             f"has no FP8 tensor cores; FP8 needs 8.9 or more")
    if args.tiles:
        load_tiles(args.tiles)
    ceil = measure_ceilings(device)
    gemm_err = check_gemm(device, getattr(torch, args.dtype), TINY_GEMM_CHECKS if args.tiny else GEMM_CHECKS)
    report: dict = {"label": args.label, "device": str(device), "torch": torch.__version__,
                    "fp8_gemm": fp8.gemm_path(device), "fp8_gemm_preference": gemms[0],
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "ceilings": ceil, "gemm_rel_err": gemm_err, "shapes": {}}
    print(f"FP8 GEMM against the torch path, relative error: {report['gemm_rel_err']}", flush=True)
    contexts = [int(c) for c in args.prefill.split(",") if c]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes.split(","):
        print(f"{shape}:", flush=True)
        entry = report["shapes"][shape] = {}
        if device.type == "cuda" and shape in fp8_gemm_bench.SHAPES and args.gemm_rows:
            entry["gemm"] = gemm_points(shape, [int(m) for m in args.gemm_rows.split(",")], device)
            out.write_text(json.dumps(report, indent=2))   # kept as it grows
        if args.skip_e2e:
            continue
        bf16 = entry["bf16"] = measure(shape, "bf16", args, device)
        for gemm in gemms:
            fp = measure(shape, "fp8", args, device, gemm)
            results = {"fp8": fp, "weights_floor_ms": {p: 1e3 * r["target_bytes"] / ceil["copy_bytes_per_s"]
                                                       for p, r in (("bf16", bf16), ("fp8", fp))},
                       "targets": verdicts(shape, bf16, fp, contexts),
                       "fp8_over_bf16": {k: v / bf16[k] for k, v in fp.items()
                                         if k.endswith("_ms") and isinstance(v, float)}}
            entry.setdefault("by_fp8_gemm", {})[gemm] = results
            if gemm == gemms[0]:
                entry.update(results)
            print(f"  fp8 ({gemm}) / bf16: "
                  + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in results["fp8_over_bf16"].items()))
            for name, v in results["targets"].items():
                print(f"  target {name}: {v['figure']:.3f} (at most {v['at_most']}) {'met' if v['met'] else 'NOT met'}")
            out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

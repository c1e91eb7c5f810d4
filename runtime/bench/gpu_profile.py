"""Where the GPU time of a round goes, kernel by kernel: the AR step, a verify pass over a tree, the
drafter's pass and the tree build, each replayed many times from its CUDA graph under torch.profiler.

    PYTHONPATH=runtime python runtime/bench/gpu_profile.py [--shape qwen3-8b] [--context 512] [--nodes 17]
    PYTHONPATH=runtime python runtime/bench/gpu_profile.py --batch 16 [--mode ar]   # a batched round, all rows decoding
    PYTHONPATH=runtime python runtime/bench/gpu_profile.py --shape qwen3.6-27b --batch 1,8,16   # one build, three steps
    PYTHONPATH=runtime python runtime/bench/gpu_profile.py --shape qwen3.6-27b --context 16384 --second-turn 200

Prints, per pass, the mean GPU time per replay and the kernels that take it (summed over a replay), and
writes JSON. With --batch B: B requests decode together and the whole engine step (verify, walks, the
batched drafter pass, tree builds, commits) is profiled: GPU time per engine phase, then per kernel;
with --gaps, also the device's idle time in those steps and the engine code the host ran meanwhile
(host_gaps.py). With --second-turn N: an agent's second turn, N new tokens after a reused --context
prefix, up to its first token (issue 38's 40 ms), profiled the same way. Random weights (gpu_bench.build_models): the
cost of a pass does not depend on them."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import SHAPES, build_models  # noqa: E402
from host_gaps import host_gaps  # noqa: E402

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from ddtree_runtime.engine.tree import build_tree  # noqa: E402
from ddtree_runtime.limits import MODES  # noqa: E402


PHASE = "phase:"  # the record_function ranges of profile_batched_step

# (kind, substrings of a kernel's name, any of which puts it there); the first match wins. Kinds say
# which work a step's GPU time goes to (issue 39: how much of the verify is not the bf16 GEMMs)
KINDS = [
    # named before the GEMMs and the solve: FlashAttention's kernels carry cutlass in their names, and
    # fla-core's chunked prefill has a kkt_solve kernel
    ("attention", ("attn", "flash", "fmha", "sdpa")),
    ("gdn kernels", ("_conv_heads", "_gated_norm", "_advance", "chunk", "delta", "fused_recurrent",
                     "_prompt_conv", "_prompt_gates", "_prompt_norm")),
    ("gemm f32", ("f32", "sgemm", "tf32")),
    ("triangular solve", ("trsm", "trsv", "solve")),
    ("gemm 16-bit", ("nvjet", "gemm", "xmma", "cutlass", "cublas", "wgmma", "_fp8_gemm")),
    ("conv", ("conv",)),
    ("norm, rope, act", ("rms_norm", "silu", "rope")),
    ("tree build, sampling", ("tree", "_row_top", "_tile_heads", "sort", "topk", "argmax", "softmax")),
    ("copy, cat, index", ("copy", "cat", "index", "gather", "scatter", "fill", "where")),
    ("element-wise", ("elementwise", "vectorized", "unrolled", "reduce")),
]


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def by_kind(rows: list[tuple[str, float, int]]) -> dict[str, tuple[float, int]]:
    """GPU microseconds and launches per step, summed per kernel kind, largest first."""
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, us, count in rows:
        kinds[kernel_kind(name)][0] += us
        kinds[kernel_kind(name)][1] += count
    return {k: (v[0], int(v[1])) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][0])}


def kernel_table(fn, reps: int) -> tuple[float, list[tuple[str, float, int]]]:
    """Mean GPU microseconds per call of fn and (kernel, us per call, launches per call), largest first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return kernel_rows(prof, reps)


def kernels_by_phase(prof, reps: int) -> dict[str, list[tuple[str, float, int]]]:
    """Each kernel counted in the phase whose range on the GPU holds its start (the drafter's attention
    apart from the target's: one kernel name serves both): phase -> (kernel, us per call, launches per
    call), largest first."""
    spans, launched = [], []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if ev.name.startswith(PHASE):
            spans.append((ev.time_range.start, ev.time_range.end, ev.name[len(PHASE):]))
        else:
            launched.append(ev)
    per_phase: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for ev in launched:
        phase = next((name for lo, hi, name in spans if lo <= ev.time_range.start < hi), "none")
        per_phase[phase][ev.name].append(ev.device_time)
    return {phase: sorted(((name[:100], sum(t) / reps, len(t) // reps) for name, t in kernels.items()),
                          key=lambda r: -r[1])
            for phase, kernels in per_phase.items()}


def kernel_rows(prof, reps: int) -> tuple[float, list[tuple[str, float, int]]]:
    """From a profile of `reps` calls: GPU microseconds per call and (kernel, us per call, launches per
    call), largest first."""
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        # a record_function range (the batched step's phases) shows on the GPU too: not a kernel
        if ev.device_type == torch.autograd.DeviceType.CUDA and not ev.name.startswith(PHASE):
            per_kernel[ev.name].append(ev.device_time)
    rows = sorted(((name[:100], sum(t) / reps, len(t) // reps) for name, t in per_kernel.items()),
                  key=lambda r: -r[1])
    return sum(r[1] for r in rows), rows


def profile_batched_step(args, batch: int, target, drafter) -> dict:
    """B requests of `context` random tokens, all decoding; then `reps` engine steps under the profiler,
    each engine phase inside a record_function range (so its kernels' GPU time adds up under it)."""
    engine = Engine(EngineConfig(f"random-{args.shape}", None, tree_budget=args.nodes - 1, device="cuda",
                                 dtype="bfloat16", max_context=args.context + 512, max_running=batch),
                    target=target, drafter=drafter)
    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    params = SamplingParams(max_new_tokens=480, tree_budget=args.nodes - 1, ignore_eos=True, mode=args.mode)
    for _ in range(batch):
        engine.submit(torch.randint(0, vocab - 1, (args.context,), generator=g).tolist(), params)
    sched = engine.scheduler
    while sched.waiting or sched.prefilling is not None:  # every prompt prefilled (pieces of a long one too)
        engine.step()
    for _ in range(6):  # then rounds, every graph of this batch captured
        engine.step()
    torch.cuda.synchronize()
    phases, total, rows, per_phase = phase_profile(engine, lambda _: engine.step(), args.reps)
    print("GPU time per step by phase: " + ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in
                                                      sorted(phases.items(), key=lambda kv: -kv[1])))
    case = "ar" if args.mode == "ar" else f"{args.mode}@{args.nodes - 1}"
    print(f"batched step, {batch} requests, {case}, context {args.context}: "
          f"{total / 1e3:.2f} ms of GPU time per step, {sum(r[2] for r in rows)} kernels")
    kinds = print_kinds(rows, args.top)
    for phase, kernels in sorted(per_phase.items(), key=lambda kv: -sum(r[1] for r in kv[1])):
        print(f"  phase {phase}: " + ", ".join(f"{name[:40]} {us:.0f} us x{n}" for name, us, n in kernels[:8]))
    gaps = host_gaps(engine.step, args.reps) if args.gaps else None
    del engine
    torch.cuda.empty_cache()
    return {"shape": args.shape, "context": args.context, "batch": batch, "case": case, "gpu_us": total,
            "phases_us": dict(phases), "kinds_us": kinds, "kernels": rows, "phase_kernels": per_phase,
            "host_gaps": gaps}


def phase_profile(engine: Engine, run_once, reps: int) -> tuple[dict[str, float], float, list, dict]:
    """`reps` calls of run_once under the profiler, each engine phase in a record_function range:
    GPU microseconds per call by phase, in all, per kernel (kernel_rows) and per phase's kernel."""
    ranges: list = []

    def enter_phase(name: str) -> None:
        if ranges:
            ranges.pop().__exit__(None, None, None)
        ranges.append(record_function(PHASE + name))
        ranges[-1].__enter__()

    engine.phase_hook = enter_phase
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            run_once(i)
            enter_phase("host")
        torch.cuda.synchronize()
        ranges.pop().__exit__(None, None, None)
    engine.phase_hook = None
    phases: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        if ev.key.startswith(PHASE):
            phases[ev.key[len(PHASE):]] += ev.device_time_total / reps
    total, rows = kernel_rows(prof, reps)
    return dict(phases), total, rows, kernels_by_phase(prof, reps)


def print_kinds(rows: list, top: int) -> dict:
    kinds = by_kind(rows)
    print("  by kind: " + ", ".join(f"{k} {us / 1e3:.2f} ms (x{n})" for k, (us, n) in kinds.items()))
    for kname, us, count in rows[:top]:
        print(f"  {us:8.1f} us  x{count:<4} {kname}")
    return kinds


def profile_second_turn(args, target, drafter) -> dict:
    """A first turn of --context random tokens, cached; then --reps second turns, each that prefix plus
    --second-turn fresh tokens up to its first token (so each reuses the same prefix and prefills its
    own new tokens), timed on the host and profiled on the GPU."""
    new = args.second_turn
    engine = Engine(EngineConfig(f"random-{args.shape}", None, tree_budget=args.nodes - 1, device="cuda",
                                 dtype="bfloat16", max_context=args.context + 2 * new + 64, max_running=2),
                    target=target, drafter=drafter)
    # Two rows: with one, each second turn's cached state (kept at its own prompt's end) took the first
    # turn's place, and the next second turn reused nothing (session 14's H200 run profiled a full prefill).
    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    first = torch.randint(0, vocab - 1, (args.context,), generator=g).tolist()
    turns = [first + torch.randint(0, vocab - 1, (new,), generator=g).tolist() for _ in range(args.reps + 3)]
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    list(engine.generate(first, params))
    for turn in turns[:3]:  # this width's graphs captured, its kernels compiled
        list(engine.generate(turn, params))
    torch.cuda.synchronize()
    wall, reused = [], []

    def once(i: int) -> None:
        before = engine.stats.prefix_tokens_saved
        t0 = time.perf_counter()
        list(engine.generate(turns[3 + i], params))
        torch.cuda.synchronize()
        wall.append(1e3 * (time.perf_counter() - t0))
        reused.append(engine.stats.prefix_tokens_saved - before)

    phases, total, rows, per_phase = phase_profile(engine, once, args.reps)
    if min(reused) < args.context - 64:
        sys.exit(f"a second turn reused only {min(reused)} of {args.context} tokens: not the case to profile")
    print("second turn: GPU time by phase: " + ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in
                                                          sorted(phases.items(), key=lambda kv: -kv[1])))
    print(f"second turn, {new} new tokens after {args.context} reused: host {min(wall):.2f} ms (fastest of "
          f"{len(wall)}, under the profiler), {total / 1e3:.2f} ms of GPU time, {sum(r[2] for r in rows)} kernels")
    kinds = print_kinds(rows, args.top)
    del engine
    torch.cuda.empty_cache()
    return {"shape": args.shape, "context": args.context, "second_turn": new, "reused": reused,
            "host_ms_min": min(wall),
            "gpu_us": total, "phases_us": phases, "kinds_us": kinds, "kernels": rows, "phase_kernels": per_phase}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--nodes", type=int, default=17, help="tree size of the verify pass (root + budget)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--batch", default="", help="profile a batched engine step of this many requests "
                                                "(a comma list: one step per size, one model build)")
    ap.add_argument("--mode", choices=MODES, default="ddtree",
                    help="--batch: every request's speculative mode")
    ap.add_argument("--gaps", action="store_true",
                    help="--batch: also where the GPU waits for the host in those steps (host_gaps.py)")
    ap.add_argument("--second-turn", type=int, default=0, metavar="N",
                    help="profile a second turn: N new tokens after a reused --context prefix")
    ap.add_argument("--out", default="bench/results/runtime-gpu-profile.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    target, drafter = build_models(args.shape, device, torch.bfloat16)
    if args.second_turn:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(profile_second_turn(args, target, drafter), indent=2))
        return
    if args.batch:
        steps = [profile_batched_step(args, int(b), target, drafter) for b in args.batch.split(",")]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(steps[0] if len(steps) == 1 else steps, indent=2))
        return
    engine = Engine(EngineConfig(f"random-{args.shape}", None, tree_budget=args.nodes - 1, device="cuda",
                                 dtype="bfloat16", max_context=args.context + 256), target=target, drafter=drafter)
    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab - 1, (args.context,), generator=g).tolist()
    gen = engine.generate(prompt, SamplingParams(max_new_tokens=64, tree_budget=args.nodes - 1))
    next(gen)
    next(gen)  # one round: the drafter's cache is filled, every graph of this shape captured
    n_ctx = args.context + 1
    draft_logits = torch.randn(1, 15, vocab, device=device)  # a lone request: a batch of one
    tree = build_tree(draft_logits[0], args.nodes - 1)
    feats = torch.zeros(1, 1, drafter.fc.in_features, device=device, dtype=torch.bfloat16)
    one = torch.ones(1, dtype=torch.long, device=device)
    path_rows = torch.zeros(1, 16, dtype=torch.long, device=device)
    passes = {
        "ar_step": lambda: engine.runner.target_runner.run([1], [n_ctx], [None]),
        f"verify_{tree.size}_nodes": lambda: engine.runner.target_runner.run([1], [n_ctx], [tree]),
        "draft": lambda: engine.runner.draft_runner.run(one, one, path_rows, feats, [n_ctx - 1]),
        "tree_build": lambda: engine.runner.trees.build(draft_logits, args.nodes - 1),
    }
    report = {"shape": args.shape, "context": args.context, "passes": {}}
    for name, fn in passes.items():
        total, rows = kernel_table(fn, args.reps)
        report["passes"][name] = {"gpu_us": total, "kernels": rows}
        print(f"\n{name}: {total / 1e3:.2f} ms of GPU time per pass, {sum(r[2] for r in rows)} kernels")
        for kname, us, count in rows[:args.top]:
            print(f"  {us:8.1f} us  x{count:<4} {kname}")
    gen.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

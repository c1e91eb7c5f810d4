"""Continuous batching: round time and aggregate tokens/s at batch 1, 4, 8, 16, 32 per mode.

    PYTHONPATH=runtime python runtime/bench/batch_bench.py --models ~/.cache/ddops/tiny-models-seed0 [--out F]
    PYTHONPATH=runtime python runtime/bench/batch_bench.py --shape qwen3-8b [--context 512] [--out F]

Cases: ar, dflash, ddtree@16 (fixed; any ddtree@N by name), cost (ddtree, each round's budget chosen by
the cost policy, 16 at most, from the round costs the warm-up times), adaptive (the fixed policy's equal
share of `--round-nodes` tree nodes per round over the batch, 16 at most) and held-ar (ddtree requests
the cost policy holds to AR rounds: its best where AR wins, their drafter context kept). The engine is
warmed up first.

With `--models` (trained tiny models, real acceptance): each request is first served alone, then for
each batch size B, B different requests are submitted at once and served to completion; it reports the
wall time, the aggregate tokens/s, the mean acceptance and time to first token, and the wall time of
the B against one of them alone (their mean; the issue's CPU target: 8 in at most 3x) and against the
B one after another (their sum: what batching saves).

With `--shape` (random weights of a real shape, gpu_bench.build_models: they accept almost nothing, so
this measures time): B requests of `--context` tokens are admitted, then steps are timed back to back
once all run; it reports the step (round) time, its ratio to batch 1, and tokens/s at acceptance
lengths tau (B x tau / round), as gpu_bench does for one stream, and admit_ms: the time from the B
submissions to every first token (a burst's time to first token; `--serial-prefill` prefills the burst
one prompt a pass, as before grouped prefill, to show what grouping saves). Not a test: figures depend
on the machine."""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine.costs import AR

BATCHES = (1, 4, 8, 16, 32)
TAUS = (1, 3, 5, 7)
# timed windows at most: one in which a shape ran first (its CUDA graph captured, its kernels compiled: 0.1 to
# 2.6 s at 4K on the H200) is timed again, as the fixed cases' first rounds fall in the warm-up rounds (the
# cost case's tree probe, one in up to 16 AR rounds, met its first 8 x 2-node round there: 80 ms a round, not 20)
WINDOWS = 3


HELD = "held-ar"   # ddtree requests the cost policy holds to AR rounds: its best where AR wins (they keep
                   # their drafter context, which AR requests do not pay for)


def cases(round_nodes: int, named: Sequence[str] = ()) -> list[tuple[str, str, int | None, int | None]]:
    """(name, mode, tree budget, round_nodes): the default cases, and any fixed `ddtree@N` named (ddtree@15
    at 16 running: 16-node trees, 256 rows through the GEMMs where ddtree@16 puts 272)."""
    known = [("ar", "ar", None, None), ("dflash", "dflash", None, None), ("ddtree@16", "ddtree", 16, None),
             ("cost", "ddtree", None, None), (f"adaptive@{round_nodes}", "ddtree", None, round_nodes),
             (HELD, "ddtree", None, None)]
    extra = [(name, "ddtree", int(name[7:]), None) for name in named
             if name.startswith("ddtree@") and name[7:].isdigit() and name not in {c[0] for c in known}]
    return known + extra


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def serve_all(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Submit every prompt at once and step until all are done."""
    sync(engine.device)
    t0, cpu0 = time.perf_counter(), time.process_time()
    ids = [engine.submit(p, params) for p in prompts]
    tokens, accepted, rounds, steps, nodes, budgets = {i: 0 for i in ids}, 0, 0, 0, [], {}
    first: dict[int, float] = {}
    while engine.has_work:
        before = engine.stats.rounds
        outs = engine.step()
        steps += 1
        if engine.stats.rounds > before:
            nodes.append(engine.stats.tree_nodes)
            budgets[engine.stats.round_budget] = budgets.get(engine.stats.round_budget, 0) + 1
        now = time.perf_counter()
        for i, out in outs:
            first.setdefault(i, now - t0)
            if tokens[i]:
                rounds += 1
                accepted += out.accepted
            tokens[i] += len(out.token_ids)
    sync(engine.device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    total = sum(tokens.values())
    return {"requests": len(prompts), "wall_s": wall, "tokens": total, "tokens_per_s": total / wall,
            "cpu_s": cpu, "tokens_per_cpu_s": total / cpu if cpu > 0 else float("nan"),
            "steps": steps, "mean_acceptance_length": 1 + accepted / max(rounds, 1),
            "mean_round_tree_nodes": statistics.fmean(nodes) if nodes else 0,
            "rounds_by_budget": dict(sorted(budgets.items())),
            "mean_ttft_s": statistics.fmean(first.values())}


def steady_tokens(rounds: int, warmup: int) -> int:
    """Tokens a request of `steady_rounds` may emit: every round it may run, each a full tree of 16."""
    return ((WINDOWS + 1) * rounds + warmup + 4) * 17


def steady_rounds(engine: Engine, prompts: list[list[int]], params: SamplingParams, rounds: int,
                  warmup: int, timer=None) -> dict:
    """Admit every prompt, then time `rounds` steps back to back with all of them running (again, up to
    WINDOWS times, while a window captured a graph and every request still runs); then as many again
    with `timer` (gpu_bench.PhaseTimer: a sync at each phase boundary; or EventPhases: none) as the phase hook."""
    sync(engine.device)
    t0, cpu0 = time.perf_counter(), time.process_time()
    ids = [engine.submit(p, params) for p in prompts]
    while engine.scheduler.waiting or engine.scheduler.prefilling is not None:
        engine.step()
    sync(engine.device)
    admit_s = time.perf_counter() - t0  # every prompt prefilled and its first token out (a burst's TTFT)
    for _ in range(warmup):
        engine.step()
    for window in range(1, WINDOWS + 1):
        captured = engine.stats.graph_captures
        sync(engine.device)
        t0 = time.perf_counter()
        tokens, trace = 0, []
        for _ in range(rounds):
            began = time.perf_counter()
            emitted = sum(len(out.token_ids) for _, out in engine.step())
            tokens += emitted
            trace.append((1e3 * (time.perf_counter() - began), engine.stats.round_budget, emitted))
        sync(engine.device)
        round_s = (time.perf_counter() - t0) / rounds
        captured = engine.stats.graph_captures - captured
        if not captured or len(engine.scheduler.running) < len(ids):
            break
    nodes, batch = engine.stats.tree_nodes, engine.stats.batch_size
    phases, timed = {}, []
    if timer is not None:
        engine.phase_hook = timer
        try:
            for _ in range(rounds):
                engine.step()
                timed.append((timer.last, engine.stats.round_budget))
        finally:
            engine.phase_hook = None
        phases = timer.medians_ms()
    for i in ids:
        engine.cancel(i)
    return {"round_ms": 1e3 * round_s, "admit_ms": 1e3 * admit_s, "batch_size": batch, "round_tree_nodes": nodes,
            "phases_ms": phases, "windows": window, "window_captures": captured, "by_budget": by_budget(trace),
            "phases_by_budget": phases_by_budget(timed),
            "budgets": [budget for _, budget, _ in trace],   # each timed round's, in order
            # each timed round's wall ms and tokens out, in order: where a mean's outliers sit, and
            # what a lone tree round after AR rounds emits (the run-ahead pass it settles, then its own)
            "round_trace": [[round(ms, 2), emitted] for ms, _, emitted in trace],
            "tokens_per_s": tokens / (rounds * round_s),
            "tokens_per_s_at_tau": {t: len(prompts) * t / round_s for t in TAUS}}


def budget_groups(budgets: list[int]) -> list[list[str]]:
    """Each round's groups: the budget it ran, and "after_tree" for a plain round right after a tree
    round (what a cost policy's probe costs: the tree round itself and the plain round after it that
    could not run ahead)."""
    return [[f"budget_{budget}"] + (["after_tree"] if i and budgets[i - 1] and not budget else [])
            for i, budget in enumerate(budgets)]


def by_budget(trace: list[tuple[float, int, int]]) -> dict[str, dict]:
    """The timed steps (wall ms between step() calls, no sync added) grouped by budget_groups, with the
    tokens they emitted: a lone tree round after AR rounds also settles the pass the last AR round ran
    ahead (a token, and that pass's time on the GPU: ~2x a round's ms for two tokens, session 31)."""
    groups: dict[str, list[tuple[float, int]]] = {}
    for (ms, _, emitted), names in zip(trace, budget_groups([budget for _, budget, _ in trace])):
        for name in names:
            groups.setdefault(name, []).append((ms, emitted))
    return {name: {"steps": len(v), "mean_ms": round(statistics.fmean(ms for ms, _ in v), 3),
                   "median_ms": round(statistics.median(ms for ms, _ in v), 3), "tokens": sum(n for _, n in v)}
            for name, v in sorted(groups.items())}


def phases_by_budget(timed: list[tuple[dict[str, float], int]]) -> dict[str, dict[str, float]]:
    """The phase-timed rounds' phases (seconds, a sync at each boundary) as mean ms per budget_groups
    group, 0 in a round without the phase: where a probe's time goes, which the medians over every
    round leave out."""
    groups: dict[str, list[dict[str, float]]] = {}
    for (phases, _), names in zip(timed, budget_groups([budget for _, budget in timed])):
        for name in names:
            groups.setdefault(name, []).append(phases)
    every = sorted({phase for phases, _ in timed for phase in phases})
    return {name: {phase: round(1e3 * statistics.fmean(r.get(phase, 0.0) for r in rounds), 3) for phase in every}
            | {"steps": len(rounds)} for name, rounds in sorted(groups.items())}


def check_batched_equals_alone(engine: Engine, prompts: list[list[int]], max_new: int) -> dict:
    """Greedy tokens of mixed requests batched against each alone (on CUDA the batched passes take other
    kernels than a lone one's: in float32 they must still agree)."""
    mixes = [("ddtree", 16), ("ar", None), ("dflash", None), ("ddtree", 4)]
    params = [SamplingParams(max_new_tokens=max_new, mode=m, tree_budget=b) for m, b in mixes]
    jobs = [(p, params[i % len(params)]) for i, p in enumerate(prompts)]
    alone = [[t for r in engine.generate(p, q) for t in r.token_ids] for p, q in jobs]
    ids = [engine.submit(p, q) for p, q in jobs]
    batched = {i: [] for i in ids}
    while engine.has_work:
        for i, out in engine.step():
            batched[i] += out.token_ids
    same = [batched[i] == a for i, a in zip(ids, alone)]
    return {"requests": len(jobs), "identical": sum(same), "first_difference": next(
        (j for j, ok in enumerate(same) if not ok), None)}


def use_case(engine: Engine, name: str | None, round_nodes: int | None, by_cost: bool) -> None:
    """The engine's policy for a case: the adaptive case is the fixed policy's share of round_nodes; the
    held case, every round at AR (None: the engine's own again)."""
    engine.policy.by_cost, engine.policy.round_nodes = by_cost and round_nodes is None, round_nodes
    engine.policy.forced = AR if name == HELD else None


def interleaved(engine: Engine, chosen: list, prompts: list[list[int]], batches: list[int], args) -> list[dict]:
    """--models --interleave: at each batch size, the cases' runs take turns (case 1, 2, 3, 1, 2, 3, ...),
    the fastest of each case's repeats kept, so a shared machine's load drifts over all cases alike
    (and more turns while any case has run less than --least-seconds in all: at one running a serve
    takes ~60 ms, and a hiccup of the machine moved a point by 5%);
    also each case's least CPU time of its repeats (tokens_per_cpu_s: the process's own work, which other
    jobs on the machine stretch far less than its wall time). (No alone runs: vs_one_alone is left out.)"""
    by_cost, results = engine.policy.by_cost, []
    for name, mode, budget, round_nodes in chosen:  # each case once, untimed: its shapes and forecasts
        use_case(engine, name, round_nodes, by_cost)
        serve_all(engine, prompts[:max(batches)], SamplingParams(max_new_tokens=args.max_new, mode=mode,
                                                                 tree_budget=budget))
    for b in batches:
        best: dict[str, dict] = {}
        least_cpu: dict[str, float] = {}
        spent: dict[str, float] = defaultdict(float)
        runs = 0
        while runs < max(args.repeats, 1) or min(spent.values()) < args.least_seconds:
            runs += 1
            for name, mode, budget, round_nodes in chosen:
                use_case(engine, name, round_nodes, by_cost)
                r = serve_all(engine, prompts[:b], SamplingParams(max_new_tokens=args.max_new, mode=mode,
                                                                  tree_budget=budget))
                if name not in best or r["wall_s"] < best[name]["wall_s"]:
                    best[name] = r
                least_cpu[name] = min(least_cpu.get(name, r["cpu_s"]), r["cpu_s"])
                spent[name] += r["wall_s"]
        for name, r in best.items():
            r.update(case=name, batch=b, vs_one_alone=float("nan"), vs_one_after_another=float("nan"),
                     cpu_s=least_cpu[name], tokens_per_cpu_s=r["tokens"] / least_cpu[name], runs=runs)
            results.append(r)
            print(json.dumps(r), flush=True)
    use_case(engine, None, None, by_cost)
    return results


def tiny_prompts(engine: Engine, n: int) -> list[list[int]]:
    """Plain-text openings of unseen documents: they run on to max_new_tokens (a chat answer stops
    after a few tokens), so every request does the same amount of work."""
    from ddtree_devtools.tiny_corpus import documents

    plain = [h[: len(h) // 2] for h, _ in documents(2000, seed=99) if not h.startswith("<|")]
    ids = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in plain]
    return [p for p in ids if len(p) >= 8][:n]


def model_arguments(ap: argparse.ArgumentParser) -> None:
    """Where the models come from (tiny checkpoints, or random weights of a shape) and how they run."""
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--models", help="a tiny-models directory (target/, draft/)")
    src.add_argument("--shape", help="a gpu_bench shape, random weights (qwen3-8b, qwen3.6-27b, small, ...)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on CUDA")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(ap)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--round-nodes", type=int, default=128, help="the adaptive case's nodes per round")
    ap.add_argument("--context", type=int, default=512, help="--shape: prompt tokens per request")
    ap.add_argument("--max-new", type=int, default=64, help="--models: tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="--models: runs per measurement, the fastest kept")
    ap.add_argument("--least-seconds", type=float, default=0.0,
                    help="--models --interleave: more repeats while a case has run less than this in all")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--interleave", action="store_true",
                    help="--models: the cases take turns at each batch size (a shared machine's drift)")
    ap.add_argument("--check", action="store_true", help="only check batched greedy == alone, then exit")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU: torch threads (one: on a shared machine two contend and the figures swing)")
    ap.add_argument("--serial-prefill", action="store_true", help="one prefill pass a prompt (for comparison)")
    ap.add_argument("--event-phases", action="store_true",
                    help="--shape: time the phases by CUDA events, no sync (gpu_bench.EventPhases: a phase's "
                         "device time, host time and the gap between rounds) rather than a sync at each boundary")
    ap.add_argument("--draft-vocab", default=None, metavar="N|FILE",
                    help="the drafter's vocabulary (ddtree-serve --draft-vocab); default: the target's whole")
    ap.add_argument("--draft-layout", choices=["full", "zlab"], default="full",
                    help="--shape: the drafter's layers all full (the series' stand-in), or laid out as z-lab's "
                         "Qwen3.6 drafters (every layer sliding but the last: drafter_layout_bench.py)")
    ap.add_argument("--window", type=int, default=4096, help="--draft-layout zlab: the sliding layers' window")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="bench/results/runtime-batch-bench.json")
    args = ap.parse_args()
    if args.serial_prefill:  # no prompt shares a pass: what the engine did before grouped prefill
        Engine._groupable = lambda self, req, take: False
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    batches = [int(b) for b in args.batches.split(",")]
    named = args.cases.split(",") if args.cases else []
    chosen = [c for c in cases(args.round_nodes, named) if not named or c[0] in named]
    # the policy by cost only where a case runs it: its warm-up sweep times every (batch, tree) shape
    # (~50 s of a 27B call's ~72 s warm-up), which cases of fixed budgets never read
    policy = "cost" if any(c[0] in ("cost", HELD) for c in chosen) else "fixed"

    if args.models:
        models = Path(args.models).expanduser()
        engine = Engine(EngineConfig(str(models / "target"), str(models / "draft"), device=args.device, dtype=dtype,
                                     max_running=max(batches), max_batched_tokens=4096,
                                     tree_policy=policy, draft_vocab=args.draft_vocab))
        prompts = tiny_prompts(engine, max(batches))
    else:
        import sys
        sys.path.insert(0, str(Path(__file__).parent))
        from drafter_layout_bench import layout
        from gpu_bench import EventPhases, PhaseTimer, build_models

        target, drafter = build_models(args.shape, device, getattr(torch, dtype))
        drafter.config.attention = layout(args.draft_layout, drafter.config.num_hidden_layers, args.window)
        max_new = steady_tokens(args.rounds, args.warmup)
        engine = Engine(EngineConfig(f"random-{args.shape}", None, tree_budget=16, device=args.device, dtype=dtype,
                                     max_context=args.context + max_new + 64, max_running=max(batches),
                                     max_batched_tokens=args.context * max(batches), tree_policy=policy,
                                     draft_vocab=args.draft_vocab),
                        target=target, drafter=drafter)
        g = torch.Generator().manual_seed(1)
        vocab = target.config.vocab_size
        prompts = [torch.randint(0, vocab - 1, (args.context,), generator=g).tolist() for _ in range(max(batches))]
    warm = engine.warm_up()
    # as the server's worker does once warm (_freeze_startup_heap): a full collection walking this heap
    # takes ~0.2 s on this CPU (340,000 objects with the tiny pair), and one landing in a timed window is
    # a round the server would not have (session 30's 400-round window had a ~100 ms probe round: maybe one)
    gc.collect()
    gc.freeze()
    costs = engine.policy.costs.snapshot().table()
    print(f"warm-up {warm.seconds:.1f} s; round costs (ms) by batch x tree nodes: "
          + ", ".join(f"{r['batch']}x{r['tree_nodes']} {r['ms']:.2f}" for r in costs), flush=True)
    print(f"device {torch.cuda.get_device_name(0) if device.type == 'cuda' else platform.processor() or 'cpu'}; "
          f"{engine.slots} slots; {args.models or args.shape}", flush=True)

    if args.check:
        print("check:", json.dumps(check_batched_equals_alone(engine, prompts[:8], 48)), flush=True)
        return
    results = []
    by_cost = engine.policy.by_cost
    if args.models and args.interleave:
        results = interleaved(engine, chosen, prompts, batches, args)
        chosen = []
    for name, mode, budget, round_nodes in chosen:
        use_case(engine, name, round_nodes, by_cost)
        params = SamplingParams(max_new_tokens=args.max_new, mode=mode, tree_budget=budget)
        if args.models:
            serve_all(engine, prompts[:max(batches)], params)  # warm-up
            alone = [min(serve_all(engine, [p], params)["wall_s"] for _ in range(args.repeats))
                     for p in prompts[:max(batches)]]
        for b in batches:
            if args.models:  # the fastest of the repeats: this CPU is shared, noise only adds time
                r = min((serve_all(engine, prompts[:b], params) for _ in range(args.repeats)),
                        key=lambda x: x["wall_s"])
                r["vs_one_alone"] = r["wall_s"] / statistics.fmean(alone[:b])
                r["vs_one_after_another"] = r["wall_s"] / sum(alone[:b])
            else:
                params = SamplingParams(max_new_tokens=steady_tokens(args.rounds, args.warmup), mode=mode,
                                        tree_budget=budget)
                timer = EventPhases(device) if args.event_phases else PhaseTimer(device)
                r = steady_rounds(engine, prompts[:b], params, args.rounds, args.warmup, timer)
            r.update(case=name, batch=b)
            results.append(r)
            print(json.dumps(r), flush=True)
    use_case(engine, None, None, by_cost)

    print()
    if args.models:
        print(f"{'case':<14}{'B':>4}{'wall s':>9}{'tok/s':>9}{'tok/cpu s':>10}{'x alone':>9}{'x serial':>9}{'tau':>6}"
              f"{'nodes':>7}{'ttft s':>8}")
        for r in results:
            print(f"{r['case']:<14}{r['batch']:>4}{r['wall_s']:>9.2f}{r['tokens_per_s']:>9.0f}"
                  f"{r['tokens_per_cpu_s']:>10.0f}{r['vs_one_alone']:>9.2f}{r['vs_one_after_another']:>9.2f}{r['mean_acceptance_length']:>6.2f}"
                  f"{r['mean_round_tree_nodes']:>7.0f}{r['mean_ttft_s']:>8.2f}")
    else:
        phases = ("step", "tree", "verify", "commit", "draft")
        print(f"{'case':<14}{'B':>4}{'round ms':>10}{'xB=1':>7}{'nodes':>7}{'admit ms':>10}"
              + "".join(f"{'tok/s@' + str(t):>11}" for t in TAUS) + "".join(f"{p:>8}" for p in phases))
        for r in results:
            one = next((x for x in results if x["case"] == r["case"] and x["batch"] == 1), None)  # None: B=1 not run
            ratio = f"{r['round_ms'] / one['round_ms']:>7.2f}" if one else f"{'-':>7}"
            print(f"{r['case']:<14}{r['batch']:>4}{r['round_ms']:>10.2f}{ratio}"
                  f"{r['round_tree_nodes']:>7}{r['admit_ms']:>10.1f}"
                  + "".join(f"{r['tokens_per_s_at_tau'][t]:>11.0f}" for t in TAUS)
                  + "".join(f"{r['phases_ms'].get(p, 0):>8.2f}" for p in phases))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"label": args.label, "source": args.models or args.shape, "device": str(device),
                               "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
                               "dtype": dtype, "torch": torch.__version__, "slots": engine.slots,
                               "context": None if args.models else args.context, "round_costs": costs,
                               "draft_vocab": engine.info.draft_vocab,
                               "draft_layout": None if args.models else {"name": args.draft_layout,
                                                                         "window": args.window},
                               # what the rounds taught the cost model by the end (each row at 64 tokens)
                               "round_costs_after": engine.policy.costs.snapshot().table(),
                               "context_term": {"a": engine.policy.costs.a, "c": engine.policy.costs.c},
                               "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Closed-loop load in one process: where a short completion's time goes, without HTTP.

    PYTHONPATH=runtime:runtime/bench python runtime/bench/service_bench.py --models fixtures/tiny-models-seed0 \
        [--clients 16] [--max-tokens 128] [--requests 64] [--paths engine,worker] [--phases] [--out F]
    PYTHONPATH=runtime:runtime/bench python runtime/bench/service_bench.py --shape qwen3-8b ...   # random weights

N clients each submit a new request as soon as their last one finishes, `--requests` in all, after a
warm-up of one request a client (the shapes the load reaches capture their CUDA graphs there). Every
request is a short prompt (`--prompt-tokens`) and exactly `--max-tokens` tokens (the end token ignored).
Paths, from the engine outward:

- steady: N requests admitted together, then rounds timed back to back (batch_bench.steady_rounds):
  the engine's rate at N running, what the others are measured against;
- engine: the clients are the stepping loop itself (a finished request's successor is submitted before
  the next step): what admission, prefill and the batch's changes cost the engine alone;
- worker: through the server's EngineWorker, clients as coroutines on an event loop as the HTTP routes
  are (no HTTP, no tokenization): what the bridge between threads adds.

load_bench.py is the same load through HTTP; the three together place a loss in the engine, the
bridge or the HTTP side. Each path reports tokens/s and its share of steady's, and a request's mean
time in each stage (server/timeline.py's intervals: queue, prefill step, the step to its first round,
the rest of its rounds), and the steps: how many, how many admitted someone, and their mean time with
and without an admission. tok/s is over the part of the run in which every client has a request in
(`Window`); run tok/s over the whole run. `--phases` runs the engine path again with a synchronizing phase hook and
adds the time of each phase (prefill, draft, tree, verify, commit) per request. Not a test."""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from batch_bench import model_arguments, steady_rounds, sync
from gpu_bench import PhaseTimer
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.server.config import ServerConfig
from ddtree_runtime.server.metrics import Metrics
from ddtree_runtime.server.timeline import INTERVALS, Timeline
from ddtree_runtime.server.worker import DoneEvent, EngineWorker, ErrorEvent, Job, RoundEvent


class Steps:
    """Each step's seconds, and whether it admitted a request."""

    def __init__(self) -> None:
        self.plain: list[float] = []
        self.admitting: list[float] = []

    def add(self, seconds: float, admitted: int) -> None:
        (self.admitting if admitted else self.plain).append(seconds)

    def report(self, requests: int) -> dict:
        mean = lambda xs: 1e3 * statistics.fmean(xs) if xs else 0.0  # noqa: E731
        return {"steps": len(self.plain) + len(self.admitting), "admitting_steps": len(self.admitting),
                "admitting_steps_per_request": len(self.admitting) / requests,
                "step_ms": mean(self.plain), "admitting_step_ms": mean(self.admitting)}


def stage_means_ms(timelines: list[Timeline]) -> dict[str, float]:
    """A request's mean milliseconds in each stage it reached."""
    by_stage: dict[str, list[float]] = defaultdict(list)
    for t in timelines:
        for name, seconds in t.intervals().items():
            by_stage[name].append(seconds)
    return {name: 1e3 * statistics.fmean(by_stage[name]) for name, _, _ in INTERVALS if by_stage[name]}


class Window:
    """Tokens over the part of a run in which every client has a request in: from the first request's
    end (the burst that started the run is over) to the last request's submission (the run winds down
    after it). The whole run's rate would count that start and end, which a server under steady load
    does not have."""

    def __init__(self) -> None:
        self.tokens = 0
        self.start: tuple[float, int] | None = None
        self.end: tuple[float, int] | None = None

    def finished_one(self, now: float) -> None:
        if self.start is None:
            self.start = (now, self.tokens)

    def sent_last(self, now: float) -> None:
        self.end = (now, self.tokens)

    def tokens_per_s(self) -> float:
        if self.start is None or self.end is None or self.end[0] <= self.start[0]:
            return 0.0
        return (self.end[1] - self.start[1]) / (self.end[0] - self.start[0])


def summarize(path: str, timelines: list[Timeline], window: Window, wall: float, steady_tps: float) -> dict:
    rounds = statistics.fmean(t.rounds for t in timelines)
    latency = statistics.fmean(t.finished - t.arrived for t in timelines)
    rate = window.tokens_per_s()
    return {"path": path, "requests": len(timelines), "tokens": window.tokens, "wall_s": wall,
            "run_tokens_per_s": window.tokens / wall, "tokens_per_s": rate, "of_steady": rate / steady_tps,
            "latency_ms": 1e3 * latency, "rounds_per_request": rounds, "stages_ms": stage_means_ms(timelines)}


def closed_loop_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams, clients: int,
                       requests: int) -> tuple[list[Timeline], Window, float, Steps]:
    """The clients are the stepping loop: each finished request's successor is submitted before the
    next step, as a server whose clients answer at once would see it."""
    timelines: dict[int, Timeline] = {}
    outputs: dict[int, int] = {}
    done: list[Timeline] = []
    steps, window, sent = Steps(), Window(), 0

    def send() -> None:
        nonlocal sent
        now = Timeline.now()
        rid = engine.submit(prompts[sent % len(prompts)], params)
        timelines[rid] = Timeline(arrived=now, handed=now, submitted=now)
        outputs[rid] = 0
        sent += 1
        if sent == requests:
            window.sent_last(now)

    sync(engine.device)
    started = time.perf_counter()
    for _ in range(min(clients, requests)):
        send()
    while engine.has_work:
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        admitted = 0
        for rid, t in timelines.items():
            if t.admitted is None and not engine.queued(rid):
                t.admitted, admitted = t0, admitted + 1
        steps.add(t1 - t0, admitted)
        for rid, out in outs:
            t = timelines[rid]
            window.tokens += len(out.token_ids)
            if outputs[rid] == 0:
                t.first_token = t1
            else:
                t.rounds += 1
                if outputs[rid] == 1:
                    t.first_round = t1
            outputs[rid] += 1
            if out.finished:
                t.finished = t1
                done.append(timelines.pop(rid))
                window.finished_one(t1)
                if sent < requests:
                    send()
    sync(engine.device)
    return done, window, time.perf_counter() - started, steps


class _ReadyWorker(EngineWorker):
    """The server's worker over an engine already loaded and warmed up here (random weights have no
    tokenizer for the worker's own warm-up)."""

    def __init__(self, engine: Engine, max_running: int) -> None:
        super().__init__(ServerConfig(target_dir="bench", max_running=max_running), Metrics(),
                         engine_factory=lambda _config: engine)

    def _load(self) -> None:
        self.engine = self._engine_factory(self.config)


def closed_loop_worker(engine: Engine, prompts: list[list[int]], params: SamplingParams, clients: int,
                       requests: int) -> tuple[list[Timeline], Window, float]:
    """The clients are coroutines on an event loop, as the HTTP routes are: a Job through the
    worker's hand-off, its events back through the loop."""
    worker = _ReadyWorker(engine, clients)
    worker.start()
    while worker.health()[0] != "ready":
        time.sleep(0.01)
    done: list[Timeline] = []
    window, sent = Window(), [0]

    async def client() -> None:
        loop = asyncio.get_running_loop()
        while sent[0] < requests:
            job = Job(prompt_ids=prompts[sent[0] % len(prompts)], params=params, loop=loop)
            sent[0] += 1
            worker.submit(job)
            if sent[0] == requests:
                window.sent_last(time.perf_counter())
            while True:
                event = await job.events.get()
                if isinstance(event, ErrorEvent):
                    raise RuntimeError(event.message)
                if isinstance(event, RoundEvent):
                    window.tokens += len(event.output.token_ids)
                if isinstance(event, DoneEvent) or (isinstance(event, RoundEvent) and event.output.finished):
                    break
            while job.timeline.finished is None:  # the worker stamps it just before the last event
                await asyncio.sleep(0)
            done.append(job.timeline)
            window.finished_one(time.perf_counter())

    async def run_clients() -> None:
        await asyncio.gather(*(client() for _ in range(clients)))

    try:
        started = time.perf_counter()
        asyncio.run(run_clients())
        wall = time.perf_counter() - started
    finally:
        worker.stop()
    return done, window, wall


def build_engine(args) -> tuple[Engine, list[list[int]]]:
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if args.models:
        models = Path(args.models).expanduser()
        engine = Engine(EngineConfig(str(models / "target"), str(models / "draft"), device=args.device, dtype=dtype,
                                     max_running=args.clients, tree_budget=args.tree_budget))
        vocab = engine.target.config.vocab_size
    else:
        from gpu_bench import build_models

        target, drafter = build_models(args.shape, device, getattr(torch, dtype))
        engine = Engine(EngineConfig(f"random-{args.shape}", None, tree_budget=args.tree_budget, device=args.device,
                                     dtype=dtype, max_context=args.context, max_running=args.clients),
                        target=target, drafter=drafter)
        vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab - 1, (args.prompt_tokens,), generator=g).tolist() for _ in range(64)]
    return engine, prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(ap)
    ap.add_argument("--clients", type=int, default=16, help="closed-loop clients (and the engine's max_running)")
    ap.add_argument("--requests", type=int, default=64, help="requests per path")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=12, help="load_bench's counting prompts are about 12")
    ap.add_argument("--tree-budget", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096, help="--shape: the engine's max_context")
    ap.add_argument("--paths", default="engine,worker")
    ap.add_argument("--phases", action="store_true", help="also the engine path with a synchronizing phase hook")
    ap.add_argument("--threads", type=int, default=1, help="CPU: torch threads")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="bench/results/runtime-service-bench.json")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    engine, prompts = build_engine(args)
    params = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)
    print(f"device {torch.cuda.get_device_name(0) if engine.device.type == 'cuda' else platform.processor() or 'cpu'}; "
          f"{engine.slots} slots; {args.models or args.shape}; {args.clients} clients x {args.max_tokens} tokens",
          flush=True)

    closed_loop_engine(engine, prompts, params, args.clients, args.clients)  # warm-up: graphs, allocator
    long_params = SamplingParams(max_new_tokens=args.max_tokens * 4, ignore_eos=True)
    steady = steady_rounds(engine, prompts[:args.clients], long_params, rounds=args.max_tokens // 2, warmup=4)
    report = {"steady": {"tokens_per_s": steady["tokens_per_s"], "round_ms": steady["round_ms"],
                         "batch_size": steady["batch_size"]}}
    print(json.dumps(report["steady"]), flush=True)
    results = []
    for path in args.paths.split(","):
        if path == "engine":
            timelines, window, wall, steps = closed_loop_engine(engine, prompts, params, args.clients, args.requests)
            r = {**summarize(path, timelines, window, wall, steady["tokens_per_s"]), **steps.report(args.requests)}
        elif path == "worker":
            timelines, window, wall = closed_loop_worker(engine, prompts, params, args.clients, args.requests)
            r = summarize(path, timelines, window, wall, steady["tokens_per_s"])
        else:
            sys.exit(f"unknown path {path!r} (engine, worker)")
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.phases:
        timer = PhaseTimer(engine.device)  # each step's phases (a step ends with "end")
        engine.phase_hook = timer
        try:
            _, _, wall, _ = closed_loop_engine(engine, prompts, params, args.clients, args.requests)
        finally:
            engine.phase_hook = None
        report["phases_ms_per_request"] = {k: 1e3 * sum(v) / args.requests for k, v in timer.acc.items()}
        report["phases_wall_s"] = wall
        print(json.dumps({"phases_ms_per_request": report["phases_ms_per_request"]}), flush=True)

    print(f"\nsteady at {args.clients} running: {steady['tokens_per_s']:.0f} tok/s, round {steady['round_ms']:.2f} ms")
    stages = [name for name, _, _ in INTERVALS]
    print(f"{'path':<8}{'tok/s':>8}{'x steady':>9}{'run tok/s':>10}{'lat ms':>9}{'rounds':>8}"
          + "".join(f"{s:>10}" for s in stages))
    for r in results:
        print(f"{r['path']:<8}{r['tokens_per_s']:>8.0f}{r['of_steady']:>9.3f}{r['run_tokens_per_s']:>10.0f}"
              f"{r['latency_ms']:>9.1f}"
              f"{r['rounds_per_request']:>8.1f}" + "".join(f"{r['stages_ms'].get(s, 0):>10.1f}" for s in stages))
    for r in results:
        if "steps" in r:
            print(f"engine steps: {r['steps']}, {r['admitting_steps']} admitting "
                  f"({r['admitting_steps_per_request']:.2f} a request); step {r['step_ms']:.2f} ms, admitting step {r['admitting_step_ms']:.2f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"label": args.label, "source": args.models or args.shape, "device": str(engine.device),
                               "clients": args.clients, "max_tokens": args.max_tokens,
                               "prompt_tokens": args.prompt_tokens, **report, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

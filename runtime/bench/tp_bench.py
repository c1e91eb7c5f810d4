"""Tensor parallelism against one device, in the same run: random weights of a real shape
(gpu_bench.build_models), TP=1 first, then TP=N over N ranks (this process is rank 0, it starts the others).

    PYTHONPATH=runtime python runtime/bench/tp_bench.py --shape qwen3.6-27b --tp 2 [--out F]
    PYTHONPATH=runtime python runtime/bench/tp_bench.py --shape hybrid-small --device cpu --dtype float32  # gloo

Figures, each TP=N over TP=1 (issue 27's targets in brackets): the AR step (<= 0.58x), a ddtree@16 round
of one stream (<= 0.6x), a ddtree@16 round with 16 running (<= 0.65x), and start to ready (<= 1.3x): the
models built, the engine sized (and its graphs captured), and a 4-token warm-up generation, as the
server's start does; at TP=N it counts from starting the other ranks (their Python and torch imports
and the rendezvous included). Random weights have no checkpoint to read, so a real start's load time
is not in it. Not a test: figures depend on the machine. It also checks that the split is exact: greedy
tokens of ar, dflash and ddtree at TP=N equal TP=1's on the shape's 4-layer float32 version, the same
weights at both sizes (each rank builds the whole model from one seed and keeps its shard)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from batch_bench import steady_rounds
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine.distributed import Leader, follow, join
from ddtree_runtime.model.parallel import shard_state
from ddtree_runtime.server.ranks import end_process
from gpu_bench import SHAPES, build_models, run_case, sync

RANK_ENV, PORT_ENV = "TP_BENCH_RANK", "TP_BENCH_PORT"
TARGETS = {"ar_step_ms": 0.58, "ddtree16_round_ms": 0.6, "round_16_running_ms": 0.65, "start_to_ready_s": 1.3}
RUNNING = 16


def engine_config(args, world: int) -> EngineConfig:
    return EngineConfig(f"random-{args.shape}", None, mode="ddtree", tree_budget=16, device=args.device,
                        dtype=args.dtype, max_running=RUNNING, max_context=args.context + 4 * 17 * (args.rounds + 8),
                        tensor_parallel=world)


def start(args, world: int, rank: int = 0, port: int | None = None):
    """Build this rank's models and engine, joined to the others when world > 1; rank 0's is the Leader."""
    config = engine_config(args, world)
    tp = None
    if world > 1:
        tp, config = join(config, rank, port)
    target, drafter = build_models(args.shape, torch.device(config.device), getattr(torch, args.dtype), tp)
    engine = Engine(config, target=target, drafter=drafter)
    if tp is None or rank > 0:
        return engine, tp
    return Leader(engine, tp, on_lost=lambda why: sys.exit(f"tp_bench: {why}")), tp


def check_shape(shape: str) -> str:
    """The float32 agreement check's shape: the real width with 4 layers (gpu_bench's), or a small shape."""
    if shape.startswith("qwen3.6-27b"):
        return "qwen3.6-27b-4layer"
    return "qwen3-8b-4layer" if shape.startswith("qwen3-8b") else shape


def greedy(engine, vocab: int) -> dict[str, list[int]]:
    """Greedy tokens per mode from one random prompt."""
    prompt = torch.randint(0, vocab - 1, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    return {f"{mode}@{budget}" if budget else mode:
            [t for r in engine.generate(prompt, SamplingParams(max_new_tokens=48, mode=mode, tree_budget=budget))
             for t in r.token_ids]
            for mode, budget in (("ar", None), ("dflash", None), ("ddtree", 16))}


def same_weights_engine(args, world: int, tp=None) -> Engine:
    """A float32 engine of check_shape whose target is the same model at every TP size: every rank builds
    the whole model from the same seed and keeps its shard of it (model/parallel.shard_state)."""
    shape, device = check_shape(args.shape), torch.device(f"cuda:{tp.rank}" if tp and args.device.startswith("cuda")
                                                           else args.device)
    target, drafter = build_models(shape, device, torch.float32)
    if tp is not None:
        state = shard_state(target.state_dict(), target.config, tp)
        target, _ = build_models(shape, device, torch.float32, tp)
        target.load_state_dict(state)
    config = dataclasses.replace(engine_config(args, world), dtype="float32", max_running=1, max_context=1024,
                                 device=str(device))
    return Engine(config, target=target, drafter=drafter)


def measure(engine, args) -> dict:
    """The figures of one engine (its start is timed by the caller)."""
    g = torch.Generator().manual_seed(1)
    vocab = engine.target.config.vocab_size
    prompt = torch.randint(0, vocab - 1, (args.context,), generator=g).tolist()
    run_case(engine, prompt[:64], "ddtree", 16, 2, 1)  # every kernel shape once
    ar = run_case(engine, prompt, "ar", None, args.rounds, args.warmup)
    tree = run_case(engine, prompt, "ddtree", 16, args.rounds, args.warmup)
    prompts = [torch.randint(0, vocab - 1, (args.context,), generator=g).tolist() for _ in range(RUNNING)]
    params = SamplingParams(max_new_tokens=4 * 17 * (args.rounds + args.warmup), mode="ddtree", tree_budget=16,
                            ignore_eos=True)
    batch = steady_rounds(engine, prompts, params, args.rounds, args.warmup)
    return {"ar_step_ms": ar["round_ms"], "ddtree16_round_ms": tree["round_ms"],
            "round_16_running_ms": batch["round_ms"], "batch_size": batch["batch_size"],
            "prefill_ms": ar["prefill_ms"]}


def timed_start(args, world: int, port: int | None = None) -> tuple[object, float, list[subprocess.Popen]]:
    """Rank 0's engine, the seconds from nothing to its warm-up generation done, and the other ranks."""
    t0 = time.perf_counter()
    others = []
    if world > 1:
        env = {**os.environ, PORT_ENV: str(port)}
        others = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env={**env, RANK_ENV: str(r)})
                  for r in range(1, world)]
    engine, _ = start(args, world, 0, port)
    list(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4)))
    sync(engine.device)
    return engine, time.perf_counter() - t0, others


def release() -> None:
    """Give a dropped engine's device memory back before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.6-27b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--label", default="", help="free text stored with the results (the version)")
    ap.add_argument("--out", default="bench/results/runtime-tp-bench.json")
    args = ap.parse_args()
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off in every rank (the GPU hosts require it)
    rank = int(os.environ.get(RANK_ENV, "0"))
    if rank > 0:  # a rank rank 0 started: follow its calls until it closes, for each of rank 0's engines
        engine, tp = start(args, args.tp, rank, int(os.environ[PORT_ENV]))
        follow(engine, tp)
        del engine
        release()
        follow(same_weights_engine(args, args.tp, tp), tp)
        end_process(0)  # not through the interpreter's exit, which aborts a rank (server/ranks.py)

    results = {}
    alone = same_weights_engine(args, 1)
    expected = greedy(alone, alone.target.config.vocab_size)
    del alone
    engine, start_s, _ = timed_start(args, 1)
    results[1] = {"start_to_ready_s": start_s, **measure(engine, args)}
    print(f"TP=1: {results[1]}", flush=True)
    del engine
    release()
    engine, start_s, others = timed_start(args, args.tp, free_port())
    results[args.tp] = {"start_to_ready_s": start_s, **measure(engine, args)}
    print(f"TP={args.tp}: {results[args.tp]}", flush=True)
    engine.close()
    tp, on_lost = engine.tp, engine.on_lost
    del engine
    release()
    split = Leader(same_weights_engine(args, args.tp, tp), tp, on_lost)
    got = greedy(split, split.target.config.vocab_size)
    split.close()
    agreement = {mode: got[mode] == tokens for mode, tokens in expected.items()}
    print(f"greedy tokens at TP={args.tp} equal TP=1's ({check_shape(args.shape)}, float32, same weights): "
          f"{agreement}", flush=True)
    codes = [p.wait(60) for p in others]

    print(f"\n{'figure':<22}{'TP=1':>10}{f'TP={args.tp}':>10}{'ratio':>8}{'target':>8}")
    ratios = {}
    for name, target in TARGETS.items():
        one, many = results[1][name], results[args.tp][name]
        ratios[name] = many / one
        print(f"{name:<22}{one:>10.2f}{many:>10.2f}{ratios[name]:>8.2f}{'<= ' + str(target):>8}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "label": args.label, "shape": args.shape, "dtype": args.dtype, "device": args.device, "tp": args.tp,
        "gpus": [torch.cuda.get_device_name(i) for i in range(args.tp)] if args.device.startswith("cuda") else None,
        "torch": torch.__version__, "context": args.context, "rounds": args.rounds, "results": results,
        "ratios": ratios, "targets": TARGETS, "greedy_equal_to_tp1": agreement, "followers_exit": codes},
        indent=2))
    print(f"wrote {out}")
    end_process(0)


if __name__ == "__main__":
    main()

"""Host time of the verify graph's replay() (its cudaGraphLaunch) against the graph's device time, on random
weights of a real shape: whether launching the biggest graph keeps the device waiting. Session 27 (27B,
ddtree@16 at 1K, H100): 7 us at one row and 77 us at 16, against 21.2 and 31.6 ms on the device, so no.

    PYTHONPATH=runtime:runtime/bench python runtime/bench/replay_time.py [--shape qwen3.6-27b] [--out F]"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_bench import build_models

CONTEXT = 1024
REPEATS = 10


def replay_times(engine: Engine) -> dict[str, dict[str, float]]:
    """Each captured tree-verify graph of the engine replayed alone on an idle device: the host's time in
    replay() and the device's time for the graph (medians, ms)."""
    times = {}
    for key, bucket in engine.runner.target_runner.buckets.items():
        if bucket.graph is None or key[1] == 1:   # not captured, or an AR step's
            continue
        host, device = [], []
        for _ in range(REPEATS):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            bucket.graph.replay()
            host.append(1e3 * (time.perf_counter() - t0))
            end.record()
            torch.cuda.synchronize()
            device.append(start.elapsed_time(end))
        times[str(key)] = {"replay_host_ms": statistics.median(host), "device_ms": statistics.median(device)}
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.6-27b")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--out", default="bench/results/runtime-verify-replay-time.json")
    args = ap.parse_args()
    target, drafter = build_models(args.shape, torch.device("cuda"), torch.bfloat16)
    results = {}
    for batch in map(int, args.batches.split(",")):
        engine = Engine(EngineConfig(f"random-{args.shape}", None, tree_budget=16, device="cuda", dtype="bfloat16",
                                     max_context=CONTEXT + 512, max_running=batch), target=target, drafter=drafter)
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(max_new_tokens=400, tree_budget=16, ignore_eos=True)
        for _ in range(batch):
            engine.submit(torch.randint(0, 1000, (CONTEXT,), generator=g).tolist(), params)
        while engine.scheduler.waiting or engine.scheduler.prefilling is not None:
            engine.step()
        for _ in range(6):   # rounds: the batch's verify graph captured
            engine.step()
        results[batch] = replay_times(engine)
        for key, t in results[batch].items():
            print(f"{batch} running, bucket {key}: replay() {t['replay_host_ms']:.3f} ms on the host, "
                  f"the graph {t['device_ms']:.3f} ms on the device", flush=True)
        del engine
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "shape": args.shape,
                                          "context": CONTEXT, "results": results}, indent=2))


if __name__ == "__main__":
    main()

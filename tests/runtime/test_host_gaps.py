"""host_gaps.py finds the device's idle stretches between its kernels and puts each under the engine
frames the host was running then, from a real profiler trace of the engine's Python frames."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime" / "bench"))

import host_gaps  # noqa: E402
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams  # noqa: E402


def test_idle_stretches_lie_between_merged_busy_spans():
    busy = host_gaps.merged([(10, 20), (0, 5), (15, 30), (31, 40), (60, 70)])
    assert busy == [(0, 5), (10, 30), (31, 40), (60, 70)]
    # 1 us between 30 and 31 is a launch's latency, not the host
    assert host_gaps.idle_gaps(busy, least_us=2) == [(5, 10), (40, 60)]
    events = [{"cat": "kernel", "ts": a, "dur": b - a} for a, b in [(0, 5), (10, 30), (31, 40), (60, 70)]]
    idle = host_gaps.device_idle(host_gaps.device_busy(events + [{"cat": "cpu_op", "ts": 40, "dur": 20}]), reps=2)
    assert idle == {"busy_us": 22.0, "idle_us": 13.0, "gaps": 1.0, "idle_in_gaps_us": 12.5}


def test_idle_time_goes_to_every_engine_frame_running_through_it_and_waits_to_the_innermost():
    # step (0-100) calls schedule (0-30) and run (30-100); run calls a torch frame (40-90)
    frames = host_gaps.Frames([(0, 100, "ddtree_runtime/engine.py(1): step", None, 1),
                               (0, 30, "ddtree_runtime/scheduler.py(5): schedule", 1, 2),
                               (30, 100, "ddtree_runtime/runner.py(9): run", 1, 3),
                               (40, 90, "torch/nn/module.py(7): __call__", 3, 4),
                               (120, 130, "bench.py(3): loop", None, 5)])
    idle = host_gaps.attribute([(10, 20), (50, 70), (121, 123)], frames, lambda n: "ddtree_runtime" in n,
                               sample_us=5)
    assert idle == {"ddtree_runtime/engine.py(1): step": 30.0, "ddtree_runtime/runner.py(9): run": 20.0,
                    "ddtree_runtime/scheduler.py(5): schedule": 10.0, "(none)": 2.0}
    # the host's waits: a synchronising call under run (its innermost engine frame), a launch is not one
    events = [{"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 60, "dur": 8},
              {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 70, "dur": 4},
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 50, "dur": 3},
              {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 122, "dur": 1}]
    assert host_gaps.host_waits(events, frames, reps=2) == {
        "cudaStreamSynchronize at ddtree_runtime/runner.py(9): run": {"count": 1.0, "us": 6.0},
        "cudaMemcpyAsync at (none)": {"count": 0.5, "us": 0.5}}


def test_a_real_traces_frames_name_the_engine_code_a_moment_ran_in(tiny_models, tmp_path):
    engine = Engine(EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft"), device="cpu",
                                 dtype="float32"))
    engine.submit(list(range(5, 40)), SamplingParams(max_new_tokens=16, mode="ddtree"))
    engine.step()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        engine.step()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    frames = host_gaps.python_frames(events)
    chains = [[name for name in frames.chain(frames.innermost(e["ts"] + e["dur"] / 2))
               if host_gaps.ENGINE_FRAME in name]
              for e in events if e.get("cat") == "cpu_op" and e["name"] == "aten::argmax"]
    assert chains and all(chain[-1].endswith(": step") for chain in chains)
    assert any(name.endswith(": _verify") for chain in chains for name in chain)

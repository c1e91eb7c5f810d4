"""Where the GPU waits for the host inside engine steps, and which engine code the host ran meanwhile.

    PYTHONPATH=runtime python runtime/bench/gpu_profile.py --shape qwen3.6-27b --context 8192 --batch 1 --gaps

A lone 27B round took 18.58 ms for 18.04 ms of GPU work (issue 39): the rest is the device idle while
the host reads a round and prepares the next. Two profiles of the same steps tell it: the device's
kernels alone (the idle time per step, true), then the kernels with the Python stack, whose tracing
slows the host (~2x), so its gaps are longer than the true ones: that one says where they fall, as
engine frames (inclusive: a frame counts the idle time of every call under it), and which engine code
waits on the device (a synchronising call or copy beyond the round's one read)."""

from __future__ import annotations

import bisect
import json
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace's categories of device work
ENGINE_FRAME = "ddtree_runtime"                        # the frames idle time is reported under
LEAST_GAP_US = 2.0     # shorter gaps are launch latency between back-to-back kernels, not the host
SAMPLE_US = 5.0        # an idle stretch is sampled this often (a shorter one once, at its middle)


def merged(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping (start, end) spans joined, in order."""
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def idle_gaps(busy: list[tuple[float, float]], least_us: float = LEAST_GAP_US) -> list[tuple[float, float]]:
    """The stretches between merged busy spans longer than `least_us`."""
    return [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] > least_us]


class Frames:
    """A thread's Python frames from a profiler trace (start, end, name, parent), found by time."""

    def __init__(self, frames: list[tuple[float, float, str, int | None, int]]) -> None:
        """frames: (start us, end us, name, parent's id or None, own id)."""
        ordered = sorted(frames, key=lambda f: (f[0], -f[1]))  # a caller before the callee starting with it
        self.starts = [f[0] for f in ordered]
        self.frames = ordered
        self.by_id = {f[4]: f for f in ordered}

    def innermost(self, t: float) -> tuple[float, float, str, int | None, int] | None:
        """The frame running at `t` deepest in the stack: of those holding t, the last to start (the
        frames of one thread nest)."""
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0:
            frame = self.frames[i]
            if frame[1] >= t:
                return frame
            i -= 1
        return None

    def chain(self, frame) -> list[str]:
        """`frame` and its callers' names, innermost first."""
        names = []
        while frame is not None:
            names.append(frame[2])
            frame = self.by_id.get(frame[3]) if frame[3] is not None else None
        return names


def attribute(gaps: list[tuple[float, float]], frames: Frames, keep: Callable[[str], bool],
              sample_us: float = SAMPLE_US) -> dict[str, float]:
    """Idle microseconds under each kept frame (inclusive), from samples `sample_us` apart over each gap;
    "(none)" where no kept frame was running (the benchmark's own loop)."""
    idle: dict[str, float] = defaultdict(float)
    for start, end in gaps:
        width = end - start
        samples = max(1, int(width // sample_us))
        weight = width / samples
        for k in range(samples):
            t = start + (k + 0.5) * weight
            frame = frames.innermost(t)
            names = {n for n in (frames.chain(frame) if frame else []) if keep(n)}
            for name in names or {"(none)"}:
                idle[name] += weight
    return dict(sorted(idle.items(), key=lambda kv: -kv[1]))


def device_busy(prof_events: list[dict]) -> list[tuple[float, float]]:
    """The trace's device work as merged (start, end) spans."""
    return merged((e["ts"], e["ts"] + e["dur"]) for e in prof_events if e.get("cat") in DEVICE_WORK)


def device_idle(busy: list[tuple[float, float]], reps: int) -> dict:
    """From a trace's device work (device_busy): busy and idle microseconds per step over the profiled
    span, and the idle stretches' count per step."""
    if not busy:
        return {"busy_us": 0.0, "idle_us": 0.0, "gaps": 0}
    span = busy[-1][1] - busy[0][0]
    worked = sum(b - a for a, b in busy)
    gaps = idle_gaps(busy)
    return {"busy_us": worked / reps, "idle_us": (span - worked) / reps, "gaps": len(gaps) / reps,
            "idle_in_gaps_us": sum(b - a for a, b in gaps) / reps}


def host_waits(events: list[dict], frames: Frames, reps: int) -> dict[str, dict]:
    """The host's waits on the device per step (CUDA runtime calls that synchronise or copy), by call
    and the innermost engine frame that made it: count and microseconds. The round reads the device
    once (graphs.HostRead); any other wait runs the queue dry, and all host work after it is exposed."""
    waits: dict[str, dict] = defaultdict(lambda: {"count": 0.0, "us": 0.0})
    for e in events:
        if e.get("cat") != "cuda_runtime" or not any(w in e["name"] for w in ("Synchronize", "Memcpy")):
            continue
        frame = frames.innermost(e["ts"])
        engine = next((n for n in (frames.chain(frame) if frame else []) if ENGINE_FRAME in n), "(none)")
        entry = waits[f"{e['name']} at {engine}"]
        entry["count"] += 1 / reps
        entry["us"] += e.get("dur", 0.0) / reps
    return dict(sorted(waits.items(), key=lambda kv: -kv[1]["us"]))


def trace_events(run: Callable[[], None], *, stack: bool) -> list[dict]:
    """`run` under the profiler (the device's work, and with `stack` the Python frames too): the trace's events."""
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if stack else [])
    with profile(activities=activities, with_stack=stack) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def python_frames(events: list[dict]) -> Frames:
    """The busiest thread's Python frames (the engine's: the profile runs on it)."""
    py = [e for e in events if e.get("cat") == "python_function" and "dur" in e]
    per_thread: dict = defaultdict(list)
    for e in py:
        per_thread[e.get("tid")].append(e)
    own = max(per_thread.values(), key=len, default=[])
    return Frames([(e["ts"], e["ts"] + e["dur"], e["name"], e.get("args", {}).get("Python parent id"),
                    e.get("args", {}).get("Python id", id(e))) for e in own])


def host_gaps(step: Callable[[], None], reps: int, top: int = 20) -> dict:
    """`reps` calls of `step` profiled twice (device alone; then with the Python stack): the device's
    idle time per step, and the engine frames the host ran in during it."""
    def steps() -> None:
        for _ in range(reps):
            step()

    true = device_idle(device_busy(trace_events(steps, stack=False)), reps)
    events = trace_events(steps, stack=True)
    busy = device_busy(events)
    traced = device_idle(busy, reps)
    stacks = python_frames(events)
    frames = attribute(idle_gaps(busy), stacks, lambda name: ENGINE_FRAME in name)
    per_step = {name: us / reps for name, us in list(frames.items())[:top]}
    waits = host_waits(events, stacks, reps)
    print(f"device idle per step: {true['idle_us']:.0f} us of {true['busy_us'] + true['idle_us']:.0f} "
          f"({true['gaps']:.1f} stretches over {LEAST_GAP_US:.0f} us); with the Python stack traced: "
          f"{traced['idle_us']:.0f} us")
    for name, us in per_step.items():
        print(f"  {us:8.1f} us  {name}")
    print("host waits on the device per step:")
    for name, w in waits.items():
        print(f"  {w['count']:5.1f} x {w['us']:8.1f} us  {name}")
    return {"device": true, "traced": traced, "idle_under_frame_us": per_step, "host_waits": waits}

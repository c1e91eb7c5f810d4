"""CUDA graph capture as every graphed pass of the engine does it, and the engine's one read per round."""

from __future__ import annotations

import time

import torch


def capture(fn, device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm `fn` up on a side stream (allocator and library handles settle), then capture it. Both
    runs compute from the inputs already in the static buffers, so their cache writes are the real ones."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def replayed(bucket, forward, device: torch.device, pool, stats) -> object:
    """forward(bucket) on the static buffers of a fixed-shape pass: eagerly without a graph pool (the
    CPU), else through the bucket's CUDA graph, captured on first use (counted in stats.graph_captures)
    and replayed. Returns the pass's outputs (static buffers on CUDA)."""
    if pool is None:
        return forward(bucket)
    if bucket.graph is None:
        bucket.graph, bucket.out = capture(lambda: forward(bucket), device, pool)
        stats.graph_captures += 1
    bucket.graph.replay()
    return bucket.out


class HostRead:
    """Read a small int64 device tensor on the host without waiting for work queued after it: start()
    queues the copy into pinned memory and marks the stream; the engine then queues more work (the
    next pass) and wait() blocks only until the copy is done."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.buf = torch.zeros(n, dtype=torch.long, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None
        self.waited_s = 0.0  # host time spent blocked in wait(), for the benchmark (host- or device-bound?)

    def start(self, t: torch.Tensor) -> None:
        self.buf[:t.shape[0]].copy_(t, non_blocking=True)
        if self.event is not None:
            self.event.record()

    def wait(self) -> list[int]:
        if self.event is not None:
            t0 = time.perf_counter()
            self.event.synchronize()
            self.waited_s += time.perf_counter() - t0
        return self.buf.tolist()

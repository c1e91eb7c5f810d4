"""CUDA graph capture as every graphed pass of the engine does it."""

from __future__ import annotations

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

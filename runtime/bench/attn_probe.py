"""Time one layer's decode attention (Qwen3-8B heads: 32 query / 8 KV heads of 128) on the GPU, per
tree size and KV length, with an additive tree bias: SDPA, the GEMM form, the split-KV kernel at
several splits, row blocks and warp counts, and the kernel as configured (`rule`). Decides
kernels.decode_split, DECODE_BLOCK_ROWS, DECODE_WARPS and where attend_decode uses the kernel.

    PYTHONPATH=runtime python runtime/bench/attn_probe.py"""

import statistics

import torch
import torch.nn.functional as F

from ddtree_runtime.model import kernels
from ddtree_runtime.model.layers import attend_grouped


def timed(fn, reps: int = 20) -> float:
    """Microseconds per call on the device: reps calls captured in one CUDA graph, as the engine runs
    them (eager timing here would mostly measure this host's launch latency)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times) * 1e3 / reps


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    rule = kernels.decode_split
    for length in (1024, 4608):
        kbuf = torch.randn(1, 8, 8192, 128, device=dev, dtype=dt)
        vbuf = torch.randn_like(kbuf)
        k, v = kbuf[:, :, :length], vbuf[:, :, :length]  # strided views, as the cache gives them
        for t in (1, 17, 33, 65, 129, 257):
            q = torch.randn(1, 32, t, 128, device=dev, dtype=dt)
            ok = torch.rand(t, length, device=dev) < 0.9
            ok[:, 0] = True
            bias = torch.zeros(t, length, device=dev, dtype=dt).masked_fill(~ok, float("-inf"))[None, None]
            row = {"sdpa": timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                                        enable_gqa=True)),
                   "gemm": timed(lambda: attend_grouped(q, k, v, bias))}
            for split in (128, 256, 512, 1024):
                for block_rows in (64, 128):
                    for warps in (4, 8):
                        kernels.decode_split = lambda *_: split
                        kernels.DECODE_BLOCK_ROWS, kernels.DECODE_WARPS = block_rows, warps
                        name = f"s{split}r{block_rows}w{warps}"
                        row[name] = timed(lambda: kernels.decode_attention(q, k, v, bias))
            kernels.decode_split, kernels.DECODE_BLOCK_ROWS, kernels.DECODE_WARPS = rule, 64, 4
            row["rule"] = timed(lambda: kernels.decode_attention(q, k, v, bias))
            print(f"L {length:5} T {t:3}: " + "  ".join(f"{name} {us:5.1f}us" for name, us in row.items()), flush=True)


if __name__ == "__main__":
    main()

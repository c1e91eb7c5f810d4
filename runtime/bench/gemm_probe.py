"""Time the weight GEMMs of a shape's projections on the GPU at a batched verify's row counts, each way
the runtime could run the projections that add into the residual stream (o_proj, down_proj): the GEMM
writing the sum itself (addmm_ with beta 1, kernels.residual_linear), or an out-of-place GEMM then an
add. CUDA graphs, as the engine runs them (attn_probe.timed).

Decided residual_linear's form (8B, 16 / 256 / 272 rows). Since session 27 it also asks what a verify's
row count costs at the tile boundaries: B trees of 2^k + 1 nodes (the runtime's tree buckets) make
B * (2^k + 1) rows, just past a multiple of 64 or 128 (272 = 256 + 16 at 16 running), so the default
rows are each power of two beside it plus one tree bucket's worth (`summed_us`: every listed projection
at a row count, which for the 27B is no layer's: its GDN layers run gdn_in_proj, its attention layers
attn_qkv; weigh them by the layers' count to compare passes).

Session 29 asks whether the 27B's split-K kernels at 272 rows (cuBLAS's heuristic) are avoidable: rows
padded past them (288-320), and `--blas cublaslt` (torch's other BLAS path, its own heuristic); a
workspace limit (CUBLAS_WORKSPACE_CONFIG in the environment) is a third, set by the caller.

    PYTHONPATH=runtime python runtime/bench/gemm_probe.py [--shape qwen3.6-27b] [--rows 128 136 256 272]
        [--blas default|cublas|cublaslt] [--out F]"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from attn_probe import timed  # noqa: E402
from fp8_gemm_bench import SHAPES  # noqa: E402

# the projections that add into the residual stream (kernels.residual_linear)
RESIDUAL = ("o_proj", "down_proj")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 17, 64, 68, 128, 136, 256, 272])
    ap.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default",
                    help="torch.backends.cuda.preferred_blas_library for every GEMM")
    ap.add_argument("--out", default="bench/results/runtime-gemm-probe.json")
    args = ap.parse_args()
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    dev, dt = "cuda", torch.bfloat16
    results = []
    for rows in args.rows:
        for name, fout, fin in SHAPES[args.shape]:
            w = torch.randn(fout, fin, device=dev, dtype=dt) * 0.02
            x = torch.randn(rows, fin, device=dev, dtype=dt)
            res = torch.randn(rows, fout, device=dev, dtype=dt)
            out = torch.empty(rows, fout, device=dev, dtype=dt)
            row = {"rows": rows, "projection": name, "linear": timed(lambda: F.linear(x, w)),
                   "mm_out": timed(lambda: torch.mm(x, w.t(), out=out))}
            if name in RESIDUAL:
                row["addmm_inplace"] = timed(lambda: res.addmm_(x, w.t()))
                row["mm_then_add"] = timed(lambda: res.add_(torch.mm(x, w.t())))
            row["tflops"] = 2 * rows * fin * fout / row["linear"] / 1e6
            results.append(row)
            print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    summed = {}  # every listed projection's GEMM (linear) at each row count
    for r in results:
        summed[r["rows"]] = summed.get(r["rows"], 0.0) + r["linear"]
    for rows, us in summed.items():
        print(f"rows {rows}: the projections' GEMMs {us:.1f} us, {us / rows:.3f} us a row", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": args.shape,
                                          "blas": args.blas, "workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                                          "unit": "us per call", "results": results,
                                          "summed_us": {str(k): v for k, v in summed.items()},
                                          "summed_us_a_row": {str(k): v / k for k, v in summed.items()}},
                                         indent=2))


if __name__ == "__main__":
    main()

"""Time the weight GEMMs of one Qwen3-8B layer on the GPU at a batched verify's row counts, each way the
runtime could run the projections that add into the residual stream (o_proj, down_proj): the GEMM
writing the sum itself (addmm_ with beta 1, kernels.residual_linear), or an out-of-place GEMM then an
add. Decides residual_linear's form; CUDA graphs, as the engine runs them (attn_probe.timed).

    PYTHONPATH=runtime python runtime/bench/gemm_probe.py [--rows 16 272] [--out F]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from attn_probe import timed  # noqa: E402

# (name, in features, out features, adds into the residual stream)
PROJECTIONS = [("qkv", 4096, 6144, False), ("o", 4096, 4096, True), ("gate_up", 4096, 24576, False),
               ("down", 12288, 4096, True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 256, 272])
    ap.add_argument("--out", default="bench/results/runtime-gemm-probe.json")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    results = []
    for rows in args.rows:
        for name, fin, fout, residual in PROJECTIONS:
            w = torch.randn(fout, fin, device=dev, dtype=dt) * 0.02
            x = torch.randn(rows, fin, device=dev, dtype=dt)
            res = torch.randn(rows, fout, device=dev, dtype=dt)
            out = torch.empty(rows, fout, device=dev, dtype=dt)
            row = {"rows": rows, "projection": name, "linear": timed(lambda: F.linear(x, w)),
                   "mm_out": timed(lambda: torch.mm(x, w.t(), out=out))}
            if residual:
                row["addmm_inplace"] = timed(lambda: res.addmm_(x, w.t()))
                row["mm_then_add"] = timed(lambda: res.add_(torch.mm(x, w.t())))
            results.append(row)
            print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "unit": "us per call",
                                          "results": results}, indent=2))


if __name__ == "__main__":
    main()

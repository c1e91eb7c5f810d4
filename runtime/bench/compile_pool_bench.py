"""An empty Triton cache's compiles of fla-core's chunked Gated DeltaNet, the server alone against
compile_pool's workers (issue 38: the first start on a GPU model's first host).

The warm-up's autotuned candidates are almost all fla-core's (59 of the cold start's 89 compiles on the
27B shape). Here one prompt pass of one linear layer at the 27B's heads runs under
`parallel_compiles(workers)` in its own process over its own empty cache, once per worker count,
so the figures isolate the pool: its wall time per batch, the workers' compiling seconds summed, and how
long the pass took in all. GPU only (the autotuners time their candidates on it).

    python runtime/bench/compile_pool_bench.py --workers 0,8 --out compile-pool.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one_case(workers: int, tokens: int, heads: tuple[int, int], head_dim: int) -> dict:
    """The pass over an empty cache (the parent sets TRITON_CACHE_DIR), in this process."""
    import torch

    from ddtree_runtime.model.compile_pool import parallel_compiles
    from ddtree_runtime.model.gdn_chunk import FLA_MODULE, chunk_gated_delta
    from warmup_profile import WarmUpProfile

    key_heads, value_heads = heads
    torch.manual_seed(0)
    cuda = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, tokens, key_heads, head_dim, **cuda)
    k = torch.randn(1, tokens, key_heads, head_dim, **cuda)
    v = torch.randn(1, tokens, value_heads, head_dim, **cuda)
    g = -torch.rand(1, tokens, value_heads, device="cuda")
    beta = torch.rand(1, tokens, value_heads, device="cuda")
    profile = WarmUpProfile()
    started = time.perf_counter()
    with profile.active(), parallel_compiles(workers, preload=(FLA_MODULE,)) as pool:
        chunk_gated_delta(q, k, v, g, beta)
        torch.cuda.synchronize()
        pooled = dict(pool.summary(), batches=pool.batches) if pool is not None else None
    seconds = time.perf_counter() - started
    return {"workers": workers, "seconds": round(seconds, 2), "pool": pooled, "profile": profile.report()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="0,8", help="worker counts, one empty cache each (0: the server alone)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--heads", default="16,48", help="key heads, value heads (the 27B's)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--case", type=int, help=argparse.SUPPRESS)   # a child: one worker count, JSON out
    args = ap.parse_args()
    heads = tuple(int(h) for h in args.heads.split(","))
    if args.case is not None:
        print(json.dumps(one_case(args.case, args.tokens, heads, args.head_dim)))
        return
    results = []
    for workers in (int(w) for w in args.workers.split(",")):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache,
                   "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
            child = subprocess.run([sys.executable, __file__, "--case", str(workers), "--tokens", str(args.tokens),
                                    "--heads", args.heads, "--head-dim", str(args.head_dim)],
                                   env=env, capture_output=True, text=True)
        if child.returncode:
            sys.exit(f"compile_pool_bench: the case with {workers} workers failed:\n{child.stderr[-3000:]}")
        case = json.loads(child.stdout.strip().splitlines()[-1])
        results.append(case)
        where = case["profile"]["exclusive_s"]
        print(f"workers {workers}: {case['seconds']} s in all; {where}; pool {case['pool']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"tokens": args.tokens, "heads": heads, "cases": results}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""An empty Triton cache's compiles of fla-core's chunked Gated DeltaNet, the server alone against
compile_pool's workers (issue 38: the first start on a GPU model's first host).

The warm-up's autotuned candidates are almost all fla-core's (59 of the cold start's 89 compiles on the
27B shape). Here one prompt pass of one linear layer at the 27B's heads runs under
`parallel_compiles(workers)` in its own process over its own empty cache, once per worker count,
so the figures isolate the pool: its wall time per batch, the workers' compiling seconds summed, and how
long the pass took in all. GPU only (the autotuners time their candidates on it).

`--scaling 1,2,4,8` asks the machine instead: N processes at once each compile the runtime's own tree
verify kernel (`_tree_delta_kernel` at the 27B's heads, 16- and 32-node blocks, for sm_90) into its own
empty cache, and the same N each run a fixed pure-Python loop. Where the seconds a compile takes grow
with N as the loop's do, the machine's cores, not the pool, bound how wide compiles can go. No GPU
needed (the compiles target sm_90 from the CPU).

    python runtime/bench/compile_pool_bench.py --workers 0,8 --out compile-pool.json
    python runtime/bench/compile_pool_bench.py --workers '' --scaling 1,2,4,8 --out scaling.json
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


def compile_tree_kernel() -> dict:
    """Compile the tree verify kernel as the 27B's layers launch it (dk = dv = 128), for sm_90, in this
    process (its cache is the parent's fresh directory): seconds per block size."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ddtree_runtime.model import gdn_kernels

    kernel = gdn_kernels._tree_delta_kernel
    pointers = {"g_ptr": "*bf16", "beta_ptr": "*bf16", "dt_bias_ptr": "*bf16", "mask_ptr": "*u8"}
    seconds = {}
    for block in (16, 32):
        constants = dict(DK=128, DV=128, BT=block, LOG_BT=block.bit_length() - 1, BK=32, BV=64, HAS_STATE=True,
                         RAW_GATES=True, PRECISION="tf32x3", OUT_PRECISION="tf32x3", SQUARING=True)
        signature = {name: "constexpr" if name in constants else pointers.get(name, "*fp32" if name.endswith("_ptr")
                                                                              else "i32")
                     for name in kernel.arg_names}
        started = time.perf_counter()
        triton.compile(ASTSource(kernel, signature, {(kernel.arg_names.index(k),): v for k, v in constants.items()}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        seconds[f"block_{block}"] = round(time.perf_counter() - started, 3)
    return seconds


def spin() -> dict:
    """A fixed pure-Python loop: the seconds one core takes for it."""
    started = time.perf_counter()
    total = 0
    for i in range(20_000_000):
        total += i & 7
    return {"spin": round(time.perf_counter() - started, 3)}


def scaling(counts: list[int]) -> list[dict]:
    """For each N: N processes compiling at once, then N spinning at once; the seconds each took."""
    rows = []
    for n in counts:
        row = {"processes": n}
        for what in ("compile", "spin"):
            with tempfile.TemporaryDirectory() as root:
                children = []
                for i in range(n):
                    env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(root, str(i)), "CUDA_VISIBLE_DEVICES": "",
                           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
                    children.append(subprocess.Popen([sys.executable, __file__, "--scale-child", what], env=env,
                                                     stdout=subprocess.PIPE, text=True))
                results = [json.loads(child.communicate()[0].strip().splitlines()[-1]) for child in children]
            for key in results[0]:
                each = [r[key] for r in results]
                row[key] = {"mean_s": round(sum(each) / n, 3), "max_s": max(each)}
        rows.append(row)
        print(f"{n} at once: " + ", ".join(f"{k} {v['mean_s']} s (max {v['max_s']})" for k, v in row.items()
                                            if k != "processes"), flush=True)
    return rows


def machine() -> dict:
    """What bounds the processes: the cores this process may use and the cgroup's CPU quota."""
    facts = {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0))}
    for name in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        if os.path.exists(name):
            facts[name] = Path(name).read_text().strip()
    return facts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="0,8", help="worker counts, one empty cache each (0: the server alone)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--heads", default="16,48", help="key heads, value heads (the 27B's)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--scaling", default="", help="process counts: the machine's compile and CPU scaling")
    ap.add_argument("--case", type=int, help=argparse.SUPPRESS)   # a child: one worker count, JSON out
    ap.add_argument("--scale-child", choices=("compile", "spin"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.scale_child:
        print(json.dumps(compile_tree_kernel() if args.scale_child == "compile" else spin()))
        return
    heads = tuple(int(h) for h in args.heads.split(","))
    if args.case is not None:
        print(json.dumps(one_case(args.case, args.tokens, heads, args.head_dim)))
        return
    results = []
    report = {"tokens": args.tokens, "heads": heads, "cases": results}
    if args.scaling:
        report["machine"] = machine()
        print(f"machine: {report['machine']}", flush=True)
        report["scaling"] = scaling([int(n) for n in args.scaling.split(",")])
    for workers in (int(w) for w in args.workers.split(",") if w):
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
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Time a batched round's tree build on the GPU (Qwen3-8B's drafter shape: R drafts of 15 depths over a
151,936-token vocabulary, bf16 logits, budget 16), each variant captured in one CUDA graph as the engine
runs it (attn_probe.timed):

    torch_full     build_trees with the full-vocab log-softmax and top-K (the batched build before the
                   Triton one), levels as torch top-Ks
    torch_chunked  build_trees with the chunked top-K (top_tokens' CUDA form), levels as torch top-Ks
    top_tokens     the chunked top-K alone: the part of build_trees_on_gpu before the Triton launch
    triton         build_trees_on_gpu: the chunked top-K, then one launch of a program per draft
    single_x_R     R single-stream builds (build_tree_on_gpu per draft), for the launch's gain

Before timing, a check on float32 logits (no ties): the Triton build equals build_trees, and each of its
rows the single-stream build of that draft (on the GPU the programs run at once, so a program touching
another's rows or scratch shows here).

    PYTHONPATH=runtime python runtime/bench/tree_bench.py [--rows 1 4 8 16 32] [--out F]"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attn_probe import timed  # noqa: E402

from ddtree_runtime.engine.tree import (build_tree_on_gpu, build_trees, build_trees_on_gpu,  # noqa: E402
                                        top_tokens)

DEPTH, VOCAB = 15, 151936


def matches(rows: int, budget: int) -> bool:
    """The Triton build equals the torch one and each draft's single-stream build (float32 logits)."""
    x = torch.randn(rows, DEPTH, VOCAB, device="cuda") * 3
    nodes = build_trees_on_gpu(x, budget)
    return torch.equal(nodes, build_trees(x, budget)) and all(
        torch.equal(nodes[r], build_tree_on_gpu(x[r], budget).nodes) for r in range(rows))


def variants(x: torch.Tensor, budget: int) -> dict[str, Callable[[], object]]:
    """The builds to time, by name (the module docstring says what each is)."""
    return {"torch_full": lambda: build_trees(x, budget, chunked=False),
            "torch_chunked": lambda: build_trees(x, budget),
            "top_tokens": lambda: top_tokens(x, budget),
            "triton": lambda: build_trees_on_gpu(x, budget),
            "single_x_R": lambda: [build_tree_on_gpu(draft, budget) for draft in x]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--out", default="bench/results/runtime-tree-bench.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    results = []
    for rows in args.rows:
        x = (torch.randn(rows, DEPTH, VOCAB, device="cuda") * 3).to(torch.bfloat16)
        row = {"rows": rows, "matches": matches(rows, args.budget)}
        row.update({name: round(timed(fn), 1) for name, fn in variants(x, args.budget).items()})
        print(f"R {rows:2}: " + "  ".join(f"{k} {v}" + ("us" if isinstance(v, float) else "")
                                          for k, v in row.items() if k != "rows"), flush=True)
        results.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "budget": args.budget, "depth": DEPTH, "vocab": VOCAB, "dtype": "bfloat16",
                               "unit": "us per build (CUDA graph, median of 10 replays of 20)",
                               "results": results}, indent=2) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()

"""Time a batched round's tree build on the GPU (Qwen3-8B's drafter shape: R drafts of 15 depths over a
151,936-token vocabulary, budget 16, float32 logits as the engine's drafter gives them), each variant
captured in one CUDA graph as the engine runs it (attn_probe.timed):

    torch_full        build_trees with the full-vocab log-softmax and top-K (the batched build before the
                      Triton one), levels as torch top-Ks
    top_tokens_torch  the chunked torch top-K alone (top_tokens' CUDA form before the Triton one; the
                      bench's own copy, as the baseline)
    top_tokens        top_tokens' CUDA form alone: tree_kernel.top_log_probs, the part of
                      build_trees_on_gpu before the tree launch
    triton            build_trees_on_gpu: the Triton top-K, then one launch of a program per draft
    single_x_R        R single-stream builds (build_tree_on_gpu per draft), for the launch's gain

Before timing, checks on float32 logits (no ties): the Triton top-K equals the log-softmax top-K (values
within 1e-5, the same tokens) and the torch chunked form; the Triton build equals build_trees, and each
of its rows the single-stream build of that draft (on the GPU the programs run at once, so a program
touching another's rows or scratch shows here).

    PYTHONPATH=runtime python runtime/bench/tree_bench.py [--rows 1 4 8 16 32] [--budget 16]
        [--dtype float32|bfloat16] [--out F]"""

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


def torch_chunked_top_tokens(draft_logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline: top_tokens' CUDA form before the Triton kernel (a copy kept only in this bench). Rows
    cut into the most chunks up to 128 that divide the vocabulary, top-K and log-sum-exp per chunk, then
    over the chunks."""
    depth, vocab = min(draft_logits.shape[-2], budget), draft_logits.shape[-1]
    k = min(budget, vocab)
    chunks = max(c for c in range(1, 129) if vocab % c == 0)
    width = vocab // chunks
    x = draft_logits[..., :depth, :].float().unflatten(-1, (chunks, width))                  # [..., D, C, W]
    lse = torch.logsumexp(torch.logsumexp(x, dim=-1), dim=-1, keepdim=True)                  # [..., D, 1]
    part, part_ids = x.topk(min(k, width), dim=-1)                                           # [..., D, C, k']
    top, pick = part.flatten(-2).topk(k, dim=-1)                                             # [..., D, K]
    starts = torch.arange(0, vocab, width, device=x.device)[:, None]
    return top - lse, (part_ids + starts).flatten(-2).gather(-1, pick)


def top_matches(rows: int, budget: int) -> bool:
    """The Triton top-K equals the log-softmax top-K and the torch chunked form (float32 logits)."""
    x = torch.randn(rows, DEPTH, VOCAB, device="cuda") * 3
    lp, ids, _ = top_tokens(x, budget)
    want_lp, want_ids = torch.log_softmax(x[:, :min(DEPTH, budget)], dim=-1).topk(min(budget, VOCAB), dim=-1)
    old_lp, old_ids = torch_chunked_top_tokens(x, budget)
    return bool((lp - want_lp).abs().max() < 1e-5 and torch.equal(ids, want_ids)
                and (lp - old_lp).abs().max() < 1e-5 and torch.equal(ids, old_ids))


def matches(rows: int, budget: int) -> bool:
    """The Triton build equals the torch one and each draft's single-stream build (float32 logits)."""
    x = torch.randn(rows, DEPTH, VOCAB, device="cuda") * 3
    nodes = build_trees_on_gpu(x, budget)
    return torch.equal(nodes, build_trees(x, budget)) and all(
        torch.equal(nodes[r], build_tree_on_gpu(x[r], budget).nodes) for r in range(rows))


def variants(x: torch.Tensor, budget: int) -> dict[str, Callable[[], object]]:
    """The builds to time, by name (the module docstring says what each is)."""
    return {"torch_full": lambda: build_trees(x, budget, chunked=False),
            "top_tokens_torch": lambda: torch_chunked_top_tokens(x, budget),
            "top_tokens": lambda: top_tokens(x, budget),
            "triton": lambda: build_trees_on_gpu(x, budget),
            "single_x_R": lambda: [build_tree_on_gpu(draft, budget) for draft in x]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--out", default="bench/results/runtime-tree-bench.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    results = []
    for rows in args.rows:
        x = (torch.randn(rows, DEPTH, VOCAB, device="cuda") * 3).to(getattr(torch, args.dtype))
        row = {"rows": rows, "top_matches": top_matches(rows, args.budget), "matches": matches(rows, args.budget)}
        row.update({name: round(timed(fn), 1) for name, fn in variants(x, args.budget).items()})
        print(f"R {rows:2}: " + "  ".join(f"{k} {v}" + ("us" if isinstance(v, float) else "")
                                          for k, v in row.items() if k != "rows"), flush=True)
        print(f"      top_tokens: Triton {row['top_tokens']}us vs torch chunked {row['top_tokens_torch']}us "
              f"({row['top_tokens_torch'] / row['top_tokens']:.1f}x)", flush=True)
        results.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "budget": args.budget, "depth": DEPTH, "vocab": VOCAB, "dtype": args.dtype,
                               "unit": "us per build (CUDA graph, median of 10 replays of 20)",
                               "results": results}, indent=2) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()

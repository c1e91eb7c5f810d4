"""What the paged KV pool holds on a card of a given memory, by the engine's own sizing, without a GPU:
the models of a gpu_bench shape are built on the meta device (no memory), the engine sizes its pool
from `--memory-mib` less the weights, and its capacity (tokens, pages, requests of 8K and of the full
context) is printed and written as JSON. Arithmetic, not a measurement: the CUDA context, the
allocator's fragmentation and the graphs' memory pool are not in it.

    PYTHONPATH=runtime:runtime/bench python runtime/bench/pool_plan.py --shape qwen3.6-27b \\
        --memory-mib 97887 --max-context 131072 --max-running 16 --out bench/results/runtime-pool-plan.json
    ... --sliding-window 4096   # the drafter laid out as z-lab's: its layers sliding but the last
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import ddtree_runtime.engine.memory as memory
from ddtree_runtime.engine import Engine, EngineConfig
from drafter_layout_bench import layout
from gpu_bench import SHAPES, build_models, nbytes


def plan(shape: str, memory_mib: int, max_context: int, max_running: int, tree_budget: int,
         mem_fraction: float, page_size: int, sliding_window: int | None = None) -> dict:
    target, drafter = build_models(shape, torch.device("meta"), torch.bfloat16)
    if sliding_window:
        drafter.config.attention = layout("zlab", drafter.config.num_hidden_layers, sliding_window)
    target.config.max_position_embeddings = max(target.config.max_position_embeddings, max_context)  # 262144 real
    weights = nbytes(target) + nbytes(drafter)
    free = memory_mib * 2**20 - weights
    memory.free_bytes = lambda device: free  # the card's memory once the weights are in
    engine = Engine(EngineConfig(target_dir=shape, draft_dir=None, device="meta", dtype="bfloat16",
                                 max_context=max_context, max_running=max_running, tree_budget=tree_budget,
                                 mem_fraction=mem_fraction, page_size=page_size),
                    target=target, drafter=drafter, tokenizer=None)
    cap = engine.capacity()
    page_bytes = engine.sizing.page_bytes()
    # the arithmetic's ceiling: every byte left after the weights, a prefill's activations and the rows'
    # state slots, in tokens of both models' KV
    rows = engine.rows * engine.sizing.row_bytes(engine.tree_slots)
    ceiling = (free - engine.sizing.prefill_bytes(engine.max_context) - rows) * page_size // page_bytes
    return {"shape": shape, "memory_mib": memory_mib, "weights_gib": weights / 2**30, "free_gib": free / 2**30,
            "page_bytes": page_bytes, "token_bytes": page_bytes // page_size, "row_state_gib": rows / 2**30,
            "mem_fraction": mem_fraction, "ceiling_tokens": ceiling,
            "share_of_ceiling": cap["tokens"] / ceiling, **cap}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.6-27b", choices=sorted(SHAPES))
    ap.add_argument("--memory-mib", type=int, default=97887)
    ap.add_argument("--max-context", type=int, default=131072)
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--tree-budget", type=int, default=16)
    ap.add_argument("--mem-fraction", type=float, default=0.9)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--sliding-window", type=int, default=None, help="z-lab's drafter layout with this window")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = plan(args.shape, args.memory_mib, args.max_context, args.max_running, args.tree_budget,
               args.mem_fraction, args.page_size, args.sliding_window)
    print(f"{out['shape']} on {out['memory_mib']} MiB: weights {out['weights_gib']:.1f} GiB, pool {out['tokens']} "
          f"tokens ({out['pages_total']} pages x {out['page_size']}, {out['token_bytes']} B a token), "
          f"{out['share_of_ceiling']:.1%} of the {out['ceiling_tokens']} the memory allows; "
          f"{out['requests_8k']} requests of 8K, {out['requests_full_context']} of {out['max_context']}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""The engine's memory arithmetic: what a page, a row and a prefill cost, how many pages the pool gets
and whether a re-size fits. Every byte formula is capacity.py's (the arithmetic ddops shows in a plan),
applied to the loaded models' shapes; only the free memory is measured here, so the engine's pool is
what capacity.py estimates for the same memory (a test checks it)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ..capacity import TREE_BUCKETS, Capacity, Shape, prefill_workspace_bytes, round_reserve
from ..limits import MAX_TREE_BUDGET
from ..model import Qwen35Config, parallel
from ..model.config import DFlashConfig, Qwen3Config
from .runner import KV_BUCKET, tree_bucket

log = logging.getLogger(__name__)


def shape_of(cfg: Qwen3Config) -> Shape:
    """capacity.py's Shape of a loaded model's config (a benchmark's random model has no config.json)."""
    hybrid = isinstance(cfg, Qwen35Config)
    windows = ([cfg.layer_attention(i).window for i in range(cfg.num_hidden_layers)]
               if isinstance(cfg, DFlashConfig) else [])
    sliding = [w for w in windows if w is not None]
    return Shape(vocab=cfg.vocab_size, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
                 heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                 full_layers=cfg.kv_layers - len(sliding), linear_layers=len(cfg.linear_layers) if hybrid else 0,
                 window_layers=len(sliding), window=max(sliding, default=0),
                 tied=cfg.tie_word_embeddings, bias=cfg.attention_bias, gated=hybrid,
                 conv_kernel=cfg.linear_conv_kernel_dim if hybrid else 4,
                 key_heads=cfg.linear_num_key_heads if hybrid else 0, key_dim=cfg.linear_key_head_dim if hybrid else 0,
                 value_heads=cfg.linear_num_value_heads if hybrid else 0,
                 value_dim=cfg.linear_value_head_dim if hybrid else 0, positions=cfg.max_position_embeddings)


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation can take: the GPU's free memory, or the host's available memory (with
    tensor parallelism the least of every rank's: their pools and decisions must be the same)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # blocks the caching allocator holds but nothing uses
        return parallel.agreed_minimum(torch.cuda.mem_get_info(device)[0])
    return parallel.agreed_minimum(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


@dataclass(frozen=True)
class PoolSizing:
    """The pool's costs for one engine: the target's and the drafter's shapes (no drafter: None) in
    `elem`-byte elements, pages of `page_size` tokens, the drafter's block, the target layers whose
    features a prefill piece hands to the drafter, whether a hybrid row keeps a prompt snapshot, and
    whether a sliding drafter's rows keep one of their rings (both: the prefix cache)."""
    target: Shape
    drafter: Shape | None
    elem: int
    page_size: int
    block_size: int
    feature_layers: int
    snapshots: bool
    ring_snapshots: bool = False

    def page_bytes(self) -> int:
        """One page: page_size positions of the target's KV and the drafter's full layers' (its sliding
        layers keep rings per row: row_bytes)."""
        token = self.target.token_bytes(self.elem)
        if self.drafter is not None:
            token += self.drafter.token_bytes(self.elem)
        return token * self.page_size

    def target_page_bytes(self) -> int:
        return self.target.token_bytes(self.elem) * self.page_size

    def row_bytes(self, tree_slots: int) -> int:
        """What a row costs beside its pages: a hybrid's state slot and tree scratch, a sliding drafter's
        rings (none otherwise)."""
        rings = 0 if self.drafter is None else self.drafter.ring_bytes(self.elem, self.block_size, self.ring_snapshots)
        return self.target.request_bytes(tree_bucket(tree_slots), self.elem, self.snapshots) + rings

    def round_reserve(self, tree_slots: int) -> int:
        return round_reserve(tree_slots, self.block_size)

    def request_pages(self, tokens: int, tree_slots: int) -> int:
        """Pages a request of `tokens` tokens holds with one round's reservation."""
        return -(-(tokens + self.round_reserve(tree_slots)) // self.page_size)

    def row_capacity(self, max_context: int) -> int:
        """Logical positions a block table addresses: the context, the largest round's writes, and a
        bucket beyond, where pad rows write (never backed by a page: the scratch page)."""
        largest = max(self.round_reserve(MAX_TREE_BUDGET + 1), TREE_BUCKETS[-1])
        return -(-(max_context + largest) // KV_BUCKET) * KV_BUCKET + KV_BUCKET

    def prefill_bytes(self, context: int) -> int:
        """A prefill's activations at `context` prompt tokens (one prefill runs at a time)."""
        return prefill_workspace_bytes(self.target, context, self.feature_layers, self.elem)

    def needed_bytes(self, context: int, tree_slots: int, rows: int = 1) -> int:
        """What serving one request of `context` tokens takes: its pages at a tree of `tree_slots`
        nodes, the pool's `rows` (each allocated at start, as pages_that_fit counts them), and a
        prefill's activations."""
        return (self.request_pages(context, tree_slots) * self.page_bytes() + rows * self.row_bytes(tree_slots)
                + self.prefill_bytes(context))

    def pages_that_fit(self, *, free: int, rows: int, max_context: int, tree_slots: int, mem_fraction: float,
                       kv_pool_tokens: int | None, device: torch.device) -> int:
        """The pool's pages: kv_pool_tokens' if configured, else what mem_fraction of the `free` memory
        holds beside the rows and a prefill's activations (capacity.py's pool over that memory: at
        least one request of the full context, which all of it may hold: serving_context's measure),
        and never more than every row at the full context with the largest tree. ValueError (before
        anything is allocated) when not even that fits."""
        page, row_total = self.page_bytes(), rows * self.row_bytes(tree_slots)
        one = self.request_pages(max_context, tree_slots)
        prefill = self.prefill_bytes(max_context)
        if kv_pool_tokens is not None:
            pages = -(-kv_pool_tokens // self.page_size)
            if pages * page + row_total + prefill > free:
                raise ValueError(f"kv_pool_tokens {kv_pool_tokens} needs {(pages * page + row_total) / 2**30:.1f} "
                                 f"GiB for the pool, but {free / 2**30:.1f} GiB of {device} is free: lower it")
            if pages < one:
                log.warning("a pool of %d tokens holds no request of the full context (%d)", pages * self.page_size,
                            max_context)
            return pages
        estimate = Capacity(memory_bytes=free, mem_fraction=mem_fraction, weights_bytes=0, workspace_bytes=prefill,
                            request_bytes=self.row_bytes(tree_slots), max_running=rows,
                            token_bytes=page // self.page_size, reserve_tokens=self.round_reserve(tree_slots),
                            max_context=max_context)
        most = rows * self.request_pages(max_context, MAX_TREE_BUDGET + 1)
        pages = min(estimate.pool_tokens // self.page_size, most)
        if pages < one and one * page + row_total + prefill <= free:
            pages = one
        if pages < one:
            what = " and recurrent-state slots" if self.target.linear_layers else ""
            raise ValueError(
                f"tree budget {tree_slots - 1} at context {max_context} needs "
                f"{(one * page + row_total) / 2**30:.1f} GiB for the caches{what} of {rows} rows, but "
                f"{free / 2**30:.1f} GiB of {device} is free: lower the tree budget, max context or "
                f"max running")
        return pages

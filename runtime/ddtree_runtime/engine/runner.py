"""The target's decode-side forward (an AR step is a one-node tree) over static buffers at bucketed sizes.

Every forward after the prefill is "N tree nodes at positions start + depth, each seeing the context and
its ancestors". The runner pads N up to a size bucket, attends over the first kv_len cache entries
(start + bucket rounded up to KV_BUCKET) and builds the additive attention bias on the device from
`start` and the tree's ancestor mask, so nothing in the forward depends on a host-side offset. On CUDA
each (bucket, kv_len) pair is captured once as a CUDA graph and replayed: one launch instead of ~1,500
per forward, which is what bounds an eager 8B forward on a slow host."""

from __future__ import annotations

import torch

from ..model import Qwen3ForCausalLM
from .kv_cache import KVCache

TREE_BUCKETS = (1, 2, 5, 9, 17, 33, 65, 129, 257, 513, 1025)  # root + 2^k draft nodes
KV_BUCKET = 512


def tree_bucket(n: int) -> int:
    for b in TREE_BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"tree of {n} nodes exceeds the largest bucket {TREE_BUCKETS[-1]}")


def kv_len_for(end: int, capacity: int) -> int:
    return min(capacity, -(-end // KV_BUCKET) * KV_BUCKET)


class _Bucket:
    """Static inputs and outputs of one (tokens, kv_len) shape, plus its CUDA graph once captured."""

    def __init__(self, size: int, kv_len: int, device: torch.device, dtype: torch.dtype) -> None:
        self.size, self.kv_len = size, kv_len
        self.ids = torch.zeros(1, size, dtype=torch.long, device=device)       # [1, T]
        self.pos = torch.zeros(1, size, dtype=torch.long, device=device)       # [1, T]
        self.start = torch.zeros(1, dtype=torch.long, device=device)           # [1]
        self.tree = torch.eye(size, dtype=torch.bool, device=device)           # [T, T] ancestor mask
        self.eye = torch.eye(size, dtype=torch.bool, device=device)
        self.cols = torch.arange(kv_len, device=device)                        # [L]
        self.rows = torch.arange(size, device=device)                          # [T]
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.neg_inf = torch.full((), float("-inf"), dtype=dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, torch.Tensor | None] | None = None


class TargetRunner:
    def __init__(self, target: Qwen3ForCausalLM, cache: KVCache, device: torch.device) -> None:
        self.target, self.cache, self.device = target, cache, device
        self.use_graphs = device.type == "cuda"
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    @staticmethod
    def capacity_for(max_context: int, tree_slots: int) -> int:
        """Cache slots needed: the context, the padded tree, rounded up to a whole kv bucket."""
        return -(-(max_context + tree_bucket(tree_slots)) // KV_BUCKET) * KV_BUCKET

    def run(self, tokens: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor,
            start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens, depths: [N] long; tree_mask: [N, N] bool; the nodes' k/v go to slots start..start+N.

        Returns logits [N, V] (float32) and features [1, N, F] (or None without feature layers). Both may
        be views of static buffers: use them before the next run."""
        n = tokens.shape[0]
        size = tree_bucket(n)
        kv_len = kv_len_for(start + size, self.cache.capacity)
        b = self.buckets.get((size, kv_len))
        if b is None:
            b = self.buckets[(size, kv_len)] = _Bucket(size, kv_len, self.device, self.cache.k.dtype)
        # fill the static inputs; padding nodes hold token 0 at the root's position and see only the
        # context and themselves, and no real node sees them
        b.ids[0, :n] = tokens
        b.pos[0, :n] = depths + start
        if n < size:
            b.ids[0, n:] = 0
            b.pos[0, n:] = start
            b.tree.copy_(b.eye)
        b.tree[:n, :n] = tree_mask
        b.start.fill_(start)
        if not self.use_graphs:
            logits, feats = self._forward(b)
        else:
            if b.graph is None:
                self._capture(b)
            b.graph.replay()
            logits, feats = b.out
        return logits[:n], (feats[:, :n] if feats is not None else None)

    def _forward(self, b: _Bucket) -> tuple[torch.Tensor, torch.Tensor | None]:
        rel = b.cols - b.start                                  # [L] cache slot relative to the tree
        in_tree = b.tree[:, rel.clamp(0, b.size - 1)]           # [T, L] ancestor bit of that slot's node
        allowed = (rel < 0) | ((rel < b.size) & in_tree)        # context, or an ancestor (or self)
        bias = torch.where(allowed, b.zero, b.neg_inf)          # [T, L] additive, cache dtype
        slots = b.start + b.rows                                # [T]
        h, feats = self.target(b.ids, b.pos, self.cache, static=(slots, bias[None, None], b.kv_len))
        return self.target.logits(h[0]), feats

    def _capture(self, b: _Bucket) -> None:
        # warm up on a side stream (allocator and library handles settle), then capture; both write
        # the same k/v the replay will, from the inputs already in the static buffers
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        b.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(b.graph, pool=self.pool):
            b.out = self._forward(b)

    def reset(self, cache: KVCache) -> None:
        """The cache was reallocated: every captured graph points at the old one."""
        self.cache = cache
        self.buckets.clear()

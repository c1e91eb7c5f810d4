"""The target's decode-side forward (an AR step is a one-node tree) over static buffers at bucketed sizes.

Every forward after the prefill is "N tree nodes at positions start + depth, each seeing the context and
its ancestors". The runner pads N up to a size bucket, attends over the first kv_len cache entries
(start + bucket rounded up to KV_BUCKET) and builds the additive attention bias on the device from
`start` and the tree's ancestor mask (itself built on the device from parent indices), so nothing in
the forward depends on a host-side offset. On CUDA each (bucket, kv_len) pair is captured once as a
CUDA graph and replayed: one launch instead of ~1,500 per forward, which is what bounds an eager 8B
forward on a slow host."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..capacity import TREE_BUCKETS  # root + 2^k draft nodes (declared there: the pool is sized by them)
from ..model import Qwen3ForCausalLM
from ..model.layers import TreeInputs
from .kv_cache import KVCache
from .graphs import capture
from .tree import Tree, ancestor_mask

KV_BUCKET = 512
# Without CUDA graphs a shape costs nothing to change, and a pass's attention reads every key up to the
# bucket: a CPU pass rounds its keys up to this instead (tiny models at 100 tokens: a quarter of the keys).
EAGER_KV_BUCKET = 64


def tree_bucket(n: int) -> int:
    for b in TREE_BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"tree of {n} nodes exceeds the largest bucket {TREE_BUCKETS[-1]}")


def kv_len_for(end: int, capacity: int, graphed: bool = True) -> int:
    """The cache entries a pass attends over to reach slot `end`: a whole bucket (one graph per bucket)."""
    bucket = KV_BUCKET if graphed else EAGER_KV_BUCKET
    return min(capacity, -(-end // bucket) * bucket)


class _Bucket:
    """Static inputs and outputs of one (tokens, kv_len) shape, plus its CUDA graph once captured."""

    def __init__(self, size: int, kv_len: int, device: torch.device, dtype: torch.dtype) -> None:
        self.size, self.kv_len = size, kv_len
        # ids | parents | depths | start: a tree's rows, then the start, in one int64 vector written by
        # device ops only (a fill or a device copy per pass: nothing on the host that a queued copy could
        # still be reading when the engine runs ahead). `layout` is the padding: padding nodes hold token
        # 0 at depth 0 and are their own parents, so they see only the context and themselves, and no
        # real node sees them
        self.layout = torch.zeros(3 * size + 1, dtype=torch.long, device=device)
        self.layout[size:2 * size] = torch.arange(size, device=device)
        self.ints = self.layout.clone()
        self.nodes = self.ints[:3 * size].view(3, size)                       # [3, T]
        self.ids = self.ints[:size].view(1, size)                              # [1, T]
        self.parents = self.ints[size:2 * size]                                # [T]
        self.depths = self.ints[2 * size:3 * size]                             # [T]
        self.start = self.ints[3 * size:]                                      # [1]
        self.cols = torch.arange(kv_len, device=device)                        # [L]
        self.rows = torch.arange(size, device=device)                          # [T]
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.neg_inf = torch.full((), float("-inf"), dtype=dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None
        self.views: dict[int, TreePass] = {}


class TreePass(NamedTuple):
    """A tree pass's outputs and the tree it ran over (root included), all on the device; views of
    static buffers: use them before the next pass."""
    logits: torch.Tensor          # [N, V] float32
    feats: torch.Tensor | None    # [1, N, F], None without feature layers
    tokens: torch.Tensor          # [N]
    parents: torch.Tensor         # [N]
    depths: torch.Tensor          # [N]
    mask: torch.Tensor            # [N, N] ancestor-or-self


def _views(b: _Bucket, out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor], n: int) -> TreePass:
    logits, feats, mask = out
    return TreePass(logits[:n], feats[:, :n] if feats is not None else None,
                    b.ids[0, :n], b.parents[:n], b.depths[:n], mask[:n, :n])


class TargetRunner:
    def __init__(self, target: Qwen3ForCausalLM, cache: KVCache, device: torch.device, max_depth: int) -> None:
        """max_depth: the deepest tree node the engine will pass (bounds the device-side mask build)."""
        self.target, self.cache, self.device, self.max_depth = target, cache, device, max_depth
        self.use_graphs = device.type == "cuda"
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    @staticmethod
    def capacity_for(max_context: int, tree_slots: int) -> int:
        """Cache slots needed: the context, the padded tree, rounded up to a whole kv bucket."""
        return -(-(max_context + tree_bucket(tree_slots)) // KV_BUCKET) * KV_BUCKET

    def run(self, root: int | torch.Tensor, start: int, tree: Tree | None = None) -> TreePass:
        """A tree pass: the root (node 0) holds `root` (a token, or a [1] device tensor holding one) at
        position `start`, each draft node of `tree` (None: an AR step, the root alone) its token at
        start + its depth, below its parent; the nodes' k/v go to cache slots start..start+N, each node
        seeing the context and its own ancestors. Nothing here waits for the device."""
        n = 1 if tree is None else tree.size
        size = tree_bucket(n)
        kv_len = kv_len_for(start + size, self.cache.capacity, self.use_graphs)
        b = self.buckets.get((size, kv_len))
        if b is None:
            b = self.buckets[(size, kv_len)] = _Bucket(size, kv_len, self.device, self.cache.k.dtype)
        if n < size:
            b.ints.copy_(b.layout)  # the padding, over whatever a bigger tree left in this bucket
        if isinstance(root, torch.Tensor):
            b.ids[0, :1].copy_(root)
        else:
            b.ids[0, :1].fill_(root)
        b.start.fill_(start)
        if tree is not None:
            b.nodes[:, 1:n].copy_(tree.nodes)
        if not self.use_graphs:
            return _views(b, self._forward(b), n)
        if b.graph is None:
            b.graph, b.out = capture(lambda: self._forward(b), self.device, self.pool)
        b.graph.replay()
        if n not in b.views:  # the views of static buffers are made once (a slice is host time)
            b.views[n] = _views(b, b.out, n)
        return b.views[n]

    def _forward(self, b: _Bucket) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        tree = ancestor_mask(b.parents, min(self.max_depth, b.size - 1))   # [T, T]
        rel = b.cols - b.start                                  # [L] cache slot relative to the tree
        in_tree = tree[:, rel.clamp(0, b.size - 1)]             # [T, L] ancestor bit of that slot's node
        allowed = (rel < 0) | ((rel < b.size) & in_tree)        # context, or an ancestor (or self)
        bias = torch.where(allowed, b.zero, b.neg_inf)          # [T, L] additive, cache dtype
        slots = b.start + b.rows                                # [T]
        pos = (b.start + b.depths)[None]                        # [1, T]
        h, feats = self.target(b.ids, pos, self.cache,
                               static=TreeInputs(slots, bias[None, None], b.kv_len, tree))
        return self.target.logits(h[0]), feats, tree


class _DraftBucket:
    def __init__(self, block: int, feat_dim: int, kv_len: int, device: torch.device, dtype: torch.dtype,
                 mask_token_id: int) -> None:
        self.kv_len = kv_len
        # ids [1, Q] | start (context already in the cache) | n (context length after this call), written
        # by device ops only; ids[1:] hold MASK for good
        self.ints = torch.full((block + 2,), mask_token_id, dtype=torch.long, device=device)
        self.ids = self.ints[:block].view(1, block)
        self.start = self.ints[block:block + 1]
        self.n = self.ints[block + 1:]
        self.feats = torch.zeros(1, block, feat_dim, dtype=dtype, device=device)        # [1, C=Q, F]
        self.offsets = torch.arange(block, device=device)
        self.cols = torch.arange(kv_len, device=device)
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.neg_inf = torch.full((), float("-inf"), dtype=dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None


class DraftRunner:
    """The drafter's per-round pass at a fixed shape: the block [bonus, MASK x (Q-1)] plus up to Q new
    context features (zero-padded; the padding's k/v land past the context and are overwritten next
    round). The block's own k/v are written right after the context (over that padding), so attention
    reads the first kv_len drafter-cache entries with a device-built bias and nothing is concatenated.
    Graphed on CUDA per kv_len bucket. The first round after a prefill, whose new context is the whole
    prompt, runs eagerly (engine._draft_prompt)."""

    def __init__(self, target: Qwen3ForCausalLM, drafter, cache: KVCache, block: int, mask_token_id: int,
                 device: torch.device) -> None:
        self.target, self.drafter, self.cache, self.block = target, drafter, cache, block
        self.mask_token_id, self.device = mask_token_id, device
        self.feat_dim = drafter.fc.in_features
        self.use_graphs = device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.buckets: dict[int, _DraftBucket] = {}

    @staticmethod
    def capacity_for(max_context: int, block: int) -> int:
        """The context, up to one block of padding rows after it, and the block itself."""
        return -(-(max_context + 2 * block) // KV_BUCKET) * KV_BUCKET

    def run(self, bonus: torch.Tensor, length: torch.Tensor, rows: torch.Tensor, feats: torch.Tensor,
            start: int) -> torch.Tensor:
        """The pass after a round, from device values, so it is queued before the round's result reaches
        the host: bonus [1] (the round's next token), and the target features feats[0, rows[:length]]
        ([1, N, F], rows [Q] long) of the `length` context positions from `start` on. Returns logits
        [Q-1, V] for depths 1..Q-1 (a view of a static buffer: use it before the next run)."""
        kv_len = kv_len_for(start + 2 * self.block, self.cache.capacity, self.use_graphs)
        b = self.buckets.get(kv_len)
        if b is None:
            b = self.buckets[kv_len] = _DraftBucket(self.block, self.feat_dim, kv_len, self.device,
                                                    self.cache.k.dtype, self.mask_token_id)
        b.ids[0, :1].copy_(bonus)
        b.start.fill_(start)
        torch.add(length, start, out=b.n)
        torch.index_select(feats[0], 0, rows, out=b.feats[0])
        b.feats[0].masked_fill_((b.offsets >= length)[:, None], 0)  # rows past the path: zero padding
        if not self.use_graphs:
            return self._forward(b)
        if b.graph is None:
            b.graph, b.out = capture(lambda: self._forward(b), self.device, self.pool)
        b.graph.replay()
        return b.out

    def _forward(self, b: _DraftBucket) -> torch.Tensor:
        block_pos = (b.n + b.offsets)[None]                     # [1, Q] the block follows the context
        ctx_pos = (b.start + b.offsets)[None]                   # [1, C] where the new context sits
        allowed = b.cols < b.n + self.block                     # [L] the context, then the block
        bias = torch.where(allowed, b.zero, b.neg_inf)[None, None, None]
        emb = self.target.model.embed_tokens(b.ids)             # [1, Q, H]
        h = self.drafter(emb, block_pos, b.feats, ctx_pos, self.cache, mask=bias,
                         static=(ctx_pos[0], block_pos[0], b.kv_len))
        return self.target.logits(h[0, 1:])

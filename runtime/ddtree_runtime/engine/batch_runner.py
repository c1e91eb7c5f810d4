"""The target's and the drafter's passes over a batch of requests, one cache row (slot) each.

The batched forms of runner.py's passes: row b of a pass is request b's tree (AR: the root alone) at
its own start, attending over its own cache row with its own bias, so rows never see each other. All
rows are padded to one tree bucket T and the batch to a batch bucket B (pad rows sit on idle slots,
at the far end of the cache, and are never committed). A pass of B x T rows shares each weight GEMM,
which is where batching pays. On CUDA each (B, T, kv_len) shape is captured once as a graph."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..model import Qwen3ForCausalLM
from ..model.dflash import DraftInputs
from ..model.layers import TreeInputs
from .graphs import capture
from .kv_cache import KVCache
from .runner import kv_len_for, tree_bucket
from .tree import Tree, ancestor_mask


def batch_bucket(n: int, slots: int) -> int:
    """The batch size a pass of n rows runs at: the next power of two, at most the pool's slots."""
    return min(slots, 1 << max(0, n - 1).bit_length())


class BatchPass(NamedTuple):
    """A batched tree pass's outputs and trees, on the device (views of static buffers)."""
    logits: torch.Tensor          # [B, T, V] in the model's dtype (float32 on the CPU)
    feats: torch.Tensor | None    # [B, T, F]
    tokens: torch.Tensor          # [B, T]
    parents: torch.Tensor         # [B, T]
    depths: torch.Tensor          # [B, T]
    mask: torch.Tensor            # [B, T, T]
    start: torch.Tensor           # [B] each row's first slot


def stage(dst: torch.Tensor, host: torch.Tensor, values: list[int]) -> None:
    """Copy host ints into a device tensor without waiting for the device: through `host`, a pinned
    buffer on CUDA (a pageable copy would wait for all queued work). The caller reuses `host` only once
    the copy is done: after a read queued behind it has been waited for."""
    host[:len(values)] = torch.tensor(values, dtype=torch.long)
    dst.copy_(host[:len(values)], non_blocking=True)


class _Bucket:
    def __init__(self, batch: int, size: int, kv_len: int, pad_start: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.batch, self.size, self.kv_len = batch, size, kv_len
        # ids | parents | depths as [3, B, T], then start [B]; `layout` is the padding (as runner.py's:
        # padding nodes hold token 0 at depth 0 and are their own parents; pad rows start at pad_start)
        self.layout = torch.zeros(3 * batch * size + batch, dtype=torch.long, device=device)
        self.layout[:3 * batch * size].view(3, batch, size)[1] = torch.arange(size, device=device)
        self.layout[3 * batch * size:] = pad_start
        self.ints = self.layout.clone()
        self.host = torch.zeros(2 * batch, dtype=torch.long, pin_memory=device.type == "cuda")
        self.nodes = self.ints[:3 * batch * size].view(3, batch, size)
        self.ids, self.parents, self.depths = self.nodes[0], self.nodes[1], self.nodes[2]   # [B, T]
        self.start = self.ints[3 * batch * size:]                                         # [B]
        self.cols = torch.arange(kv_len, device=device)
        self.rows = torch.arange(size, device=device)
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.neg_inf = torch.full((), float("-inf"), dtype=dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple | None = None


class BatchTargetRunner:
    def __init__(self, target: Qwen3ForCausalLM, cache: KVCache, device: torch.device, max_depth: int) -> None:
        self.target, self.cache, self.device, self.max_depth = target, cache, device, max_depth
        self.use_graphs = device.type == "cuda"
        self.buckets: dict[tuple[int, int, int], _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def run(self, roots: list[int], starts: list[int], trees: list[Tree | None]) -> BatchPass:
        """Row b: root token roots[b] at position starts[b], then trees[b]'s draft nodes (None: an AR
        step), their k/v written to row b's cache slots starts[b]..; nothing here waits for the device."""
        n = len(roots)
        batch = batch_bucket(n, self.cache.slots)
        size = tree_bucket(max(1 if t is None else t.size for t in trees))
        kv_len = kv_len_for(max(starts) + size, self.cache.capacity, self.use_graphs)
        b = self.buckets.get((batch, size, kv_len))
        if b is None:
            b = self.buckets[(batch, size, kv_len)] = _Bucket(batch, size, kv_len, self.cache.capacity - size,
                                                              self.device, self.cache.k.dtype)
        b.ints.copy_(b.layout)
        stage(b.ids[:n, 0], b.host[:batch], roots)
        stage(b.start[:n], b.host[batch:], starts)
        for row, tree in enumerate(trees):
            if tree is not None:
                b.nodes[:, row, 1:tree.size].copy_(tree.nodes)
        if not self.use_graphs:
            out = self._forward(b)
        else:
            if b.graph is None:
                b.graph, b.out = capture(lambda: self._forward(b), self.device, self.pool)
            b.graph.replay()
            out = b.out
        logits, feats, mask = out
        return BatchPass(logits, feats, b.ids, b.parents, b.depths, mask, b.start)

    def _forward(self, b: _Bucket) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        tree = ancestor_mask(b.parents, min(self.max_depth, b.size - 1))    # [B, T, T]
        rel = b.cols[None, :] - b.start[:, None]                             # [B, L] slot relative to the tree
        in_tree = tree.gather(2, rel.clamp(0, b.size - 1)[:, None, :].expand(-1, b.size, -1))  # [B, T, L]
        allowed = (rel < 0)[:, None, :] | ((rel < b.size)[:, None, :] & in_tree)
        bias = torch.where(allowed, b.zero, b.neg_inf)[:, None]              # [B, 1, T, L]
        slots = b.start[:, None] + b.rows                                    # [B, T]
        pos = b.start[:, None] + b.depths                                    # [B, T]
        lengths = (b.start + b.size).clamp(max=b.kv_len)                     # [B] keys past these are masked
        h, feats = self.target(b.ids, pos, self.cache.rows(0, b.batch),
                               static=TreeInputs(slots, bias, b.kv_len, tree, lengths=lengths))
        return self.target.logits(h, float32=False), feats, tree


class _DraftBucket:
    def __init__(self, batch: int, block: int, feat_dim: int, kv_len: int, device: torch.device,
                 dtype: torch.dtype, mask_token_id: int) -> None:
        self.batch, self.kv_len = batch, kv_len
        self.ids = torch.full((batch, block), mask_token_id, dtype=torch.long, device=device)  # [B, Q]
        self.start = torch.zeros(batch, dtype=torch.long, device=device)
        # two staging buffers, used in turn: this pass is queued after the round's read, so only the
        # next round's read covers its copy
        self.host = torch.zeros(2, batch, dtype=torch.long, pin_memory=device.type == "cuda")
        self.turn = 0
        self.n = torch.zeros(batch, dtype=torch.long, device=device)
        self.feats = torch.zeros(batch, block, feat_dim, dtype=dtype, device=device)           # [B, Q, F]
        self.offsets = torch.arange(block, device=device)
        self.cols = torch.arange(kv_len, device=device)
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.neg_inf = torch.full((), float("-inf"), dtype=dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None


class BatchDraftRunner:
    """runner.DraftRunner's per-round pass for a batch: row b is request b's block and new context."""

    def __init__(self, target: Qwen3ForCausalLM, drafter, cache: KVCache, block: int, mask_token_id: int,
                 device: torch.device) -> None:
        self.target, self.drafter, self.cache, self.block = target, drafter, cache, block
        self.mask_token_id, self.device = mask_token_id, device
        self.feat_dim = drafter.fc.in_features
        self.use_graphs = device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.buckets: dict[tuple[int, int], _DraftBucket] = {}

    def run(self, bonus: torch.Tensor, length: torch.Tensor, rows: torch.Tensor, feats: torch.Tensor,
            starts: list[int]) -> torch.Tensor:
        """From a batched walk's device result: bonus, length [B'] (B' >= len(starts): the verify's
        padded batch), rows [B', Q] path nodes, feats [B', T, F] the verify's features; starts: each
        real row's context length before the round. Returns logits [B, Q-1, V] (a static buffer)."""
        n = len(starts)
        batch = rows.shape[0]
        kv_len = kv_len_for(max(starts) + 2 * self.block, self.cache.capacity, self.use_graphs)
        b = self.buckets.get((batch, kv_len))
        if b is None:
            b = self.buckets[(batch, kv_len)] = _DraftBucket(batch, self.block, self.feat_dim, kv_len, self.device,
                                                             self.cache.k.dtype, self.mask_token_id)
        b.ids[:, 0].copy_(bonus)
        pad = self.cache.capacity - 2 * self.block  # pad rows write past any context
        b.turn ^= 1
        stage(b.start, b.host[b.turn], starts + [pad] * (batch - n))
        torch.add(length, b.start, out=b.n)
        torch.gather(feats, 1, rows[..., None].expand(-1, -1, feats.shape[-1]), out=b.feats)
        b.feats.masked_fill_((b.offsets[None, :] >= length[:, None])[..., None], 0)
        if not self.use_graphs:
            return self._forward(b)
        if b.graph is None:
            b.graph, b.out = capture(lambda: self._forward(b), self.device, self.pool)
        b.graph.replay()
        return b.out

    def _forward(self, b: _DraftBucket) -> torch.Tensor:
        block_pos = b.n[:, None] + b.offsets                     # [B, Q] the block follows the context
        ctx_pos = b.start[:, None] + b.offsets                   # [B, C] where the new context sits
        lengths = (b.n + self.block).clamp(max=b.kv_len)          # [B] the keys each row sees
        allowed = b.cols[None, :] < lengths[:, None]             # [B, L]
        bias = torch.where(allowed, b.zero, b.neg_inf)[:, None, None]        # [B, 1, 1, L]
        emb = self.target.model.embed_tokens(b.ids)              # [B, Q, H]
        h = self.drafter(emb, block_pos, b.feats, ctx_pos, self.cache.rows(0, b.batch), mask=bias,
                         static=DraftInputs(ctx_pos, block_pos, b.kv_len, lengths))
        return self.target.logits(h[:, 1:], float32=False)

"""The target's and the drafter's decode-side passes over B rows of the pool (B = 1: a lone request),
on static buffers at bucketed sizes.

Every forward after the prefill is "row b: N tree nodes at positions start_b + depth, each seeing row
b's context and its own ancestors" (an AR step is a one-node tree). Rows are padded to one tree bucket T
and the batch to a batch bucket B (pad rows start at the far end of the cache and are never committed);
a pass of B x T rows shares each weight GEMM, which is where batching pays. The attention bias is built
on the device from each row's start and its tree's ancestor mask (itself built from parent indices), so
nothing in the forward depends on a host-side offset. On CUDA each (B, T, kv_len) shape is captured once
as a CUDA graph and replayed: one launch instead of ~1,500 per forward, which is what bounds an eager 8B
forward on a slow host.

A batch of one keeps the lone request's cheaper forms, as its round was measured: its root and start are
written by fills (no staging copy through pinned memory, and nothing on the host that a queued copy
could still be reading while a lone AR step runs ahead), and the forward takes the model's and the
kernels' one-sequence forms (one row of slots, no per-row key lengths)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..capacity import TREE_BUCKETS  # root + 2^k draft nodes, and 2^k (declared there: the pool is sized by them)
from ..model import Qwen3ForCausalLM
from ..model.dflash import DraftInputs, DraftMask
from ..model.gdn_chunk import PaddedPrompt
from ..model.kernels import DECODE_EAGER
from ..model.layers import TreeInputs
from .graphs import replayed
from .kv_cache import HybridCache, KVCache
from .tree import Tree, ancestor_mask
from .types import BatchStats

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


def batch_bucket(n: int, slots: int) -> int:
    """The batch size a pass of n rows runs at: the next power of two, at most the pool's slots."""
    return min(slots, 1 << max(0, n - 1).bit_length())


def stage(dst: torch.Tensor, host: torch.Tensor, values: list[int]) -> None:
    """Copy host ints into a device tensor without waiting for the device: through `host`, a pinned
    buffer on CUDA (a pageable copy would wait for all queued work). The caller reuses `host` only once
    the copy is done: after a read queued behind it has been waited for."""
    host[:len(values)] = torch.tensor(values, dtype=torch.long)
    dst.copy_(host[:len(values)], non_blocking=True)


class TreePass(NamedTuple):
    """A tree pass's outputs and trees for the batch bucket's rows (those past the request's are
    padding), on the device: views of static buffers, used before the next pass of that shape."""
    logits: torch.Tensor          # [B, T, V] in the model's dtype (its readers convert where they compute)
    feats: torch.Tensor | None    # [B, T, F], None without feature layers
    tokens: torch.Tensor          # [B, T]
    parents: torch.Tensor         # [B, T]
    depths: torch.Tensor          # [B, T]
    mask: torch.Tensor            # [B, T, T] ancestor-or-self
    start: torch.Tensor           # [B] each row's first slot


class _Bucket:
    """Static inputs and outputs of one (batch, tokens, kv_len) shape, plus its CUDA graph once captured."""

    def __init__(self, batch: int, size: int, kv_len: int, pad_start: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.batch, self.size, self.kv_len = batch, size, kv_len
        # ids | parents | depths as [3, B, T], then start [B], in one int64 vector written by device ops
        # only. `layout` is the padding: padding nodes hold token 0 at depth 0 and are their own parents,
        # so they see only the context and themselves and no real node sees them; pad rows start at
        # pad_start, past any context
        self.layout = torch.zeros(3 * batch * size + batch, dtype=torch.long, device=device)
        self.layout[:3 * batch * size].view(3, batch, size)[1] = torch.arange(size, device=device)
        self.layout[3 * batch * size:] = pad_start
        self.ints = self.layout.clone()
        self.host = torch.zeros(2 * batch, dtype=torch.long, pin_memory=device.type == "cuda")
        self.nodes = self.ints[:3 * batch * size].view(3, batch, size)
        self.ids, self.parents, self.depths = self.nodes[0], self.nodes[1], self.nodes[2]   # [B, T]
        self.start = self.ints[3 * batch * size:]                                         # [B]
        self.cols = torch.arange(kv_len, device=device)                                   # [L]
        self.rows = torch.arange(size, device=device)                                     # [T]
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.neg_inf = torch.full((), float("-inf"), dtype=dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None


class TargetRunner:
    def __init__(self, target: Qwen3ForCausalLM, cache: KVCache, device: torch.device, max_depth: int,
                 stats: BatchStats | None = None) -> None:
        """max_depth: the deepest tree node the engine will pass (bounds the device-side mask build);
        stats: where each graph capture is counted (the engine's; by default the runner's own)."""
        self.target, self.cache, self.device, self.max_depth = target, cache, device, max_depth
        self.stats = BatchStats() if stats is None else stats
        self.use_graphs = device.type == "cuda"
        self.buckets: dict[tuple[int, int, int], _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    @staticmethod
    def capacity_for(max_context: int, tree_slots: int) -> int:
        """Cache slots needed: the context, the padded tree, rounded up to a whole kv bucket."""
        return -(-(max_context + tree_bucket(tree_slots)) // KV_BUCKET) * KV_BUCKET

    def run(self, roots: list[int] | torch.Tensor, starts: list[int], trees: list[Tree | None]) -> TreePass:
        """Row b (the pool's row b): root token roots[b] (host ints, or a [B] device tensor: a lone AR
        step run ahead from the device's token) at position starts[b], then trees[b]'s draft nodes
        (None: an AR step, the root alone) at starts[b] + their depths, below their parents; their k/v
        go to row b's cache slots starts[b].., each node seeing its row's context and its own
        ancestors. Nothing here waits for the device."""
        n = len(starts)
        batch = batch_bucket(n, self.cache.slots)
        sizes = [1 if tree is None else tree.size for tree in trees]
        size = tree_bucket(max(sizes))
        kv_len = kv_len_for(max(starts) + size, self.cache.capacity, self.use_graphs)
        b = self.buckets.get((batch, size, kv_len))
        if b is None:
            b = self.buckets[(batch, size, kv_len)] = _Bucket(batch, size, kv_len, self.cache.capacity - size,
                                                              self.device, self.cache.k.dtype)
        if n < batch or min(sizes) < size:
            b.ints.copy_(b.layout)  # the padding, over whatever bigger trees or more rows left in this bucket
        if isinstance(roots, torch.Tensor):
            b.ids[:n, 0].copy_(roots)
        elif batch == 1:
            b.ids[:1, 0].fill_(roots[0])
        else:
            stage(b.ids[:n, 0], b.host[:batch], roots)
        if batch == 1:
            b.start.fill_(starts[0])
        else:
            stage(b.start[:n], b.host[batch:], starts)
        for row, tree in enumerate(trees):
            if tree is not None:
                b.nodes[:, row, 1:tree.size].copy_(tree.nodes)
        logits, feats, mask = replayed(b, self._forward, self.device, self.pool, self.stats)
        return TreePass(logits, feats, b.ids, b.parents, b.depths, mask, b.start)

    def _forward(self, b: _Bucket) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        tree = ancestor_mask(b.parents, min(self.max_depth, b.size - 1))    # [B, T, T]
        rel = b.cols[None, :] - b.start[:, None]                             # [B, L] slot relative to the tree
        in_tree = tree.gather(2, rel.clamp(0, b.size - 1)[:, None, :].expand(-1, b.size, -1))  # [B, T, L]
        allowed = (rel < 0)[:, None, :] | ((rel < b.size)[:, None, :] & in_tree)  # context, or an ancestor
        bias = torch.where(allowed, b.zero, b.neg_inf)[:, None]              # [B, 1, T, L] additive
        slots = b.start[:, None] + b.rows                                    # [B, T]
        pos = b.start[:, None] + b.depths                                    # [B, T]
        if b.batch == 1:  # one sequence: the model's shared-slots form, the kernel's full bucket
            static = TreeInputs(slots[0], bias, b.kv_len, tree[0])
        else:  # keys past a row's tree are masked: the one-query kernel stops reading there
            lengths = (b.start + b.size).clamp(max=b.kv_len)                 # [B]
            static = TreeInputs(slots, bias, b.kv_len, tree, lengths=lengths)
        h, feats = self.target(b.ids, pos, self.cache.rows(0, b.batch), static=static)
        return self.target.logits(h, float32=False), feats, tree


# The widths a short prompt pass is padded to (PrefillRunner): a second turn's few hundred new tokens
# after a reused prefix (a chat turn's ~260 pads to 384, not 512: its attention and recurrence scale with
# the width). A longer piece is a plain causal pass (its GEMMs, not the host, set its time).
PREFILL_WIDTHS = (32, 64, 128, 256, 384, 512)


def prefill_width(tokens: int) -> int | None:
    """The width bucket a piece of `tokens` prompt tokens runs at (None: too long for one)."""
    return next((w for w in PREFILL_WIDTHS if tokens <= w), None)


def prefill_kv_len(end: int, capacity: int, graphed: bool) -> int:
    """The keys a short prompt pass attends over to reach position `end`. Graphed, a power of two times
    KV_BUCKET: a graph per width and doubling (a few dozen at most), not per 512 keys; the keys past
    `end` are masked, and reading them costs little beside the pass's GEMMs."""
    if not graphed:
        return kv_len_for(end, capacity, False)
    keys = KV_BUCKET
    while keys < end:
        keys *= 2
    return min(capacity, keys)


class _PrefillBucket:
    """Static inputs of one (width, kv_len, keeps) short prompt pass over one row, its CUDA graph once
    captured. `keeps`: the pass keeps a hybrid's state at an offset within it (the snapshot)."""

    def __init__(self, width: int, kv_len: int, keeps: bool, bounded: bool, cache: KVCache,
                 device: torch.device) -> None:
        self.width, self.kv_len, self.keeps, self.bounded = width, kv_len, keeps, bounded
        self.ids = torch.zeros(1, width, dtype=torch.long, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        # a hybrid's: the row (its linear layers' state is read and written by this index), the real
        # tokens, the snapshot's offset
        self.row, self.length, self.keep = (torch.zeros(1, dtype=torch.long, device=device) for _ in range(3))
        self.host = torch.zeros(width, dtype=torch.long, pin_memory=device.type == "cuda")
        # marks the last copy out of `host`: written again only once that is done (it always is by the
        # next pass of this shape, a step or more later, so the wait costs nothing)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self.offsets = torch.arange(width, device=device)
        self.cols = torch.arange(kv_len, device=device)
        # the row's block table, copied in before each pass: the graph reads this buffer, whichever row
        # the request holds (a hybrid's state of every row stays in the view, indexed by `row`)
        self.view = cache.rows(0, cache.slots)
        self.view.block = cache.block[:1].clone()
        self.zero = torch.zeros((), dtype=cache.k.dtype, device=device)
        self.neg_inf = torch.full((), float("-inf"), dtype=cache.k.dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None


class PrefillRunner:
    """A lone piece of a prompt of up to PREFILL_WIDTHS[-1] tokens at a fixed shape: padded to a width
    bucket, its keys to a kv bucket, its row's block table copied into a static one (the cache is
    paged), so on CUDA each (width, kv_len) is captured once as a CUDA graph and replayed (a 64-layer
    eager pass costs ~130 ms of host launches at any width; its GEMMs, a few ms). The padding's k/v land
    past the piece, where the next piece or the first round writes over them before anything reads
    them (past a row's pages: the scratch page). Causal within the piece, over the row's cached prefix.
    A hybrid's linear layers run the chunked form with the padding's gates and betas zeroed, so their
    state passes through it unchanged (gdn_chunk.padded_chunk_gated_delta), and a piece that holds the
    prompt's snapshot point keeps the state there within the pass (a graph of its own per shape)."""

    def __init__(self, target: Qwen3ForCausalLM, cache: KVCache, device: torch.device,
                 stats: BatchStats | None = None, pool=None) -> None:
        """pool: the graph memory pool to capture into (the verify's: its passes and these never run at
        once, and what one leaves is read before the other runs); None on the CPU."""
        self.target, self.cache, self.device = target, cache, device
        self.stats = BatchStats() if stats is None else stats
        self.use_graphs = device.type == "cuda"
        self.pool = pool if pool is not None or not self.use_graphs else torch.cuda.graph_pool_handle()
        self.hybrid = isinstance(cache, HybridCache)
        self.buckets: dict[tuple[int, int, bool, bool], _PrefillBucket] = {}

    def run(self, row: int, tokens: list[int], start: int,
            keep_at: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Prompt tokens at positions start.. of cache row `row` -> hidden [1, W, H], features
        [1, W, F] (None without feature layers) and positions [1, W], W the width bucket (the first
        len(tokens) real). `keep_at` (a hybrid's, 1..len(tokens)): the row's snapshot takes the state
        after that many of the tokens (Piece.keep_at). Nothing here waits for the device."""
        width = prefill_width(len(tokens))
        kv_len = prefill_kv_len(start + width, self.cache.capacity, self.use_graphs)
        # the padding's keys fit the bucket (not at a row's end of capacity): attention may stop at them
        key = (width, kv_len, keep_at is not None, start + width <= kv_len)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _PrefillBucket(*key, self.cache, self.device)
        if b.copied is not None:
            b.copied.synchronize()
        stage(b.ids[0], b.host, tokens + [0] * (width - len(tokens)))
        if b.copied is not None:
            b.copied.record()
        b.start.fill_(start)
        b.view.block.copy_(self.cache.block[row:row + 1])
        if self.hybrid:
            b.row.fill_(row)
            b.length.fill_(len(tokens))
            if keep_at is not None:
                b.keep.fill_(keep_at)
        return replayed(b, self._forward, self.device, self.pool, self.stats)

    def _forward(self, b: _PrefillBucket) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        pos = b.start[:, None] + b.offsets[None]                                   # [1, W]
        bias = torch.where(b.cols[None, None, None, :] > pos[:, None, :, None], b.neg_inf, b.zero)  # [1, 1, W, L]
        slots = pos.clamp(max=self.cache.capacity - 1)
        launch = None if self.use_graphs else DECODE_EAGER
        prompt = None
        if self.hybrid:
            prompt = PaddedPrompt(b.row, b.start > 0, b.length, b.keep if b.keeps else None)
        # the keys the pass's last query may attend: attention reads no further (layers.attend_static)
        lengths = b.start + b.width if b.bounded else None
        h, feats = self.target(b.ids, pos, b.view, static=TreeInputs(slots, bias, b.kv_len, None, lengths=lengths,
                                                                      launch=launch, prompt=prompt))
        return h, feats, pos


class _DraftBucket:
    def __init__(self, batch: int, block: int, feat_dim: int, kv_len: int, device: torch.device,
                 dtype: torch.dtype, mask_token_id: int) -> None:
        self.batch, self.kv_len = batch, kv_len
        self.ids = torch.full((batch, block), mask_token_id, dtype=torch.long, device=device)  # [B, Q]
        self.start = torch.zeros(batch, dtype=torch.long, device=device)  # context already in the cache
        # two staging buffers, used in turn: this pass is queued after the round's read, so only the
        # next round's read covers its copy
        self.host = torch.zeros(2, batch, dtype=torch.long, pin_memory=device.type == "cuda")
        self.turn = 0
        self.n = torch.zeros(batch, dtype=torch.long, device=device)      # context length after this pass
        self.feats = torch.zeros(batch, block, feat_dim, dtype=dtype, device=device)           # [B, Q, F]
        self.offsets = torch.arange(block, device=device)
        self.row_base = torch.arange(batch, device=device)[:, None]         # [B, 1]
        self.cols = torch.arange(kv_len, device=device)
        self.dtype = dtype
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None


class DraftRunner:
    """The drafter's per-round pass for B rows at a fixed shape: row b's block [bonus, MASK x (Q-1)]
    plus up to Q new context features (zero-padded; the padding's k/v land past the context and are
    overwritten next round). The block's own k/v are written right after the context (over that
    padding), so attention reads the first kv_len drafter-cache entries with a device-built bias and
    nothing is concatenated. Graphed on CUDA per (B, kv_len). The first pass after a prefill, whose new
    context is the whole prompt, runs eagerly (model_runner.py)."""

    def __init__(self, target: Qwen3ForCausalLM, drafter, cache: KVCache, block: int, mask_token_id: int,
                 device: torch.device, stats: BatchStats | None = None) -> None:
        self.target, self.drafter, self.cache, self.block = target, drafter, cache, block
        self.stats = BatchStats() if stats is None else stats  # where each graph capture is counted
        self.mask_token_id, self.device = mask_token_id, device
        self.feat_dim = drafter.fc.in_features
        self.use_graphs = device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.buckets: dict[tuple[int, int], _DraftBucket] = {}

    @staticmethod
    def capacity_for(max_context: int, block: int) -> int:
        """The context, up to one block of padding rows after it, and the block itself."""
        return -(-(max_context + 2 * block) // KV_BUCKET) * KV_BUCKET

    def run(self, bonus: torch.Tensor, length: torch.Tensor, rows: torch.Tensor, feats: torch.Tensor,
            starts: list[int]) -> torch.Tensor:
        """The pass after a round, from the walk's device result, so it is queued before the result
        reaches the host: bonus, length [B'] (B' >= len(starts): the verify's batch bucket) the round's
        next tokens and path lengths, rows [B', Q] the path nodes whose features feats [B', T, F] are
        the new context; starts: each real row's context length before the round. Returns logits
        [B', Q-1, V] for depths 1..Q-1 (a static buffer: use it before the next run)."""
        n, batch = len(starts), rows.shape[0]
        kv_len = kv_len_for(max(starts) + 2 * self.block, self.cache.capacity, self.use_graphs)
        b = self.buckets.get((batch, kv_len))
        if b is None:
            b = self.buckets[(batch, kv_len)] = _DraftBucket(batch, self.block, self.feat_dim, kv_len, self.device,
                                                             self.cache.k.dtype, self.mask_token_id)
        b.ids[:, 0].copy_(bonus)
        if batch == 1:
            b.start.fill_(starts[0])
        else:
            pad = self.cache.capacity - 2 * self.block  # pad rows write past any context
            b.turn ^= 1
            stage(b.start, b.host[b.turn], starts + [pad] * (batch - n))
        torch.add(length, b.start, out=b.n)
        # whole feature rows by one index_select (a gather along dim 1 indexes every element: ~0.2 ms at
        # 16 rows of the 27B's 25,600 features on an H200)
        flat = (rows + b.row_base * feats.shape[1]).reshape(-1)
        torch.index_select(feats.reshape(-1, feats.shape[-1]), 0, flat, out=b.feats.view(-1, feats.shape[-1]))
        b.feats.masked_fill_((b.offsets[None, :] >= length[:, None])[..., None], 0)  # rows past the path
        return replayed(b, self._forward, self.device, self.pool, self.stats)

    def redraft(self, bonus: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """run() with no new context: a draft from what the drafter cache holds (after AR rounds, their
        staged context written), bonus [B'] on the device. The graphed pass: an eager one (a prompt's
        first draft) costs the host ~10 ms of launches at the 27B, which a cost policy's probe paid."""
        batch = bonus.shape[0]
        none = torch.zeros(batch, dtype=torch.long, device=self.device)
        rows = torch.zeros(batch, self.block, dtype=torch.long, device=self.device)
        feats = torch.zeros(batch, 1, self.feat_dim, dtype=self.cache.k.dtype, device=self.device)
        return self.run(bonus, none, rows, feats, starts)

    def _forward(self, b: _DraftBucket) -> torch.Tensor:
        block_pos = b.n[:, None] + b.offsets                     # [B, Q] the block follows the context
        ctx_pos = b.start[:, None] + b.offsets                   # [B, C] where the new context sits
        lengths = (b.n + self.block).clamp(max=b.kv_len)          # [B] the keys each row sees
        present = b.cols[None, :] < lengths[:, None]             # [B, L] the context, then the block
        mask = DraftMask(b.cols[None, :], block_pos, present, b.dtype)  # slot = position; per layer kind
        emb = self.target.model.embed_tokens(b.ids)              # [B, Q, H]
        if b.batch == 1:  # one sequence: shared slots, the kernel's full bucket
            static = DraftInputs(ctx_pos[0], block_pos[0], b.kv_len)
        else:
            static = DraftInputs(ctx_pos, block_pos, b.kv_len, lengths)
        h = self.drafter(emb, block_pos, b.feats, ctx_pos, self.cache.rows(0, b.batch), mask=mask, static=static)
        return self.drafter.block_logits(h[:, 1:], self.target, float32=False)

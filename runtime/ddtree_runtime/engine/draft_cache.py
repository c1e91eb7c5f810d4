"""The drafter's cache: its full layers' KV in the pool's pages, its sliding-window layers' in a ring per row.

A sliding layer's query at position p sees keys in (p - window, p] only (drafter_layout.py), so a row
keeps just its last `ring_length(window, block)` positions of those layers (capacity.py): position x
lives in ring slot x mod R. One drafter pass writes at most a block of new context and then the block
past the committed context, so R = window + 2 blocks (rounded up) never overwrites a key a query of the
pass sees. The ring's keys are read whole (R keys however long the context: the drafter's cost of those
layers stops growing with it) under a mask of each slot's position, which the queries' positions give
on the device (model/dflash.DraftMask: the pass's top position T, slot j then holds T - (T - j) mod R),
so the graphed passes need no host value. Positions at or past `pad_from` (pad rows, an AR row's
writes, a prefill group's padding) go to one scratch slot past the ring, never read.

Why a ring and not a second group of pages (vLLM's hybrid allocator): the ring is a fixed per-row cost
like a hybrid target's recurrent state, so it moves, is copied for a reused prefix and kept at the
prompt's snapshot point exactly as that state is (kv_cache.HybridCache), with no second block table, no
page freeing as the window slides and no second prefix-hit condition over pages.

Prefix reuse: a row's ring holds the window before its context's end, and with the prefix cache a
snapshot ring holds the window before its prompt's snapshot point (written by the prefill: positions
below the point go to both). A prompt reusing L tokens of a sequence needs the sliding layers' keys of
positions [P - window + 1, L) for its first draft at P = its length: none when its own prefill covers
them (L <= P - window + 1); else those of the sequence's ring at its end or at its snapshot point, taken
whole into both of the new row's rings (prefix_cache.PrefixCache.lookup decides which, `reach`).

Staged context: an AR round of drafting rows drafts nothing, but the drafter's context must still grow by
the round's root. Writing it every round is one eager write_context (the fc GEMM, the hidden norm, RoPE
and each layer's k/v projection and store: some 30-40 small launches, ~2 ms a round of host time on the
H200 27B). Instead the root's features are staged on the device (`stage`: two index copies, no host
value) and a row's staged positions written in one pass (`flush`) when they fill `stage_len` slots, and
before anything reads the row: the next tree round (model_runner.py), a prefix shared from a running
row or a cached sequence (`copy_page`, `copy_prefix`) and `held`; rows that move take theirs along
(`permute`), a row left for good forgets it (`leave`, `drop`). What is written is the same features at
the same positions as the eager writes (the values the same but for rounding: the GEMMs of a block of
positions run at another shape than one's).

Held prompt context: a step's prompt passes each hand the drafter their features (a hybrid target
prefills its prompts one pass each: 32 eager write_context calls for a burst of 32, 0.78 ms each on the
CPU's tiny pair, 25 ms of a 360 ms prefill). `hold` keeps a pass's features (a copy: a graphed pass's
are static) and `write_held` writes every pass held in one write_context, padded to the widest, before
the step's first drafts and at its end (model_runner.py); a pass whose row is held already, or whose
features would take the held bytes past HELD_BYTES, has the held ones written first (a long piece is
written at once)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..capacity import ring_length
from ..model.config import DFlashConfig
from .block_manager import PageTable
from .kv_cache import KVCache, PagedLayer

HELD_BYTES = 64 << 20  # prompt passes' features held for one write at most (a 27B's: ~1,300 tokens)


class DraftCache:
    """Layer i of the drafter: a paged layer of `paged` (its full layers, in the pool's pages) or a ring
    (ring_k/ring_v [sliding layers, rows, Hkv, R + 1, D], slot R the scratch slot; snap_k/snap_v the
    snapshot rings with the prefix cache). Methods take the drafter's layer index, as KVCache's do; a
    pass over rows lo..hi-1 works on `rows(lo, hi)`, a view."""

    def __init__(self, cfg: DFlashConfig, block_size: int, table: PageTable, pad_from: int,
                 device: torch.device | str, dtype: torch.dtype, snapshots: bool,
                 write: Callable[[torch.Tensor, torch.Tensor, DraftCache], None] | None = None) -> None:
        """`write`: the drafter's write_context, which `flush` writes the staged context with (None: a
        cache nothing is staged in, as the capacity arithmetic's)."""
        windows = [cfg.layer_attention(i).window for i in range(cfg.num_hidden_layers)]
        full = [i for i, w in enumerate(windows) if w is None]
        sliding = [i for i, w in enumerate(windows) if w is not None]
        self.where = {i: ("paged", j) for j, i in enumerate(full)} | {i: ("ring", j) for j, i in enumerate(sliding)}
        self.paged = KVCache(len(full), cfg.num_key_value_heads, cfg.head_dim, 0, device, dtype, table=table)
        self.window = max((w for w in windows if w is not None), default=0)
        self.ring_size = ring_length(self.window, block_size) if sliding else 0
        self.pad_from = pad_from
        shape = (len(sliding), table.block.shape[0], cfg.num_key_value_heads, self.ring_size + 1, cfg.head_dim)
        self.ring_k = torch.zeros(shape, device=device, dtype=dtype)
        self.ring_v = torch.zeros(shape, device=device, dtype=dtype)
        keep = snapshots and bool(sliding)
        self.snap_k = torch.zeros(shape, device=device, dtype=dtype) if keep else None
        self.snap_v = torch.zeros(shape, device=device, dtype=dtype) if keep else None
        self.snapshot_at: torch.Tensor | None = None  # set on a view for one prefill pass (`until`)
        self._memo: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]] = []
        # each row's staged context: position p's features in slot p mod stage_len (a row's positions are
        # consecutive, one an AR round), its position beside them (the last cache slot, scratch, where
        # none is staged: a flush writes every slot, so the rows need no host-built index); `pending`:
        # how many each row holds (the host's count: a full row is written)
        rows, self.write, self.stage_len = table.block.shape[0], write, block_size
        self.staged = torch.zeros(rows, block_size, len(cfg.target_layer_ids) * cfg.hidden_size, device=device,
                                  dtype=dtype)
        self.staged_at = torch.full((rows, block_size), self.capacity - 1, dtype=torch.long, device=device)
        self.pending = [0] * rows
        self._stage_base = torch.arange(rows, device=device) * block_size
        # prompt passes' context held for one write: (first row, features [n, W, F], slots [n, W], points)
        self._held: list[tuple[int, torch.Tensor, torch.Tensor, list[int]]] = []
        self._held_bytes = 0

    # ---- what the rest of the engine reads --------------------------------------------------------

    @property
    def reach(self) -> int:
        """Positions before a prompt's end whose sliding keys its first draft reads (0: no sliding layer)."""
        return self.window - 1 if self.ring_size else 0

    @property
    def k(self) -> torch.Tensor:  # the dtype's carrier for the runners (the pages' tensor)
        return self.paged.k

    @property
    def capacity(self) -> int:
        return self.paged.capacity

    @property
    def slots(self) -> int:
        return self.paged.slots

    def windowed(self, layer: int) -> bool:
        """Whether layer `layer` lives in a ring (its attention reads ring_size keys, every slot)."""
        return self.where[layer][0] == "ring"

    def rows(self, lo: int, hi: int) -> DraftCache:
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view.paged = self.paged.rows(lo, hi)
        for name in ("ring_k", "ring_v", "snap_k", "snap_v"):
            t = getattr(self, name)
            setattr(view, name, None if t is None else t[:, lo:hi])
        view.snapshot_at, view._memo = None, []
        return view

    # ---- the staged context of AR rounds -----------------------------------------------------------

    def stage(self, feats: torch.Tensor, pos: torch.Tensor, drafting: list[bool], first_row: int = 0) -> None:
        """An AR round of n rows from first_row on: the root features feats [n, F] at positions pos [n] (on
        the device), kept for the rows that draft (an AR request's drafter context stays what it inherited). Nothing
        waits for the device (with every row drafting, no host tensor at all); a row that fills its
        stage_len slots has the batch written (`flush`)."""
        if not all(drafting):
            pos = torch.where(torch.tensor(drafting, device=pos.device), pos, self.capacity - 1)
        rows = slice(first_row, first_row + len(drafting))
        at = self._stage_base[rows] + pos % self.stage_len
        self.staged.view(-1, self.staged.shape[-1]).index_copy_(0, at, feats)
        self.staged_at.view(-1).index_copy_(0, at, pos)
        for row, drafts in enumerate(drafting, start=first_row):
            self.pending[row] += drafts
        if max(self.pending[rows]) >= self.stage_len:
            self.flush()

    def flush(self) -> None:
        """Write every row's staged context into the cache: one write_context over the rows that hold
        any (their slots with nothing staged write to the scratch slot); held prompt context first."""
        self.write_held()
        rows = [row for row, count in enumerate(self.pending) if count]
        if not rows:
            return
        lo, hi = rows[0], rows[-1] + 1
        self.write(self.staged[lo:hi], self.staged_at[lo:hi], self.rows(lo, hi))
        self.drop(lo, hi)

    def hold(self, first_row: int, feats: torch.Tensor, slots: torch.Tensor, points: list[int]) -> None:
        """A prompt pass's context for rows first_row.. (features feats [n, W, F] at cache positions
        slots [n, W], positions below points[i] also in row i's snapshot ring), kept to be written with
        the step's other passes' (`write_held`); written at once when too big to hold."""
        size = feats.numel() * feats.element_size()
        rows = range(first_row, first_row + feats.shape[0])
        if self._held_bytes + size > HELD_BYTES or any(lo <= r < lo + f.shape[0] for lo, f, _, _ in self._held
                                                       for r in rows):
            self.write_held()
        if size > HELD_BYTES:
            self.write(feats, slots, self.rows(rows.start, rows.stop).until(points))
            return
        self._held.append((first_row, feats.clone(), slots, points))
        self._held_bytes += size

    def write_held(self) -> None:
        """Every held prompt pass's context in one write_context over the rows from the first held to
        the last (rows between write to the scratch slot)."""
        if not self._held:
            return
        held, self._held, self._held_bytes = self._held, [], 0
        if len(held) == 1:
            first, feats, slots, points = held[0]
            self.write(feats, slots, self.rows(first, first + feats.shape[0]).until(points))
            return
        lo, hi = min(h[0] for h in held), max(h[0] + h[1].shape[0] for h in held)
        width, sample = max(h[1].shape[1] for h in held), held[0][1]
        feats = sample.new_zeros(hi - lo, width, sample.shape[2])
        slots = torch.full((hi - lo, width), self.capacity - 1, dtype=torch.long, device=sample.device)
        points = [0] * (hi - lo)
        for first, f, s, p in held:
            n, w = f.shape[:2]
            feats[first - lo:first - lo + n, :w] = f
            slots[first - lo:first - lo + n, :w] = s
            points[first - lo:first - lo + n] = p
        self.write(feats, slots, self.rows(lo, hi).until(points))

    def drop(self, lo: int, hi: int | None = None) -> None:
        """Forget rows lo..hi-1's staged context (written, or of a request gone: a row freed, one
        preempted, which is recomputed whole)."""
        hi = lo + 1 if hi is None else hi
        self.staged_at[lo:hi] = self.capacity - 1
        self.pending[lo:hi] = [0] * (hi - lo)

    def leave(self, row: int, cached: bool) -> None:
        """A request leaves row `row`: its staged context is forgotten unless the row stays as a cached
        sequence, whose staged context stays (it moves with the row, and a prompt reusing it has it
        written first: copy_page, copy_prefix; an eviction forgets it). Before, each departure wrote
        every row's: 29 ms of 48 departures for the hybrid tiny pair at 32 running on the CPU."""
        if not cached:
            self.drop(row)

    def until(self, points: list[int]) -> DraftCache:
        """This view, for one prefill pass whose positions below points[b] also go to row b's snapshot
        ring (no snapshots kept: unchanged)."""
        if self.snap_k is not None:
            self.snapshot_at = torch.tensor(points, device=self.ring_k.device)
        return self

    # ---- the model's reads and writes (KVCache's methods, by drafter layer) -------------------------

    def put_at(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kind, j = self.where[layer]
        if kind == "paged":
            self.paged.put_at(j, slots, k, v)
            return
        self._scatter(self.ring_k[j], self.ring_v[j], self._ring_slots(slots, None), k, v)
        if self.snapshot_at is not None:
            self._scatter(self.snap_k[j], self.snap_v[j], self._ring_slots(slots, self.snapshot_at), k, v)

    def kernel_target(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The fused RoPE + KV-write kernel's target (KVCache.kernel_target); None where a write goes to
        two rings (a prefill pass with snapshots: put_at writes both)."""
        kind, j = self.where[layer]
        if kind == "paged":
            return self.paged.kernel_target(j, slots)
        if self.snapshot_at is not None:
            return None
        return self.ring_k[j], self.ring_v[j], self._ring_slots(slots, None)

    def pages(self, layer: int) -> PagedLayer | None:
        kind, j = self.where[layer]
        return self.paged.pages(j) if kind == "paged" else None

    def view(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A paged layer's first `length` positions; a ring layer's whole ring (its mask is over slots)."""
        kind, j = self.where[layer]
        if kind == "paged":
            return self.paged.view(j, length)
        return self.ring_k[j][:, :, :self.ring_size], self.ring_v[j][:, :, :self.ring_size]

    def _ring_slots(self, pos: torch.Tensor, below: torch.Tensor | None) -> torch.Tensor:
        """Positions pos ([T] or [B, T]) -> ring slots [B, T]: pos mod R, or the scratch slot R for a
        position at or past pad_from (or `below`), and for one an R later position of the same write
        overwrites (a prefill piece longer than the ring keeps its last R). Mapped once per pass's
        positions tensor, as KVCache._physical."""
        key = (pos,) if below is None else (pos, below)
        for known, slots in self._memo:
            if len(known) == len(key) and all(a is b for a, b in zip(known, key)):
                return slots
        rows = self.ring_k.shape[1]
        flat = pos.expand(rows, -1) if pos.dim() == 1 else pos
        kept = flat < self.pad_from
        if below is not None:
            kept = kept & (flat < below[:, None])
        top = torch.where(kept, flat, -1).amax(dim=1, keepdim=True)
        kept = kept & (flat > top - self.ring_size)
        slots = torch.where(kept, flat % self.ring_size, self.ring_size)
        self._memo = [(key, slots), *self._memo[:3]]
        return slots

    @staticmethod
    def _scatter(ring_k: torch.Tensor, ring_v: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """k, v [B, Hkv, T, D] into rings [B, Hkv, R + 1, D] at slots [B, T]."""
        index = slots[:, None, :, None].expand_as(k)
        ring_k.scatter_(2, index, k)
        ring_v.scatter_(2, index, v)

    # ---- rows: moved, copied for a reused prefix, shown ---------------------------------------------

    def _rings(self) -> list[torch.Tensor]:
        return [t for t in (self.ring_k, self.ring_v, self.snap_k, self.snap_v) if t is not None]

    def copy_page(self, src: int, dst: int, count: int) -> None:
        """A page copied for a shared prefix: a running row's staged context is written first."""
        self.flush()
        self.paged.copy_page(src, dst, count)

    def permute(self, dst: list[int], src: list[int]) -> None:
        """Row dst[i] takes row src[i]'s rings and staged context (the pages move with the block
        tables); a source row that is no destination is cleared, as its block table is (PageTable.move).
        Rows move when a request leaves (`leave` has dealt with its row) or is preempted: the staged
        context moves with its row, to be written when it fills or a tree round reads it."""
        if dst:
            d, s = (torch.tensor(rows, device=self.staged.device) for rows in (dst, src))
            vacated = sorted(set(src) - set(dst))
            for t in self._rings() if self.ring_size else ():
                t.index_copy_(1, d, t.index_select(1, s))
                if vacated:
                    t[:, vacated] = 0
            for t in (self.staged, self.staged_at):
                t.index_copy_(0, d, t.index_select(0, s))
            self.staged_at[vacated] = self.capacity - 1
            pending = list(self.pending)
            for a, b in zip(dst, src):
                pending[a] = self.pending[b]
            for row in vacated:
                pending[row] = 0
            self.pending = pending

    def copy_prefix(self, src: int, dst: int, from_snapshot: bool) -> None:
        """Row dst starts from row src's ring at its end, or at its snapshot point (`from_snapshot`), in
        both its rings (its own snapshot point lies past the prefix: the prefill writes the rest). A
        running row's staged context is written first."""
        self.flush()
        if not self.ring_size or (src == dst and not from_snapshot):
            return
        kept = from_snapshot and self.snap_k is not None
        k, v = ((self.snap_k, self.snap_v) if kept else (self.ring_k, self.ring_v))
        k, v = k[:, src].clone(), v[:, src].clone()
        for ring, source in ((self.ring_k, k), (self.ring_v, v), (self.snap_k, k), (self.snap_v, v)):
            if ring is not None:
                ring[:, dst] = source

    def held(self, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s k and v [n_layers, Hkv, length, D] in logical order (tests and diagnostics): a
        ring layer's positions before the window of `length` are not kept (zeros). The staged context
        is written first."""
        self.flush()
        k_paged, v_paged = self.paged.held(row, length) if self.paged.k.shape[0] else (None, None)
        pos = torch.arange(length, device=self.ring_k.device)
        ks, vs = [], []
        for layer in sorted(self.where):
            kind, j = self.where[layer]
            if kind == "paged":
                ks.append(k_paged[j])
                vs.append(v_paged[j])
                continue
            kept = (pos >= length - self.reach)[None, :, None]
            for out, ring in ((ks, self.ring_k), (vs, self.ring_v)):
                got = ring[j, row][:, pos % self.ring_size]
                out.append(torch.where(kept, got, torch.zeros((), dtype=got.dtype, device=got.device)))
        return torch.stack(ks), torch.stack(vs)


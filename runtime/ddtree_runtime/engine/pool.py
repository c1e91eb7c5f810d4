"""The KV pool as the engine uses it: its pages, the rows' block tables, the two caches over them and
the cached sequences that hold pages between requests.

Rows are the engine's batch rows (scheduler.py): the running requests in 0..R-1, the prefilling one
at R, cached sequences in the rows above. A row takes pages as it grows (take_pages), evicting cached
sequences, least recently used first, while too few are free; rows that change places take their
block tables (so both caches' KV), a hybrid's state slots and a sliding drafter's rings along
(move_rows)."""

from __future__ import annotations

from .block_manager import BlockManager, PageTable
from .draft_cache import DraftCache
from .kv_cache import KVCache
from .memory import PoolSizing
from .prefix_cache import CachedSequence, PrefixCache
from .runner import TargetRunner, tree_bucket


class KVPool:
    def __init__(self, pages: BlockManager, page_table: PageTable, prefix: PrefixCache | None,
                 sizing: PoolSizing, max_context: int) -> None:
        self.pages, self.page_table, self.prefix = pages, page_table, prefix
        self.page_size = pages.page_size
        self.sizing, self.max_context = sizing, max_context
        self.target_cache: KVCache | None = None  # set (and re-set by a re-size) by the engine
        self.draft_cache: DraftCache | None = None  # set by attach_drafter
        self.target_slots = 0  # the tree size the target cache was sized for

    def attach_drafter(self, cache: DraftCache) -> None:
        """The drafter's cache; the prefix cache then knows how far before a prompt's end its sliding
        layers read (what a reused prefix must bring along, prefix_cache.PrefixCache.lookup)."""
        self.draft_cache = cache
        if self.prefix is not None:
            self.prefix.draft_reach = cache.reach

    def holds(self, tree_slots: int) -> bool:
        """Whether the target cache's per-row tree scratch takes a tree of `tree_slots` nodes."""
        return self.target_cache.holds(TargetRunner.capacity_for(self.max_context, tree_slots),
                                       tree_bucket(tree_slots))

    def take_pages(self, row: int, tokens: int) -> bool:
        """Back `row`'s positions 0..tokens-1 with pages, evicting cached sequences (least recently
        used first) while too few are free; False when even that is not enough."""
        while not self.page_table.grow(row, tokens):
            victim = None if self.prefix is None else self.prefix.least_recent(spare=())
            if victim is None:
                return False
            self.evict(victim)
        return True

    def keep_free(self, pages: int, spare: CachedSequence) -> None:
        """Evict cached sequences other than `spare` (least recently used first) until `pages` are free."""
        while self.pages.free_pages < pages:
            victim = self.prefix.least_recent(spare=(spare,))
            if victim is None:
                return
            self.evict(victim)

    def evict(self, seq: CachedSequence) -> None:
        self.leave_row(seq.row, cached=False)
        self.page_table.release(seq.row)
        self.prefix.evict(seq)

    def evictable_pages(self, spare: CachedSequence | None) -> int:
        """Pages that evicting every cached sequence but `spare` would free."""
        if self.prefix is None:
            return 0
        refs = self.pages.refs
        return sum(refs[p] == 1 for seq in self.prefix.by_row.values() if seq is not spare
                   for p in self.page_table.pages[seq.row])

    def copy_pages(self, pair: tuple[int, int] | None) -> None:
        """A copy-on-write the block table asked for: page dst takes page src's content, in both caches."""
        if pair is not None:
            self.target_cache.copy_page(*pair, self.page_size)
            if self.draft_cache is not None:
                self.draft_cache.copy_page(*pair, self.page_size)

    def copy_prefix(self, src: int, dst: int, length: int, from_snapshot: bool) -> None:
        """Row dst starts from row src's first `length` positions (their pages already shared or
        copied): a hybrid's state and a sliding drafter's rings, at src's end or its snapshot point."""
        self.target_cache.copy_prefix(src, dst, length, from_snapshot)
        if self.draft_cache is not None:
            self.draft_cache.copy_prefix(src, dst, from_snapshot)

    def leave_row(self, row: int, cached: bool) -> None:
        """A request or a cached sequence leaves `row` (finished, cancelled, preempted, evicted; `cached`:
        the row stays as a cached sequence): the drafter's staged context of that row is kept with it or
        forgotten (draft_cache.py)."""
        if self.draft_cache is not None and row >= 0:
            self.draft_cache.leave(row, cached)

    def move_rows(self, dst: list[int], src: list[int], length: int) -> None:
        """Rows change places: their block tables (the KV of both caches comes along), a hybrid's
        state slots (their first `length` positions' worth) and a sliding drafter's rings."""
        self.page_table.move(dst, src)
        self.target_cache.permute(dst, src, length)
        if self.draft_cache is not None:
            self.draft_cache.permute(dst, src)

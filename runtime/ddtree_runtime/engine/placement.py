"""Prefix placement and departures: where an admitted request's row starts from, and what a leaving one
leaves behind.

A request just admitted takes the next row (scheduler.py); a cached sequence lying there moves out of
its way, and the request starts from the running or cached sequence that saves the most prefill: its
full pages by reference, a partial last page copied (prefix_cache.py). A request that leaves after
decoding keeps its row's pages as a cached sequence (moved to the first idle row) when prefix reuse is
on. A part of the Engine (engine.py), on its state: the scheduler, the pool, the target cache."""

from __future__ import annotations

from .prefix_cache import CachedSequence, snapshot_point
from .types import RequestState


class Placement:
    """The Engine's rows at admission and departure (mixed into Engine: its scheduler, pool, caches)."""

    def _release(self, req: RequestState) -> None:
        """Take `req` out; the rows behind it move down, and a request that was decoding leaves its
        row as a cached sequence (moved to the first idle row) when prefix reuse is on."""
        row, keep = req.slot, self.prefix is not None and req in self.scheduler.running and req.n_ctx > 0
        # valid positions of each row that may move (a lone AR request's next pass has written n_ctx)
        valid = {r.slot: r.n_ctx + 1 for r in self.scheduler.running}
        if self.scheduler.prefilling is not None:
            valid[self.scheduler.prefilling.slot] = self.scheduler.prefilling.prefilled
        if keep:  # a cached sequence holds only its own length
            self.page_table.truncate(row, req.n_ctx, writable=False)
        elif row >= 0:
            self.page_table.release(row)
        moves = self.scheduler.leave(req)
        src, dst = [s for s, _ in moves], [d for _, d in moves]
        if keep:
            idle = len(self.scheduler.running) + (self.scheduler.prefilling is not None)  # the freed row
            if idle != row:
                src.append(row)
                dst.append(idle)
            self.prefix.add(idle, (req.prompt_ids + req.produced)[:req.n_ctx], req.snapshot_at,
                            self.scheduler.draft_length(req))
        self.pool.move_rows(dst, src, max((valid[s] for s in src), default=0))
        req.finished = True
        req.drafted = req.ahead = req.ahead_logprobs = req.stop_tensor = None
        self._prefix_stats()

    def _place(self, req: RequestState) -> None:
        """Set up the row of a request just admitted (row = len(running)): move any cached sequence
        there out of its way, and start it from the cached prefix that saves the most prefill."""
        req.placed = True
        row = req.slot
        if self.prefix is not None:
            hit = self.scheduler.lookup(req)
            resident = self.prefix.by_row.get(row)
            if resident is not None:
                self._rehome(resident, hit.seq if hit is not None else None)
            if hit is not None:
                seq = hit.seq
                self.pool.keep_free(1, spare=seq)  # for the partial page's copy
                if seq.row == row:  # taken over where it lies: the request writes past the prefix
                    self.prefix.pop(row)
                    self.pool.copy_pages(self.page_table.truncate(row, hit.length))
                else:  # its full pages by reference, the partial last one copied
                    self.pool.copy_pages(self.page_table.share(seq.row, row, hit.length))
                self.pool.copy_prefix(seq.row, row, hit.length, hit.from_snapshot)
                req.draft_ctx = min(hit.length, seq.draft_len) if self.drafter is not None else 0
                req.prefilled = req.reused = hit.length
            req.snapshot_at = len(req.context)
            if self.prefix.snapshots_only:
                req.snapshot_at = snapshot_point(req.context, self.turn_token, req.reused)
            self._prefix_stats()
        if not self.pool.take_pages(row, len(req.context) + self.sizing.round_reserve(self.scheduler.tree_slots(req))):
            raise RuntimeError(f"request {req.id} was admitted without the pages it needs")  # pages_admit: not reached

    def _rehome(self, seq: CachedSequence, keep: CachedSequence | None) -> None:
        """Move `seq` out of a row an admission needs: to a free idle row; else, if it is `keep` (the
        one being reused), leave it to be taken over in place; else over the least recently used other
        cached sequence (never `keep`), unless `seq` is itself the least recently used: then drop it."""
        occupied = len(self.scheduler.running) + 1  # the running rows and the one being admitted
        free = [r for r in range(occupied, self.rows) if r not in self.prefix.by_row]
        if free:
            dest = free[0]
        elif seq is keep:
            return
        else:
            victim = self.prefix.least_recent(spare=(keep,))
            self.pool.evict(victim)
            if victim is seq:
                return
            dest = victim.row
        self.pool.move_rows([dest], [seq.row], seq.end)
        self.prefix.pop(seq.row)
        seq.row = dest
        self.prefix.by_row[dest] = seq

    def _prefix_stats(self) -> None:
        if self.prefix is not None:
            p, s = self.prefix.stats, self.stats
            s.prefix_lookups, s.prefix_hits, s.prefix_tokens_saved = p.lookups, p.hits, p.tokens_saved
            s.prefix_evictions, s.prefix_cached = p.evictions, len(self.prefix)

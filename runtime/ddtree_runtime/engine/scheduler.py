"""Who runs this step, and what it may take: all of the engine's admission.

The scheduler holds every request the engine has: the waiting queue (first come, first served; a
preempted request goes back to its head), the one prefilling and the running batch. It decides who
is admitted (a free row, and pages for its prompt and a first round: `next_prefill`), reserves the
pages each running request's next round may write, preempting the newest when the pool runs out
(`reserve_round`), and sets the step's budgets (prompt tokens to prefill, each tree's nodes). The
--max-queue bound on the waiting queue is here too (`has_room`): the server asks before it submits,
so its 429 comes from the queue it bounds; the engine itself queues whatever it is given.

Rows are the batch rows of the engine's pool. The running requests always hold rows 0..R-1 in order,
so a batched pass works on the first rows of the pool (a view, no gather); the one request being
prefilled holds row R. When a request leaves, the last running one moves into its row (and the
prefilling one down after it): the engine copies those rows, at most two, once per departure."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .policy import round_budgets
from .pool import KVPool
from .prefill import PREFILL_PIECE
from .prefix_cache import CachedSequence, Hit, TokenView
from .types import BatchStats, RequestState


class Scheduler:
    def __init__(self, slots: int, max_queue: int, pool: KVPool, stats: BatchStats,
                 resize: Callable[[int], None], has_drafter: bool) -> None:
        """`resize(tree_slots)`: the engine's re-size of its target pool for bigger trees (it rebuilds
        the runners over it), done here only when nothing runs."""
        self.slots, self.max_queue = slots, max_queue
        self.pool, self.stats = pool, stats
        self._resize, self._has_drafter = resize, has_drafter
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []   # running[i].slot == i
        self.prefilling: RequestState | None = None
        self._requests: dict[int, RequestState] = {}  # all of the above, by id (the server asks per request)
        self._admissions = 0

    def __len__(self) -> int:
        """Requests in the engine: waiting, prefilling and running."""
        return len(self.waiting) + len(self.running) + (self.prefilling is not None)

    # ---- the queue ----------------------------------------------------------------------------

    def add(self, req: RequestState) -> None:
        self.waiting.append(req)
        self._requests[req.id] = req

    def has_room(self, arriving: int = 0) -> bool:
        """Whether one more request may queue, with `arriving` more on their way: the queue holds
        max_queue requests beyond the rows free now (requests for free rows pass through it)."""
        free = max(0, self.slots - len(self.running) - (self.prefilling is not None))
        return len(self.waiting) + arriving < self.max_queue + free

    def queued(self, request_id: int) -> bool:
        """Whether the request waits for its first admission (a preempted one waiting again was admitted
        before). Requests are first admitted in the order they came."""
        req = self._requests.get(request_id)
        return req is not None and req.admitted < 0

    def find(self, request_id: int) -> RequestState | None:
        return self._requests.get(request_id)

    # ---- the step's budgets -------------------------------------------------------------------

    def tree_slots(self, req: RequestState) -> int:
        return req.mode.tree_slots(req.budget, self.pool.sizing.block_size)

    def prefill_budget(self, prefill_chunk: int) -> int:
        """Prompt tokens this step prefills: a chunk beside running requests (they keep decoding between
        a long prompt's chunks); with nothing decoding there is no one to stall, and a prompt goes in
        pieces as large as prefill.py's."""
        return prefill_chunk if self.running else max(prefill_chunk, PREFILL_PIECE)

    @staticmethod
    def tree_budgets(reqs: list[RequestState], round_nodes: int | None) -> list[int]:
        """Each request's tree budget this round (policy.py)."""
        return round_budgets([req.budget for req in reqs], len(reqs), round_nodes)

    def decoding(self, joined: list[RequestState]) -> list[RequestState]:
        """The requests this step's round runs: those that were running before it (`joined` came in by
        this step's prefill and took the rows after them)."""
        return self.running[:len(self.running) - len(joined)]

    # ---- admission ----------------------------------------------------------------------------

    def next_prefill(self) -> RequestState | None:
        """The request to prefill now: the one in progress, else the head of the queue if a row is
        free and the pool can take it now (`admissible`); first come, first served, so a request that
        must wait holds back the ones behind it. An exception (a re-size that failed) leaves the
        request at the queue's head (`fail_head`)."""
        if self.prefilling is None and self.waiting and len(self.running) < self.slots \
                and self.admissible(self.waiting[0]):
            # the row is taken before the place is given back, so that has_room (read from the server's
            # thread between steps' changes) never counts one more free than there is
            self.prefilling = self.waiting[0]
            self.waiting.popleft()
            self.prefilling.slot = len(self.running)
            self._admissions += 1
            self.prefilling.admitted = self._admissions
        return self.prefilling

    def fail_head(self) -> RequestState:
        """Take the queue's head out (it could not be admitted: its outcome is an error)."""
        failed = self.waiting.popleft()
        del self._requests[failed.id]
        failed.finished = True
        return failed

    def admissible(self, req: RequestState) -> bool:
        """Whether the pool can take `req` now (always: nobody waits for a re-size). A request for a
        bigger tree than the pool holds gets the pool re-sized for it (same rows, bigger trees) when
        nothing else runs; while others run it runs with the largest tree the pool holds, rather than
        hold itself and everyone behind it until the engine drains. A tree changes speed, never the
        text: greedy or seeded (sampling.py), a request's tokens are the same at any budget."""
        slots = self.tree_slots(req)
        if not self.pool.holds(slots):
            if self.running:
                req.budget = self.pool.target_slots - 1
            else:
                self._resize(slots)
        return self.pages_admit(req)

    def pages_admit(self, req: RequestState) -> bool:
        """Whether the pool's pages take `req` now: its context and a first round, less the full pages
        it would share with a running or cached sequence (a partial one is copied into a fresh page),
        out of the free pages and those only cached sequences (but the one it shares) hold, keeping a
        page per running request for their next rounds."""
        pool = self.pool
        need = pool.sizing.request_pages(len(req.context), self.tree_slots(req))
        free = pool.pages.free_pages - len(self.running)
        if need <= free:  # the common case: no lookup, no count (both are host time every step)
            return True
        hit = self.lookup(req, count=False)
        spare = None if hit is None else hit.seq
        shared = 0 if hit is None else hit.length // pool.page_size
        return need - shared <= free + pool.evictable_pages(spare)

    def start_running(self, req: RequestState) -> None:
        """A prefill finished (or its last piece joined a group's pass): the request joins the batch (it
        already holds the next row)."""
        self.running.append(req)
        self.prefilling = None

    # ---- prefix sharing: what a prompt may start from -----------------------------------------

    def lookup(self, req: RequestState, count: bool = True) -> Hit | None:
        """The running or cached sequence that saves the most of req's prefill (None: reuse off)."""
        if self.pool.prefix is None:
            return None
        return self.pool.prefix.lookup(req.context, speculative=req.mode.drafts, live=self._live_sequences(),
                                       count=count)

    def _live_sequences(self) -> list[CachedSequence]:
        """The running requests as sequences a prompt may share pages with: what they have computed (a
        hybrid's only at its prompt snapshot, the one state it keeps)."""
        live = []
        for r in self.running:
            if r.n_ctx == 0:  # joined a prefill group whose pass has not run yet
                continue
            tokens = TokenView(r.prompt_ids, r.produced, r.n_ctx)
            if self.pool.prefix.snapshots_only:
                tokens = TokenView(r.context, [], r.snapshot_at)
            live.append(CachedSequence(r.slot, tokens, r.snapshot_at, self.draft_length(r), live=True))
        return live

    def draft_length(self, req: RequestState) -> int:
        """Positions of req's context whose drafter KV its row holds (a speculative request's all of
        them; an AR request's only what it inherited with a reused prefix)."""
        if not self._has_drafter:
            return 0
        return req.n_ctx if req.mode.drafts else req.draft_ctx

    # ---- the round's pages, and preemption ----------------------------------------------------

    def reserve_round(self) -> None:
        """Before a round, every running request takes the pages its round may write (oldest first);
        when the pool runs out, cached sequences are evicted, then the newest requests preempted."""
        for req in sorted(self.running, key=lambda r: r.admitted):
            need = req.n_ctx + self.pool.sizing.round_reserve(self.tree_slots(req))
            while req.slot >= 0 and not self.pool.take_pages(req.slot, need):
                victim = self._newest_victim(req)
                if victim is None and req.ahead is None and len(self.running) > 1:
                    victim = req  # the others cannot be taken (a pass run ahead): this one waits
                if victim is None:  # submit refused what the whole pool cannot hold: not reached
                    raise RuntimeError(f"request {req.id} needs {need} positions, the KV pool cannot hold them")
                self._preempt(victim)

    def _newest_victim(self, keep: RequestState) -> RequestState | None:
        """The request to preempt for `keep`: the newest admitted, the one prefilling first (a lone AR
        request's pass run ahead, its next token chosen, is not taken: it is never the newest)."""
        candidates = [r for r in (*self.running, self.prefilling)
                      if r is not None and r is not keep and r.ahead is None]
        return max(candidates, key=lambda r: r.admitted, default=None)

    def _preempt(self, req: RequestState) -> None:
        """Give `req`'s pages back and queue it first, to be recomputed from its tokens: the prompt and
        what it produced but the last token, which is again the next round's root (its sampling
        generator goes on where it was, so its output is what it would have been)."""
        self.stats.preemptions += 1
        req.preempted += 1
        if req.produced:
            req.context = req.prompt_ids + req.produced[:-1]
            req.resume_bonus = req.produced[-1]
        self.pool.page_table.release(req.slot)
        moves = self.remove(req)
        self.pool.move_rows([d for _, d in moves], [s for s, _ in moves], 0)
        req.prefilled = req.reused = req.n_ctx = req.draft_ctx = req.snapshot_at = 0
        req.placed = False
        req.drafted = None
        self.waiting.appendleft(req)

    # ---- departures ---------------------------------------------------------------------------

    def leave(self, req: RequestState) -> list[tuple[int, int]]:
        """`req` leaves the engine (finished or cancelled): `remove`, and it is known no more."""
        del self._requests[req.id]
        return self.remove(req)

    def remove(self, req: RequestState) -> list[tuple[int, int]]:
        """Take `req` out wherever it is; returns the row moves (src, dst), in order, that keep the
        running requests in rows 0..R-1 and the prefilling one right after them."""
        if req in self.waiting:
            self.waiting.remove(req)
            return []
        if req is self.prefilling:
            self.prefilling = None
            return []
        moves = []
        last = self.running.pop()
        if last is not req:
            moves.append((last.slot, req.slot))
            last.slot = req.slot
            self.running[req.slot] = last
        if self.prefilling is not None:
            moves.append((self.prefilling.slot, len(self.running)))
            self.prefilling.slot = len(self.running)
        req.slot = -1
        return moves

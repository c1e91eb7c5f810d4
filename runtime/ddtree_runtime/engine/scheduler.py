"""Who runs this step, on which rows, and what it leaves: all of the engine's bookkeeping.

The scheduler holds every request the engine has: the waiting queue (first come, first served; a
preempted request goes back to its head), the one prefilling and the running batch, and the KV pool's
pages and cached sequences (pool.py). `schedule` decides a step (a `Batch`): it reserves the pages each
running request's round may write, preempting the newest when the pool runs out; it gives the step's
token budget to the running requests' rounds first and fills the rest with prompt pieces of the
prefilling request and of the queue's head, admitting while a row is free and the pool holds the
prompt and a first round; and it sets each tree's budget. `postprocess` takes what the runner
computed: it appends the tokens, cuts them at a stop or the length, and lets finished requests go,
their rows kept as cached sequences when prefix reuse is on. The --max-queue bound on the waiting queue
is here too (`has_room`): the server asks before it submits, so its 429 comes from the queue it bounds.

Rows are the batch rows of the engine's pool. The running requests always hold rows 0..R-1 in order,
so a batched pass works on the first rows of the pool (a view, no gather); the one request being
prefilled holds row R. When a request leaves, the last running one moves into its row (and the
prefilling one down after it). Moving rows, sharing a cached prefix's pages and copying its partial
page are the pool's own small device copies, queued here as they are decided (before this step's
passes, after earlier steps'); every pass is the runner's.
"""

from __future__ import annotations

from collections import deque

from .policy import BudgetPolicy
from .pool import KVPool
from .prefill import PREFILL_PIECE
from .prefix_cache import CachedSequence, Hit, PrefixCache, TokenView, common_prefix, snapshot_point
from .types import Batch, BatchStats, Piece, RequestState, RoundOutput, StepResult

# The most attention-bias elements (rows x queries x keys) one grouped prefill pass builds: 64M, 128 MB
# in 16 bits; a group that would need more runs as several passes.
GROUP_BIAS = 1 << 26


class Scheduler:
    def __init__(self, slots: int, max_queue: int, pool: KVPool | None, stats: BatchStats, *,
                 step_tokens: int = PREFILL_PIECE, policy: BudgetPolicy | None = None, groups: bool = False,
                 has_drafter: bool = False, turn_token: int | None = None) -> None:
        """`step_tokens`: the step's token budget (settings.py's max_batched_tokens); `policy`: each
        round's tree budgets (policy.py; None: each request's own); `groups`: prompts' last pieces may share a pass (an
        attention-only target: a hybrid's recurrent state would run on over a shorter row's padding);
        `turn_token`: where a hybrid's prompt state is kept for the prefix cache (prefix_cache.py)."""
        self.slots, self.max_queue = slots, max_queue
        self.pool, self.stats = pool, stats
        self.prefix: PrefixCache | None = None if pool is None else pool.prefix  # None: no reuse (the warm-up)
        self.step_tokens, self.groups = step_tokens, groups
        self.policy = policy or BudgetPolicy(by_cost=False, cap=1, slots=slots, block_size=1, round_nodes=None)
        self._has_drafter, self.turn_token = has_drafter, turn_token
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

    def tree_slots(self, req: RequestState) -> int:
        return req.mode.tree_slots(req.budget, self.pool.sizing.block_size)

    # ---- a step ---------------------------------------------------------------------------------

    def schedule(self) -> Batch:
        """The step: the running requests' round pages (preempting when the pool runs out), their
        rounds first in the token budget, then prompt pieces in what is left (`_prefills`)."""
        self.reserve_round()
        decoding = list(self.running)
        batch = Batch(decoding=decoding, budgets=self.policy.budgets(decoding) if decoding else [])
        self._prefills(batch, self.prompt_budget(batch))
        joining = [p.req.id for group in batch.prefills for p in group if p.ends_prompt and self.policy.chooses(p.req)]
        if joining and not self.policy.drafts_with_prompt(self.running):
            batch.drafts_later = frozenset(joining)
        self.stats.prefill_tokens = sum(p.length for group in batch.prefills for p in group)
        self.stats.prefill_passes = len(batch.prefills)
        return batch

    def prompt_budget(self, batch: Batch) -> int:
        """Prompt tokens this step may prefill: the token budget less the rounds' tree nodes, and never
        less than a quarter of it (a batch of big trees does not starve the queue). With nothing
        decoding there is no one to stall, and a prompt goes in pieces as large as prefill.py's."""
        if not batch.decoding:
            return max(self.step_tokens, PREFILL_PIECE)
        nodes = sum(r.mode.tree_slots(b, self.pool.sizing.block_size) for r, b in zip(batch.decoding, batch.budgets))
        return max(self.step_tokens - nodes, self.step_tokens // 4)

    def _prefills(self, batch: Batch, left: int) -> None:
        """Prompt pieces, from the request in progress on and then the queue's head while a row is free:
        a long prompt takes several steps, between which the running requests keep decoding. A
        completed prompt's request joins the running rows now (the next admission takes the next row);
        its first token comes from this step's pass. Last pieces of attention-only prompts share a pass."""
        group: list[Piece] = []
        computing: list[RequestState] = []  # the prompts this step completes
        while left > 0:
            req = self.next_prefill(batch, computing)
            if req is None:
                break
            if not req.placed:
                self._place(req)
            take = min(left, len(req.context) - req.prefilled, PREFILL_PIECE)
            left -= take
            piece = Piece(req, req.prefilled, take, self._keep_at(req, take))
            req.prefilled += take
            if piece.ends_prompt:
                computing.append(req)
            if self._groupable(piece):
                if group and not _group_holds(group, piece):  # a piece too wide for a group goes alone
                    batch.prefills.append(group)
                    group = []
                self.start_running(req)
                group.append(piece)
                continue
            if group:
                batch.prefills.append(group)
                group = []
            batch.prefills.append([piece])
            if piece.ends_prompt:
                self.start_running(req)
        if group:
            batch.prefills.append(group)

    def _groupable(self, piece: Piece) -> bool:
        """Whether this piece may share a prefill pass with other requests': the last of its prompt, no
        longer than the step's budget, on an attention-only target."""
        return self.groups and piece.length <= self.step_tokens and piece.ends_prompt

    def _keep_at(self, req: RequestState, take: int) -> int | None:
        """Where in this piece a hybrid keeps its prompt state (the prefix cache on a hybrid)."""
        lo = req.prefilled
        if self.prefix is not None and self.prefix.snapshots_only and lo < req.snapshot_at <= lo + take:
            return req.snapshot_at - lo
        return None

    def postprocess(self, batch: Batch, result: StepResult) -> list[tuple[int, RoundOutput]]:
        """Each request's new tokens: the prompts' first tokens, then the rounds' (cut at a stop or the
        length); finished requests leave. Returns (request id, output) for each that produced tokens."""
        outputs = []
        if result.error is not None:  # the pool could not be re-sized for the queue's head: it fails, alone
            failed = self.fail_head()
            outputs.append((failed.id, RoundOutput([], 0, True, "error", error=result.error)))
        for req, token, logprobs in result.firsts:
            if token is not None:  # None: a preempted request recomputed, its next token already known
                req.produced.append(token)
                outputs.append((req.id, self._emit(req, [token], 0, logprobs)))
        for req, (tokens, accepted, logprobs) in zip(batch.decoding, result.rounds):
            req.produced += tokens
            req.rounds += 1
            req.accepted_total += accepted
            outputs.append((req.id, self._emit(req, tokens, accepted, logprobs)))
        self.stats.rounds += bool(result.rounds)
        if result.rounds:
            self.policy.observe(batch.decoding, batch.budgets, result.rounds, result.forecasts)
            self.policy.record(batch.decoding, batch.budgets, self.stats)
        for request_id, out in outputs:
            if out.finished and request_id in self._requests:
                self.release(self._requests[request_id])
        self.stats.running, self.stats.waiting = len(self.running), len(self.waiting)
        self.stats.pages_used, self.stats.pages_shared = self.pool.pages.used_pages, self.pool.pages.shared_pages
        return outputs

    @staticmethod
    def _emit(req: RequestState, tokens: list[int], accepted: int, logprobs) -> RoundOutput:
        """Cut the tokens (and their log-probabilities) at the first stop token or max_new_tokens."""
        kept = tokens[:req.emits(tokens)]
        req.generated += len(kept)
        logprobs = None if logprobs is None else logprobs[:len(kept)]
        if kept and kept[-1] in req.stop_ids:
            return RoundOutput(kept, accepted, True, "stop", logprobs=logprobs)
        if req.generated >= req.params.max_new_tokens:
            return RoundOutput(kept, accepted, True, "length", logprobs=logprobs)
        return RoundOutput(kept, accepted, False, None, logprobs=logprobs)

    # ---- admission ----------------------------------------------------------------------------

    def next_prefill(self, batch: Batch | None = None, computing: list[RequestState] = ()) -> RequestState | None:
        """The request to prefill now: the one in progress, else the head of the queue if a row is
        free and the pool can take it now (`admissible`); first come, first served, so a request that
        must wait holds back the ones behind it. A head that would share more of its prompt with a
        prompt computed in this step than with what is computed already waits for the next step."""
        if self.prefilling is None and self.waiting and len(self.running) < self.slots \
                and self.admissible(self.waiting[0], batch) and not self._waits_for(self.waiting[0], computing):
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

    def admissible(self, req: RequestState, batch: Batch | None = None) -> bool:
        """Whether the pool can take `req` now. A request for a bigger tree than the pool holds gets the
        pool re-sized for it (same rows, bigger trees) when nothing else runs: that step (`batch.resize`)
        does nothing else, and the request is admitted at the next. While others run it runs with the
        largest tree the pool holds, rather than hold itself and everyone behind it until the engine
        drains. A tree changes speed, never the text: greedy or seeded (sampling.py), a request's tokens
        are the same at any budget."""
        slots = self.tree_slots(req)
        if not self.pool.holds(slots):
            if self.running:
                req.budget = self.pool.target_slots - 1
            else:
                if batch is not None:
                    batch.resize = slots
                    if self.prefix is not None:  # a new pool starts empty
                        self.prefix.clear()
                    self.pool.page_table.reset()  # idle: only cached sequences held pages
                return False
        return self.pages_admit(req)

    def _waits_for(self, req: RequestState, computing: list[RequestState]) -> bool:
        """Whether `req` shares a full page more of its prompt with a prompt this step computes than
        with any computed sequence: it is admitted at the next step, reusing those pages."""
        if self.prefix is None or not computing:
            return False
        shared = max(common_prefix(r.context, req.context) for r in computing)
        if shared < self.pool.page_size:
            return False
        hit = self.lookup(req, count=False)
        return shared // self.pool.page_size > (0 if hit is None else hit.length // self.pool.page_size)

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
        """A prompt is scheduled to complete (alone or in a group's pass): the request joins the batch
        (it already holds the next row)."""
        self.running.append(req)
        self.prefilling = None

    # ---- placement: where an admitted request's row starts from ---------------------------------

    def _place(self, req: RequestState) -> None:
        """Set up the row of a request just admitted (row = len(running)): move any cached sequence
        there out of its way, and start it from the cached prefix that saves the most prefill: its
        full pages by reference, a partial last page copied (prefix_cache.py)."""
        req.placed = True
        row, pool = req.slot, self.pool
        if self.prefix is not None:
            hit = self.lookup(req)
            resident = self.prefix.by_row.get(row)
            if resident is not None:
                self._rehome(resident, hit.seq if hit is not None else None)
            if hit is not None:
                seq = hit.seq
                pool.keep_free(1, spare=seq)  # for the partial page's copy
                if seq.row == row:  # taken over where it lies: the request writes past the prefix
                    self.prefix.pop(row)
                    pool.copy_pages(pool.page_table.truncate(row, hit.length))
                else:  # its full pages by reference, the partial last one copied
                    pool.copy_pages(pool.page_table.share(seq.row, row, hit.length))
                pool.copy_prefix(seq.row, row, hit.length, hit.from_snapshot)
                req.draft_ctx = min(hit.length, seq.draft_len) if self._has_drafter else 0
                req.prefilled = req.reused = hit.length
            req.snapshot_at = len(req.context)
            if self.prefix.snapshots_only:
                req.snapshot_at = snapshot_point(req.context, self.turn_token, req.reused)
            self._prefix_stats()
        if not pool.take_pages(row, len(req.context) + pool.sizing.round_reserve(self.tree_slots(req))):
            raise RuntimeError(f"request {req.id} was admitted without the pages it needs")  # pages_admit: not reached

    def _rehome(self, seq: CachedSequence, keep: CachedSequence | None) -> None:
        """Move `seq` out of a row an admission needs: to a free idle row; else, if it is `keep` (the
        one being reused), leave it to be taken over in place; else over the least recently used other
        cached sequence (never `keep`), unless `seq` is itself the least recently used: then drop it."""
        occupied = len(self.running) + 1  # the running rows and the one being admitted
        free = [r for r in range(occupied, len(self.pool.page_table.pages)) if r not in self.prefix.by_row]
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

    # ---- prefix sharing: what a prompt may start from -----------------------------------------

    def lookup(self, req: RequestState, count: bool = True) -> Hit | None:
        """The running or cached sequence that saves the most of req's prefill (None: reuse off)."""
        if self.prefix is None:
            return None
        return self.prefix.lookup(req.context, speculative=req.mode.drafts, live=self._live_sequences(),
                                  count=count)

    def _live_sequences(self) -> list[CachedSequence]:
        """The running requests as sequences a prompt may share pages with: what they have computed (a
        hybrid's only at its prompt snapshot, the one state it keeps)."""
        live = []
        for r in self.running:
            if r.n_ctx == 0:  # its prompt's pass has not run yet
                continue
            tokens = TokenView(r.prompt_ids, r.produced, r.n_ctx)
            if self.prefix.snapshots_only:
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
        self.pool.leave_row(req.slot, cached=False)
        self.pool.page_table.release(req.slot)
        moves = self.remove(req)
        self.pool.move_rows([d for _, d in moves], [s for s, _ in moves], 0)
        req.prefilled = req.reused = req.n_ctx = req.draft_ctx = req.snapshot_at = 0
        req.placed = False
        req.drafted = None
        self.waiting.appendleft(req)

    # ---- departures ---------------------------------------------------------------------------

    def release(self, req: RequestState) -> None:
        """Take `req` out (finished or cancelled); the rows behind it move down, and a request that was
        decoding leaves its row as a cached sequence (moved to the first idle row) when prefix reuse is on."""
        row, keep = req.slot, self.prefix is not None and req in self.running and req.n_ctx > 0
        # valid positions of each row that may move (a lone AR request's next pass has written n_ctx)
        valid = {r.slot: r.n_ctx + 1 for r in self.running}
        if self.prefilling is not None:
            valid[self.prefilling.slot] = self.prefilling.prefilled
        self.pool.leave_row(row, cached=keep)
        if keep:  # a cached sequence holds only its own length
            self.pool.page_table.truncate(row, req.n_ctx, writable=False)
        elif row >= 0:
            self.pool.page_table.release(row)
        moves = self.leave(req)
        src, dst = [s for s, _ in moves], [d for _, d in moves]
        if keep:
            idle = len(self.running) + (self.prefilling is not None)  # the freed row
            if idle != row:
                src.append(row)
                dst.append(idle)
            self.prefix.add(idle, (req.prompt_ids + req.produced)[:req.n_ctx], req.snapshot_at,
                            self.draft_length(req))
        self.pool.move_rows(dst, src, max((valid[s] for s in src), default=0))
        req.finished = True
        req.drafted = req.ahead = req.ahead_logprobs = req.ahead_context = req.stop_tensor = None
        self._prefix_stats()

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


def _group_holds(group: list[Piece], piece: Piece) -> bool:
    """Whether a grouped pass can take one more row: its padded tokens within one prefill piece (the
    activations the pool was sized for) and its attention bias within GROUP_BIAS elements."""
    rows = [*group, piece]
    width = max(p.length for p in rows)
    keys = max(p.start + p.length for p in rows)
    return len(rows) * width <= PREFILL_PIECE and len(rows) * width * keys <= GROUP_BIAS

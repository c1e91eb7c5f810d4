"""The device side of a step: the models, their caches, the graphed passes, and what a Batch computes.

`ModelRunner.run(batch)` runs what the scheduler decided: first each prompt pass (a lone piece, causal
over its own row; or the last pieces of several prompts, padded rows with a per-row causal bias), each
piece's drafter context written from its features as it is computed, then for the prompts it completes
their first tokens and one first-draft pass; then one round for the requests decoding: draft (queued
by the last round) -> trees -> one verify pass -> the walks -> the next round's first pass, queued
before the host reads the walks -> each row's commit. One host sync a round. It also owns re-sizing the
target pool for bigger trees (its graphs are captured over it).

A request's cache position (n_ctx, its next root `bonus`, its pending draft, a lone AR step's pass run
ahead) is what the device holds for it, so the runner moves it on; its tokens, its length and its
leaving are the scheduler's (postprocess)."""

from __future__ import annotations

import os

import torch

from ..model.dflash import DraftInputs, DraftMask
from ..model.kernels import DECODE_EAGER
from ..model.layers import TreeInputs
from . import memory
from .block_manager import PageTable
from .draft_cache import DraftCache
from .graphs import HostRead
from .kv_cache import HybridCache, KVCache, target_cache
from .memory import PoolSizing
from .pool import KVPool
from .runner import (KV_BUCKET, DraftRunner, PrefillRunner, TargetRunner, TreePass, batch_bucket, kv_len_for,
                     prefill_width, tree_bucket)
from .sampling import PendingLogprobs, choose_tokens, start_logprobs, suppress_stops
from .forecast import MILLI
from .tree import Tree, TreeBuilder, Walk, walk
from .types import Batch, BatchStats, Piece, RequestState, Round, StepResult, TokenLogprob


# A hybrid target's short pieces at a fixed, graphed shape (fla-core's chunk kernel inside the graph, the
# padding held out of the recurrent state): on the H200 a 27B second turn's ~200 new tokens after a
# reused 16K prefix took 62 ms this way against 137-155 ms eagerly, with the same first token
# (docs/performance.md, "Short prompt pieces"). DDTREE_HYBRID_SHORT_PREFILL=0 runs them eagerly on CUDA.
HYBRID_SHORT_PREFILL_ON_GPU = os.environ.get("DDTREE_HYBRID_SHORT_PREFILL") != "0"


class ModelRunner:
    def __init__(self, target, drafter, pool: KVPool, *, slots: int, block_size: int, mask_token_id: int | None,
                 device: torch.device, stats: BatchStats, tree_slots: int, forecast_at: tuple[int, ...] = ()) -> None:
        """The caches over the pool's page table (the drafter's, then the target's, sized for trees of
        `tree_slots` nodes), their graphed runners, the tree builder and the round's readback. The pool
        gets a reference to both caches (its row moves and page copies are made on them). `forecast_at`:
        the budgets each ddtree row's drafter forecast is read at (policy.py; none: no forecasts)."""
        self.target, self.drafter, self.pool = target, drafter, pool
        self.device, self.block_size, self.mask_token_id, self.stats = device, block_size, mask_token_id, stats
        self.page_table: PageTable = pool.page_table
        self.sizing: PoolSizing = pool.sizing
        self.rows = len(pool.page_table.pages)
        # phase_hook(name) is called as each phase of a step starts ("prefill", then the round's "draft",
        # "tree", "verify", "commit", "step" for AR) and with "end" after it (the benchmarks' timers)
        self.phase_hook = None
        dtype = target.lm_head.weight.dtype
        self.draft_cache: DraftCache | None = None
        self.draft_runner: DraftRunner | None = None
        if drafter is not None:
            # full layers in the pages, sliding ones in rings past which pad writes go (draft_cache.py)
            self.draft_cache = DraftCache(drafter.config, block_size, self.page_table,
                                          self.page_table.capacity - KV_BUCKET, device, dtype,
                                          snapshots=pool.prefix is not None, write=drafter.write_context)
            pool.attach_drafter(self.draft_cache)
            self.draft_runner = DraftRunner(target, drafter, self.draft_cache, block_size, mask_token_id, device,
                                            stats)
        self.target_cache: KVCache | None = None
        self.target_runner: TargetRunner | None = None
        self.prefill_runner: PrefillRunner | None = None  # short pieces at a fixed shape
        self._resizing = False  # between dropping the old pool and the new one (or the old) being in place
        self.resize(tree_slots)
        self.trees = TreeBuilder(device, None if drafter is None else drafter.vocab_ids)
        # a ddtree row's tree is built at its own budget and a prefix of it verified, forecast at these
        # budgets and the one run (forecast.py), read with the walks
        self.forecast_at = forecast_at
        self.readback = HostRead(slots * (Walk.size(block_size - 1) + len(forecast_at) + 1), device)  # the round's one read
        # an AR step's accepted path in each row: its root alone (what a hybrid's state advances along)
        self.root_paths = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self.root_lengths = torch.ones(slots, dtype=torch.long, device=device)

    @property
    def use_graphs(self) -> bool:
        return self.target_runner.use_graphs

    @property
    def can_serve(self) -> bool:
        """False only if a re-size failed after the old pool was dropped and the old one could not be
        put back (the server's /health reports it)."""
        return self._resizing or (self.target_cache is not None and self.target_runner is not None)

    def run(self, batch: Batch) -> StepResult:
        """The step's prompt passes, then its round (the pool re-sized first when the batch says so: that
        step runs nothing else)."""
        if batch.resize is not None:
            try:
                self.resize(batch.resize)
            except Exception as exc:  # noqa: BLE001 - the request it was for fails, alone (postprocess)
                return StepResult(error=exc)
            return StepResult()
        result = StepResult()
        if batch.prefills:
            self._phase("prefill")  # closed by the round's first phase (or "end" below)
        for pieces in batch.prefills:
            result.firsts += self._prefill(pieces, batch.drafts_later)
        if batch.prefills and self.draft_cache is not None:
            self.draft_cache.write_held()   # the step's prompt passes' drafter context, in one write
        if batch.decoding:
            result.rounds, result.forecasts = self._round(batch.decoding, batch.budgets)
        else:
            self._phase("end")
        return result

    def _phase(self, name: str) -> None:
        if self.phase_hook is not None:
            self.phase_hook(name)

    # ---- the target pool's size ---------------------------------------------------------------

    def resize(self, tree_slots: int) -> None:
        """Size the target pool (every row) for the context and a tree of tree_slots nodes; ValueError
        when the device cannot hold it, raised before anything is dropped. (The scheduler has emptied
        the pages: a new pool starts with nothing cached.)"""
        previous = self.pool.target_slots
        if previous:
            self.check_resize(tree_slots)
        # drop the old cache and the graphs captured over it (and their memory pool) before sizing anew
        self._resizing = True
        self.target_cache = self.target_runner = self.prefill_runner = None
        self.pool.target_cache, self.pool.target_slots = None, 0
        try:
            self._build_target_cache(tree_slots)
        except BaseException:
            if previous:  # put back what served before (if this fails too, can_serve stays False)
                self._build_target_cache(previous)
            raise
        finally:
            self._resizing = False

    def _build_target_cache(self, tree_slots: int) -> None:
        cfg, dtype = self.target.config, self.target.lm_head.weight.dtype
        self.target_cache = target_cache(cfg, 0, self.device, dtype, nodes=tree_bucket(tree_slots),
                                         snapshots=self.pool.prefix is not None, table=self.page_table)
        self.target_runner = TargetRunner(self.target, self.target_cache, self.device, self.block_size - 1,
                                          self.stats)
        self.prefill_runner = None
        hybrid = isinstance(self.target_cache, HybridCache)  # as PrefillRunner tells it
        if not hybrid or self.device.type != "cuda" or HYBRID_SHORT_PREFILL_ON_GPU:
            self.prefill_runner = PrefillRunner(self.target, self.target_cache, self.device, self.stats,
                                                pool=self.target_runner.pool)
        self.pool.target_cache, self.pool.target_slots = self.target_cache, tree_slots

    def check_resize(self, tree_slots: int) -> None:
        """ValueError unless a target cache of the same pages and rows for trees of tree_slots nodes
        fits in what is free once the current one is given back."""
        current = sum(t.numel() * t.element_size() for t in self.target_cache._per_slot())
        need = (self.sizing.target_page_bytes() * (self.pool.pages.num_pages + 1)
                + self.rows * self.sizing.row_bytes(tree_slots))
        if need > memory.free_bytes(self.device) + current:
            raise ValueError(f"tree budget {tree_slots - 1} needs more memory than is free for the pool's "
                             f"{self.rows} slots: lower the tree budget")

    # ---- prompt passes ------------------------------------------------------------------------

    def _prefill(self, pieces: list[Piece],
                 drafts_later: frozenset[int] = frozenset()) -> list[tuple[RequestState, int | None, list[TokenLogprob] | None]]:
        """One target pass over pieces of prompts, then for each prompt it completes the first token (and
        its log-probabilities if asked for; a recomputed request's is None: it chooses none) and one
        drafter pass for the first drafts (but for requests in `drafts_later`, which draft in their first
        tree round: Batch.drafts_later). A lone piece is a causal pass over its own row, of any length
        (`_causal_pass`), or a short one at a fixed, graphed shape (PrefillRunner); several are last
        pieces of attention-only targets, padded into one pass (`_rows_pass`), so a burst of short
        prompts reads the weights once instead of once each."""
        reqs = [p.req for p in pieces]
        if len(pieces) > 1:
            h, feats, pos = self._rows_pass(pieces)
        elif self.prefill_runner is not None and prefill_width(pieces[0].length) is not None:
            p = pieces[0]
            h, feats, pos = self.prefill_runner.run(p.req.slot, p.req.context[p.start:p.start + p.length], p.start,
                                                    p.keep_at)
        else:
            h, feats, pos = self._causal_pass(pieces[0])
        self._draft_context(reqs, feats, pos)
        done = [i for i, p in enumerate(pieces) if p.ends_prompt]
        if not done:
            return []
        ends = torch.tensor([pieces[i].length - 1 for i in done], device=self.device)
        last = self.target.logits(h[torch.tensor(done, device=self.device), ends])          # [done, V]
        firsts = [(reqs[i], *self._first_token(reqs[i], last[j:j + 1])) for j, i in enumerate(done)]
        finished = [reqs[i] for i in done]
        drafts = [req.mode.drafts and req.id not in drafts_later for req in finished]
        if any(drafts):
            self.draft_cache.write_held()
            self._draft_prompt(finished, drafts)
        return firsts

    def _causal_pass(self, piece: Piece) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """A piece of one request's prompt, causal over its cached prompt and itself
        (layers.attend_cached). Returns hidden [1, T, H], features, positions [1, T]."""
        req, lo, hi = piece.req, piece.start, piece.start + piece.length
        ids = torch.tensor([req.context[lo:hi]], dtype=torch.long, device=self.device)   # [1, T]
        pos = torch.arange(lo, hi, device=self.device)[None]
        rows = self.target_cache.rows(req.slot, req.slot + 1)
        if piece.keep_at is not None:
            rows.keep_at = piece.keep_at  # a hybrid keeps its state there, within this pass
        return (*self.target(ids, pos, rows, start=lo), pos)

    def _rows_pass(self, pieces: list[Piece]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The last pieces of several prompts in one pass: row i is pieces[i] at its own offset over its
        own cache row (the group holds consecutive slots), padded to the longest piece and causal within
        its row. The padding's k/v land past a row's prompt, where the first round writes over them
        before anything may read there. Returns hidden [n, W, H], features, positions [n, W]."""
        n, width, dev = len(pieces), max(p.length for p in pieces), self.device
        ids = torch.zeros(n, width, dtype=torch.long)
        for i, p in enumerate(pieces):
            ids[i, :p.length] = torch.tensor(p.req.context[p.start:p.start + p.length])
        pos = torch.tensor([p.start for p in pieces], device=dev)[:, None] + torch.arange(width, device=dev)
        # keys to a bucket and a fixed kernel launch: a group's shape follows its prompts, and each new
        # shape would be a kernel compile on the engine's thread while it serves (kernels.DECODE_EAGER)
        kv_len = kv_len_for(max(p.start + p.length for p in pieces), self.target_cache.capacity, False)
        cols = torch.arange(kv_len, device=dev)
        bias = torch.zeros((), dtype=self.target_cache.k.dtype, device=dev).expand(n, 1, width, kv_len)
        bias = bias.masked_fill(cols > pos[:, None, :, None], float("-inf"))       # [n, 1, W, L] causal per row
        slots = pos.clamp(max=self.target_cache.capacity - 1)
        first = pieces[0].req.slot
        rows = self.target_cache.rows(first, first + n)
        h, feats = self.target(ids.to(dev), pos, rows, static=TreeInputs(slots, bias, kv_len, None,
                                                                          launch=DECODE_EAGER))
        return h, feats, pos

    def _draft_context(self, reqs: list[RequestState], feats: torch.Tensor | None, pos: torch.Tensor) -> None:
        """The drafter's context k/v of a prefill pass's positions pos [n, W] (row i: reqs[i]'s,
        consecutive slots) from its target features feats [n, W, F], held to be written with the step's
        other passes' before any first draft (draft_cache.hold), so no features of a whole prompt are
        kept. An AR row, and a row's padding past its prompt, write to the
        last cache slot only, so an AR row's drafter context (what it inherited with a reused prefix) is
        untouched and a sliding layer's ring (draft_cache.py) keeps the prompt's last positions; positions
        before a row's snapshot point also go to its snapshot ring."""
        if feats is None or not any(req.mode.drafts for req in reqs):
            return
        last = self.draft_cache.capacity - 1
        ends = torch.tensor([len(req.context) if req.mode.drafts else 0 for req in reqs], device=self.device)
        slots = torch.where(pos < ends[:, None], pos, last)
        self.draft_cache.hold(reqs[0].slot, feats, slots, [req.snapshot_at for req in reqs])

    def _first_token(self, req: RequestState, logits: torch.Tensor) -> tuple[int | None, list[TokenLogprob] | None]:
        """The prompt is in: choose the first token from the last position's logits [1, V] (the caller
        then drafts, for all the requests its pass completed at once). A request recomputed after a
        preemption chooses nothing: its next round's root is the last token it produced (None)."""
        if req.resume_bonus is not None:
            req.n_ctx, req.bonus, req.resume_bonus = len(req.context), req.resume_bonus, None
            return None, None
        chosen = self._choose(req, logits, 0)
        pending = self._logprobs(req, logits, chosen)
        first = int(chosen[0])
        req.n_ctx, req.bonus = len(req.context), first
        return first, None if pending is None else pending.rows([0])

    def _draft_prompt(self, reqs: list[RequestState], spec: list[bool]) -> None:
        """The first drafter pass of requests whose prompts are in (consecutive slots: a prefill group,
        or one request as a group of one), eager, in one pass: row i's block [bonus, MASK * (block_size-1)]
        at its context's end attends to the drafter context its prefill wrote (_draft_context; a reused
        prefix's came with it) and to itself -> `drafted` of each request that drafts now (spec[i]),
        logits for depths 1..Q-1. Any other row (an AR request, one whose first draft waits for its
        first tree round: `_redraft`) takes part at the last cache slot only, so nothing it holds is touched."""
        dev, bs, n = self.device, self.block_size, len(reqs)
        block = torch.full((n, bs), self.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = torch.tensor([req.bonus for req in reqs], device=dev)
        end = torch.tensor([req.n_ctx for req in reqs], device=dev)[:, None]
        block_pos = end + torch.arange(bs, device=dev)
        live = torch.tensor(spec, device=dev)[:, None]
        block_slots = torch.where(live, block_pos, self.draft_cache.capacity - 1)
        kv_len = kv_len_for(max(req.n_ctx for req, s in zip(reqs, spec) if s) + bs, self.draft_cache.capacity, False)
        cols = torch.arange(kv_len, device=dev)
        present = cols[None, :] < torch.where(live, end + bs, 1)       # [n, L] the context, then the block
        mask = DraftMask(cols[None, :], block_pos, present, self.draft_cache.k.dtype)  # slot = position
        rows = self.draft_cache.rows(reqs[0].slot, reqs[0].slot + n)
        h = self.drafter(self.target.model.embed_tokens(block), block_pos, None, None, rows, mask=mask,
                         static=DraftInputs(None, block_slots, kv_len, launch=DECODE_EAGER))
        drafted = self.drafter.block_logits(h[:, 1:], self.target)   # [n, bs-1, V or the draft vocab's]
        for i, req in enumerate(reqs):
            if spec[i]:
                req.drafted = drafted[i]

    # ---- choosing tokens ----------------------------------------------------------------------

    @staticmethod
    def _choose(req: RequestState, logits: torch.Tensor, position: int,
                depths: torch.Tensor | None = None) -> torch.Tensor:
        """logits: [N, V] -> the target's token per row. `position`: which output token (0-based) row
        0 chooses; a tree's rows choose position + their depth ([N] `depths`; None: every row chooses
        `position`). The stop tokens are masked in the rows that choose one of the first min_tokens."""
        if position < req.params.min_tokens and req.stop_tensor is not None:
            early = None if depths is None else position + depths < req.params.min_tokens
            logits = suppress_stops(logits, req.stop_tensor, early)
        draws = None
        if req.uniforms is not None:  # each row's draw is its output position's (sampling.py)
            last = req.uniforms.shape[0] - 1
            draws = (req.uniforms[(position + depths).clamp(max=last)] if depths is not None
                     else req.uniforms[min(position, last)].expand(logits.shape[0]))
        return choose_tokens(logits, req.params, draws)

    @staticmethod
    def _logprobs(req: RequestState, logits: torch.Tensor, chosen: torch.Tensor) -> PendingLogprobs | None:
        """The raw log-probabilities of the tokens chosen from `logits` ([N, V], chosen [N]), queued
        for the host, if the request asked for them (None otherwise: nothing is computed)."""
        if req.params.logprobs is None:
            return None
        return start_logprobs(logits, chosen, req.params.logprobs)

    # ---- the round ----------------------------------------------------------------------------

    def _round(self, reqs: list[RequestState], budgets: list[int]) -> tuple[list[Round], list[list[float] | None]]:
        """draft (queued by the last round) -> each request's tree -> one verify pass over all of them
        -> the walks -> the next round's first pass, queued before the host reads the walks -> each
        row's commit. Rows are the pool's rows 0..B-1. A round whose budgets are all 0 is plain AR even
        for drafting rows: their drafter context is staged from the verify's features (`_round_context`),
        no draft is made, and the next tree round writes what is staged and drafts first (`_redraft`).
        Returns the rounds and each row's drafter forecast (None: no tree forecast)."""
        depth, n = self.block_size - 1, len(reqs)
        drafting = any(req.mode.drafts and budget > 0 for req, budget in zip(reqs, budgets))
        # a lone row in an AR round (an AR request, or a drafting one at budget 0): its next step runs
        # before this one's read
        ahead = n == 1 and not drafting
        settled_logprobs = [[] if ahead else _rows_of(req.ahead_logprobs) for req in reqs]  # _settle drops them
        settled = [[] if ahead else self._settle(req) for req in reqs]
        self._phase("tree")
        if drafting:
            self.draft_cache.flush()
            self._redraft(reqs)
        trees, forecast = self._trees(reqs, budgets)
        self.stats.batch_size, self.stats.tree_nodes = n, sum(1 if tree is None else tree.size for tree in trees)
        self._phase("verify")
        starts = [req.n_ctx for req in reqs]
        if ahead and reqs[0].ahead is not None:  # this step's pass ran ahead, in the last round
            out, target, pending = None, reqs[0].ahead, [reqs[0].ahead_logprobs]
        else:
            positions = [req.generated + len(settled[row]) for row, req in enumerate(reqs)]
            out, target, pending = self._verify(reqs, [req.bonus for req in reqs], starts, trees, positions)
        self._phase("commit")
        # each row's walk, [B', W]; a round of AR steps reads its roots' tokens alone, [B']
        result = walk(out.tokens, out.parents, out.depths, out.mask, target, depth) if drafting else target[:, 0]
        self.readback.start(result[:n].flatten() if forecast is None else torch.cat([result[:n].flatten(),
                                                                                    forecast.flatten()]))
        drafted = None
        if not drafting and out is not None:
            self._round_context(reqs, out)
        if drafting:
            self._phase("draft")
            drafted = self.draft_runner.run(result[:, 1], result[:, 0], result[:, 2:3 + depth], out.feats, starts)
        elif ahead:
            self._phase("verify")
            self._run_ahead(reqs[0], result)
        self._phase("commit")
        host = self.readback.wait()
        width = Walk.size(depth) if drafting else 1
        rounds, forecasts = [], [None] * n
        if forecast is not None:
            k, cells = forecast.shape[1], host[n * Walk.size(depth):]
            forecasts = [[v / MILLI for v in cells[row * k:(row + 1) * k]] if reqs[row].mode.name == "ddtree"
                         and budgets[row] > 0 else None for row in range(n)]
        moved = 0  # the longest committed path not already in place (KVCache.compact)
        for row, req in enumerate(reqs):
            cells = host[row * width:(row + 1) * width]
            accepted = Walk.read(cells, depth) if drafting else Walk([0], [req.bonus], cells[0])
            tokens = settled[row] + accepted.tokens[1:] + [accepted.next_token]
            # a finishing row commits only what it emits (RequestState.emits), its root at least
            keep = max(req.emits(tokens), len(settled[row]) + 1)
            path = keep - len(settled[row])
            if path < len(accepted.path):
                result[row, 0] = path  # the commit's length (the drafter pass queued before read the walk's)
            if accepted.path[:path] != list(range(path)):
                moved = max(moved, path)
            req.n_ctx += path
            req.bonus = tokens[keep - 1]
            if req.mode.drafts:
                req.drafted = None if drafted is None else drafted[row]
            logprobs = None
            if pending[row] is not None:
                logprobs = (settled_logprobs[row] + pending[row].rows(accepted.path))[:keep]
            rounds.append((tokens[:keep], len(accepted.path) - 1, logprobs))
        # only the KV of paths that are not in place already moves (none for AR steps, whose pass ahead
        # committed this one's already)
        if drafting:
            self.target_cache.rows(0, n).compact(out.start[:n], result[:n, 2:3 + depth], result[:n, 0], moved)
        elif not ahead:
            self._commit_roots(0, n)
        self._phase("end")
        return rounds, forecasts

    def _verify(self, reqs: list[RequestState], roots: list[int] | torch.Tensor, starts: list[int],
                trees: list[Tree | None], positions: list[int]) -> tuple[TreePass, torch.Tensor,
                                                                         list[PendingLogprobs | None]]:
        """One target pass over the rows' trees (TargetRunner.run), then the target's token at every
        node, [B', T]: the greedy rows' by one argmax over the batch, the others' by their own draws as
        alone (row b's node at depth d chooses output token positions[b] + d); and the log-probabilities
        of the rows that asked for them."""
        out = self.target_runner.run(roots, starts, trees)
        sizes = [1 if tree is None else tree.size for tree in trees]
        target = out.logits.argmax(dim=-1)
        for row, req in enumerate(reqs):
            p = req.params
            if p.temperature > 0 or p.logit_bias or positions[row] < p.min_tokens:
                target[row, :sizes[row]] = self._choose(req, out.logits[row, :sizes[row]], positions[row],
                                                        out.depths[row, :sizes[row]])
        pending = [self._logprobs(req, out.logits[row, :sizes[row]], target[row, :sizes[row]])
                   for row, req in enumerate(reqs)]
        return out, target, pending

    def _run_ahead(self, req: RequestState, tokens: torch.Tensor) -> None:
        """A lone row's next AR step, queued from this step's token on the device ([1] `tokens`)
        before the host reads it: this step's pass is committed (only a hybrid's state moves), the next
        one runs at the next position and its token is chosen; both wait in req.ahead for the next
        round (or _settle). A drafting row's drafter context at the pass ahead is held until that pass is
        committed (it is dropped with the pass if the request ends first)."""
        self._commit_roots(req.slot, req.slot + 1)
        self._stage_ahead(req)
        out, req.ahead, (req.ahead_logprobs,) = self._verify([req], tokens, [req.n_ctx + 1], [None],
                                                             [req.generated + 1])
        if req.mode.drafts:
            req.ahead_context = (out.feats[:1, 0].clone(), out.start[:1].clone())

    def _stage_ahead(self, req: RequestState) -> None:
        """The committed pass ahead's drafter context, staged as an AR round's is (`_round_context`)."""
        if req.ahead_context is not None:
            self.draft_cache.stage(*req.ahead_context, [True], first_row=req.slot)
            req.ahead_context = None

    def _settle(self, req: RequestState) -> list[int]:
        """An AR request that ran alone has its next step's pass already run and its token chosen
        (req.ahead): commit that pass and take the token, as its next round would."""
        if req.ahead is None:
            return []
        self._commit_roots(req.slot, req.slot + 1)
        self._stage_ahead(req)
        req.n_ctx += 1
        req.bonus = int(req.ahead[0, 0])
        req.ahead = req.ahead_logprobs = None
        return [req.bonus]

    def _commit_roots(self, lo: int, hi: int) -> None:
        """Commit the AR steps of rows lo..hi-1: each path is its root, already in place, so only a
        hybrid's recurrent state moves on (nothing at all for attention-only KV)."""
        self.target_cache.rows(lo, hi).compact(None, self.root_paths[:hi - lo], self.root_lengths[:hi - lo], moved=0)

    def _trees(self, reqs: list[RequestState], budgets: list[int]) -> tuple[list[Tree | None], torch.Tensor | None]:
        """Each request's tree (None: AR, or a budget of 0: its root alone): the requests of one mode and
        budget built together. With forecasts, a ddtree row's tree is built at its own budget, the first
        budgets[row] nodes of it verified, and the drafter's forecast made from it ([B, K+1], rows
        without one zero; None without forecasts)."""
        groups: dict[tuple, list[int]] = {}
        forecasting = bool(self.forecast_at)
        for row, req in enumerate(reqs):
            if budgets[row] > 0 or not req.mode.drafts:
                built = req.budget if forecasting and req.mode.name == "ddtree" else budgets[row]
                groups.setdefault((req.mode.name, built, budgets[row]), []).append(row)
        trees: list[Tree | None] = [None] * len(reqs)
        by_row: dict[int, torch.Tensor] = {}
        for (name, built, budget), rows in groups.items():
            mode, drafted = reqs[rows[0]].mode, [reqs[r].drafted for r in rows]
            if forecasting and name == "ddtree":
                made, forecast = mode.forecast_trees(self.trees, drafted, built, self.block_size,
                                                     [*self.forecast_at, budget])
                by_row.update(zip(rows, forecast))
                made = [Tree(t.nodes[:, :budget]) for t in made]
            else:
                made = mode.trees(self.trees, drafted, built, self.block_size)
            for row, tree in zip(rows, made):
                trees[row] = tree
        if not by_row:
            return trees, None
        zero = torch.zeros(len(self.forecast_at) + 1, dtype=torch.long, device=self.device)
        return trees, torch.stack([by_row.get(row, zero) for row in range(len(reqs))])

    def _redraft(self, reqs: list[RequestState]) -> None:
        """After AR rounds, drafting rows have no draft: one drafter pass over the batch (rows 0..B-1)
        makes them from the context those rounds wrote (flushed just before): the rounds' own graphed
        pass with no new context (DraftRunner.redraft)."""
        if not any(req.mode.drafts and req.drafted is None for req in reqs):
            return
        n = len(reqs)
        pad = [self.mask_token_id] * (batch_bucket(n, self.target_cache.slots) - n)
        # a lone row's token by a fill (a copy from the host's memory would wait for the device)
        bonus = (torch.full((1,), reqs[0].bonus, device=self.device) if n == 1 else
                 torch.tensor([req.bonus for req in reqs] + pad, device=self.device))
        drafted = self.draft_runner.redraft(bonus, [req.n_ctx for req in reqs])
        for row, req in enumerate(reqs):
            if req.mode.drafts:
                req.drafted = drafted[row]

    def _round_context(self, reqs: list[RequestState], out: TreePass | None) -> None:
        """An AR round of drafting rows: their drafter context at the root's position, from the verify's
        features, staged (draft_cache.py: written a block of rounds at a time, or before the row is read),
        so that a later tree round drafts from a complete context. The features are copied out: they
        are a static buffer the next pass overwrites."""
        if out is None or not any(req.mode.drafts for req in reqs):
            return
        n = len(reqs)
        self.draft_cache.stage(out.feats[:n, 0], out.start[:n], [req.mode.drafts for req in reqs])


def _rows_of(pending: PendingLogprobs | None) -> list[TokenLogprob]:
    return [] if pending is None else pending.rows([0])

"""The prefill step: up to a chunk of prompt tokens a step, then each prompt's first token and draft.

The request in progress goes first, then the queue's head while the scheduler admits it; a long prompt
takes several steps, between which the running requests keep decoding. The last pieces of several
prompts run as one target pass (`_prefill`, attention-only targets), and their first drafts as
one drafter pass. A part of the Engine (engine.py), on its state: the models, the caches, the
scheduler and the pool."""

from __future__ import annotations

import torch

from ..model.dflash import DraftInputs, DraftMask
from ..model.kernels import DECODE_EAGER
from ..model.layers import TreeInputs
from .prefill import PREFILL_PIECE
from .prefix_cache import common_prefix
from .runner import kv_len_for
from .types import RequestState, RoundOutput, TokenLogprob

# The most attention-bias elements (rows x queries x keys) one grouped prefill pass builds (_group_holds):
# 64M, 128 MB in 16 bits; a group that would need more runs as several passes.
GROUP_BIAS = 1 << 26


class Prefilling:
    """The Engine's prefill step (mixed into Engine: its models, caches, scheduler and pool)."""

    def _prefill_step(self) -> tuple[list[tuple[int, RoundOutput]], list[RequestState]]:
        """Prefill up to prefill_chunk prompt tokens, from the request in progress on and then the
        queue's head while slots are free: a long prompt takes several steps, between which the
        running requests keep decoding. Returns the first tokens and the requests that joined."""
        outputs, joined = [], []
        group: list[tuple[RequestState, int]] = []  # prompts' last pieces, run as one pass (_prefill)
        # with nothing decoding there is no one to stall: a prompt goes in pieces as large as prefill.py's
        left = self.scheduler.prefill_budget(self.config.prefill_chunk)
        self.stats.prefill_tokens = self.stats.prefill_passes = 0
        while left > 0:
            try:
                req = self.scheduler.next_prefill()
            except Exception as exc:  # noqa: BLE001 - re-sizing the pool for it failed: it fails, alone
                failed = self.scheduler.fail_head()
                outputs.append((failed.id, RoundOutput([], 0, True, "error", error=exc)))
                continue
            if req is None:
                break
            if group and not req.placed and self._shares_with(group, req):
                self._prefill_group(group, outputs)  # computed first, so that its pages can be shared
            if not req.placed:
                self._place(req)
            take = min(left, len(req.context) - req.prefilled, PREFILL_PIECE)
            left -= take
            self.stats.prefill_tokens += take
            if self._groupable(req, take):
                if not self._group_holds(group, req, take):
                    self._prefill_group(group, outputs)
                # the request joins now (the next admission takes the next slot); its pass runs with the group's
                self.scheduler.start_running(req)
                joined.append(req)
                group.append((req, take))
                continue
            self._prefill_group(group, outputs)
            first = self._prefill([(req, take)])[0]
            if first is not None:
                self.scheduler.start_running(req)
                joined.append(req)
                self._joined(req, first, outputs)
        self._prefill_group(group, outputs)
        return outputs, joined

    def _shares_with(self, group: list[tuple[RequestState, int]], req: RequestState) -> bool:
        """Whether req's context starts with a full page of a grouped request's (not computed yet)."""
        return self.prefix is not None and any(common_prefix(r.context, req.context) >= self.page_size
                                               for r, _ in group)

    def _joined(self, req: RequestState, first: tuple[int, list[TokenLogprob] | None],
                outputs: list[tuple[int, RoundOutput]]) -> None:
        token, logprobs = first
        if token is None:  # a preempted request recomputed: its next token is already known
            return
        req.produced.append(token)
        outputs.append((req.id, self._emit(req, [token], 0, logprobs)))

    def _groupable(self, req: RequestState, take: int) -> bool:
        """Whether this piece may share a prefill pass with other requests' (_prefill): the last
        of its prompt, no longer than a chunk, on an attention-only target (a hybrid's recurrent state
        would run on over the padding of a shorter row)."""
        return self.arch == "qwen3" and take <= self.config.prefill_chunk and req.prefilled + take == len(req.context)

    @staticmethod
    def _group_holds(group: list[tuple[RequestState, int]], req: RequestState, take: int) -> bool:
        """Whether the group's pass can take one more row: its padded tokens within one prefill piece
        (the activations the pool was sized for) and its attention bias within GROUP_BIAS elements."""
        rows = [*group, (req, take)]
        width = max(t for _, t in rows)
        keys = max(r.prefilled + t for r, t in rows)
        return len(rows) * width <= PREFILL_PIECE and len(rows) * width * keys <= GROUP_BIAS

    def _prefill_group(self, group: list[tuple[RequestState, int]], outputs: list[tuple[int, RoundOutput]]) -> None:
        """Run the deferred last pieces as one pass, then empty the group."""
        if group:
            for (req, _), first in zip(group, self._prefill(group)):
                self._joined(req, first, outputs)
        group.clear()

    def _prefill(self, group: list[tuple[RequestState, int]]
                 ) -> list[tuple[int | None, list[TokenLogprob] | None] | None]:
        """One target pass over pieces of prompts (group[i]: a request and how many of its next prompt
        tokens), then for each prompt it completes the first token (and its log-probabilities if asked
        for; a recomputed request's is None: it chooses none) and one drafter pass for the first drafts.
        A piece not ending its prompt gives None. A lone piece is a causal pass over its own row, of any
        length (`_causal_pass`); several are last pieces of attention-only targets, padded into one pass
        (`_rows_pass`), so a burst of short prompts reads the weights once instead of once each."""
        reqs = [req for req, _ in group]
        h, feats, pos = self._causal_pass(*group[0]) if len(group) == 1 else self._rows_pass(group)
        self.stats.prefill_passes += 1
        self._draft_context(reqs, feats, pos)
        for req, take in group:
            self._prefilled(req, take)
        done = [i for i, req in enumerate(reqs) if req.prefilled == len(req.context)]
        if not done:
            return [None] * len(group)
        ends = torch.tensor([group[i][1] - 1 for i in done], device=self.device)
        last = self.target.logits(h[torch.tensor(done, device=self.device), ends])          # [done, V]
        firsts: list = [None] * len(group)
        for j, i in enumerate(done):
            firsts[i] = self._first_token(reqs[i], last[j:j + 1])
        finished = [reqs[i] for i in done]
        if any(req.mode.drafts for req in finished):
            self._draft_prompt(finished)
        return firsts

    def _causal_pass(self, req: RequestState, take: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Prompt tokens prefilled..prefilled+take of one request, causal over its cached prompt and
        themselves (layers.attend_cached). Returns hidden [1, T, H], features, positions [1, T]."""
        lo, hi = req.prefilled, req.prefilled + take
        ids = torch.tensor([req.context[lo:hi]], dtype=torch.long, device=self.device)   # [1, T]
        pos = torch.arange(lo, hi, device=self.device)[None]
        rows = self.target_cache.rows(req.slot, req.slot + 1)
        if lo < req.snapshot_at <= hi and self._keeps_snapshots:
            rows.keep_at = req.snapshot_at - lo  # a hybrid keeps its state there, within this pass
        return (*self.target(ids, pos, rows, start=lo), pos)

    def _rows_pass(self, group: list[tuple[RequestState, int]]
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The last pieces of several prompts in one pass: row i is group[i]'s piece at its own offset
        over its own cache row (the group holds consecutive slots), padded to the longest piece and
        causal within its row. The padding's k/v land past a row's prompt, where the first round writes
        over them before anything may read there. Returns hidden [n, W, H], features, positions [n, W]."""
        reqs, takes = [r for r, _ in group], [t for _, t in group]
        n, width, dev = len(group), max(takes), self.device
        ids = torch.zeros(n, width, dtype=torch.long)
        for i, (req, take) in enumerate(group):
            ids[i, :take] = torch.tensor(req.context[req.prefilled:req.prefilled + take])
        pos = torch.tensor([req.prefilled for req in reqs], device=dev)[:, None] + torch.arange(width, device=dev)
        # keys to a bucket and a fixed kernel launch: a group's shape follows its prompts, and each new
        # shape would be a kernel compile on the engine's thread while it serves (kernels.DECODE_EAGER)
        kv_len = kv_len_for(max(req.prefilled + take for req, take in group), self.target_cache.capacity, False)
        cols = torch.arange(kv_len, device=dev)
        bias = torch.zeros((), dtype=self.target_cache.k.dtype, device=dev).expand(n, 1, width, kv_len)
        bias = bias.masked_fill(cols > pos[:, None, :, None], float("-inf"))       # [n, 1, W, L] causal per row
        slots = pos.clamp(max=self.target_cache.capacity - 1)
        rows = self.target_cache.rows(reqs[0].slot, reqs[0].slot + n)
        h, feats = self.target(ids.to(dev), pos, rows, static=TreeInputs(slots, bias, kv_len, None,
                                                                          launch=DECODE_EAGER))
        return h, feats, pos

    def _draft_context(self, reqs: list[RequestState], feats: torch.Tensor | None, pos: torch.Tensor) -> None:
        """Write the drafter's context k/v of a prefill pass's positions pos [n, W] (row i: reqs[i]'s,
        consecutive slots) from its target features feats [n, W, F] right away, so the first draft needs
        no features of the whole prompt. An AR row, and a row's padding past its prompt, write to the
        last cache slot only, so an AR row's drafter context (what it inherited with a reused prefix) is
        untouched and a sliding layer's ring (draft_cache.py) keeps the prompt's last positions; positions
        before a row's snapshot point also go to its snapshot ring."""
        if feats is None or not any(req.mode.drafts for req in reqs):
            return
        last = self.draft_cache.capacity - 1
        ends = torch.tensor([len(req.context) if req.mode.drafts else 0 for req in reqs], device=self.device)
        slots = torch.where(pos < ends[:, None], pos, last)
        rows = self.draft_cache.rows(reqs[0].slot, reqs[0].slot + len(reqs))
        self.drafter.write_context(feats, slots, rows.until([req.snapshot_at for req in reqs]))

    def _prefilled(self, req: RequestState, take: int) -> None:
        """Book `take` more prompt tokens as computed (their drafter context is written: _draft_context;
        a hybrid's kept state, by the pass: _causal_pass)."""
        req.prefilled += take

    @property
    def _keeps_snapshots(self) -> bool:
        """Whether a hybrid's prompt state is kept at its snapshot point (the prefix cache on a hybrid)."""
        return self.prefix is not None and self.prefix.snapshots_only

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

    def _draft_prompt(self, reqs: list[RequestState]) -> None:
        """The first drafter pass of requests whose prompts are in (consecutive slots: a prefill group,
        or one request as a group of one), eager, in one pass: row i's block [bonus, MASK * (block_size-1)]
        at its context's end attends to the drafter context its prefill wrote (_draft_context; a reused
        prefix's came with it) and to itself -> each drafting request's `drafted`, logits for depths
        1..Q-1. An AR row takes part at the last cache slot only, so nothing it holds is touched."""
        dev, bs, n = self.device, self.block_size, len(reqs)
        spec = [req.mode.drafts for req in reqs]
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
        drafted = self.drafter.draft_logits(self.target.logits(h[:, 1:]))   # [n, bs-1, V]
        for i, req in enumerate(reqs):
            if spec[i]:
                req.drafted = drafted[i]

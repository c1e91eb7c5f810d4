"""A round: draft (queued by the last round) -> build tree -> verify -> accept and commit.

A lone request takes the single-stream path (graphed, one host sync a round: `_spec_round`, and
`_ar_step` for AR, which runs its next pass ahead); a batch verifies every request's tree in one
target pass and drafts for all of them in one drafter pass (`_batch_round`). Tokens are chosen per
request (its own sampling draws, sampling.py) and cut at its stop or length (`_emit`). A part of the
Engine (engine.py), on its state: the runners, the tree builder, the scheduler's budgets."""

from __future__ import annotations

import torch

from .sampling import PendingLogprobs, choose_tokens, start_logprobs, suppress_stops
from .tree import Tree, Walk, walk, walk_rows
from .types import RequestState, RoundOutput, TokenLogprob

# A round's result for one request: the tokens it committed, the draft tokens accepted among them, and
# their log-probabilities (None unless the request asked for them).
Round = tuple[list[int], int, list[TokenLogprob] | None]


class Rounds:
    """The Engine's rounds (mixed into Engine: its runners, tree builder, readbacks and scheduler)."""

    def _emit(self, req: RequestState, tokens: list[int], accepted: int,
              logprobs: list[TokenLogprob] | None = None) -> RoundOutput:
        """Cut the round's tokens (and their log-probabilities) at the first stop token or at
        max_new_tokens (`_emitted`)."""
        kept = tokens[:self._emitted(req, tokens)]
        req.generated += len(kept)
        logprobs = _cut(logprobs, len(kept))
        if kept and kept[-1] in req.stop_ids:
            return RoundOutput(kept, accepted, True, "stop", logprobs=logprobs)
        if req.generated >= req.params.max_new_tokens:
            return RoundOutput(kept, accepted, True, "length", logprobs=logprobs)
        return RoundOutput(kept, accepted, False, None, logprobs=logprobs)

    def _choose(self, req: RequestState, logits: torch.Tensor, position: int,
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

    def _phase(self, name: str) -> None:
        if self.phase_hook is not None:
            self.phase_hook(name)

    # ---- a lone request: the single-stream path ---------------------------------------------------

    def _ar_step(self, req: RequestState) -> Round:
        """One token; the next step is queued (from the device's token) before this one's token is
        read, so the device never waits for the host between steps."""
        self._phase("step")
        token, pending = req.ahead, req.ahead_logprobs
        if token is None:  # the first step after the prefill or after batched rounds
            logits = self.runner.run(req.bonus, req.n_ctx).logits
            token = self._choose(req, logits, req.generated)
            pending = self._logprobs(req, logits, token)
        self.runner.cache.compact(req.n_ctx, [0], self.root_node)  # no-op for KV; advances a recurrent state
        req.n_ctx += 1
        self.readback.start(token)
        logits = self.runner.run(token, req.n_ctx).logits
        req.ahead = self._choose(req, logits, req.generated + 1)
        req.ahead_logprobs = self._logprobs(req, logits, req.ahead)
        req.bonus = self.readback.wait()[0]
        self.stats.batch_size, self.stats.tree_nodes = 1, 1
        self._phase("end")
        return [req.bonus], 0, None if pending is None else pending.rows([0])

    def _spec_round(self, req: RequestState) -> Round:
        """Build the tree from the draft, verify, choose and walk, then queue the next round's drafter
        pass from the walk's device-side result: one host sync a round (the walk's result), and the
        device is busy with the next draft while the host reads it."""
        self._phase("tree")
        budget = self.scheduler.tree_budgets([req], self.config.round_nodes)[0]
        tree = req.mode.tree(self.trees, req.drafted, budget, self.block_size)
        self._phase("verify")
        out = self.runner.run(req.bonus, req.n_ctx, tree)               # logits [N, V], feats [1, N, F]
        self.stats.batch_size, self.stats.tree_nodes = 1, tree.size
        self._phase("commit")
        target = self._choose(req, out.logits, req.generated, out.depths)  # the target's token per node
        pending = self._logprobs(req, out.logits, target)
        result = walk(out.tokens, out.parents, out.depths, out.mask, target, self.block_size - 1)
        self.readback.start(result)
        self._phase("draft")
        length, bonus, rows = Walk.on_device(result, self.block_size - 1)
        req.drafted = self.draft_runner.run(bonus, length, rows, out.feats, req.n_ctx)
        self._phase("commit")
        accepted = Walk.read(self.readback.wait(), self.block_size - 1)
        tokens = accepted.tokens[1:] + [accepted.next_token]
        keep = self._emitted(req, tokens)  # a finishing round commits only what it emits (see _emitted)
        # the accepted path's KV, moved to right after the context (by the walk's own device copy of it)
        self.runner.cache.compact(req.n_ctx, accepted.path[:keep], rows[:keep])
        req.n_ctx += keep
        req.bonus = tokens[keep - 1]
        self._phase("end")
        # the committed tokens are the ones chosen at the path's nodes: its tokens past the root, then the bonus
        logprobs = None if pending is None else pending.rows(accepted.path[:keep])
        return tokens[:keep], len(accepted.path) - 1, logprobs

    @staticmethod
    def _emitted(req: RequestState, tokens: list[int]) -> int:
        """How many of a round's tokens the request emits (`_emit`: up to a stop or max_new_tokens). A
        round that finishes the request commits only those, so the cache it leaves behind ends where
        the client's text does, which is where a next turn can continue it (a hybrid's state cannot be
        wound back to there later)."""
        for i, t in enumerate(tokens):
            if t in req.stop_ids or req.generated + i + 1 >= req.params.max_new_tokens:
                return i + 1
        return len(tokens)

    # ---- a batch: one verify pass for every request's tree ----------------------------------------

    def _batch_round(self, reqs: list[RequestState]) -> list[Round]:
        """draft (queued by the last round) -> each request's tree -> one verify pass over all of them
        -> each row's walk -> one drafter pass for the next round, queued before the host reads the
        walks -> each row's commit. Rows are slots 0..B-1."""
        depth = self.block_size - 1
        settled_logprobs = [_rows_of(req.ahead_logprobs) for req in reqs]  # taken before _settle drops them
        settled = [self._settle(req) for req in reqs]
        self._phase("tree")
        budgets = self.scheduler.tree_budgets(reqs, self.config.round_nodes)
        trees = self._batch_trees(reqs, budgets)
        self._phase("verify")
        starts = [req.n_ctx for req in reqs]
        out = self.batch_runner.run([req.bonus for req in reqs], starts, trees)
        sizes = [1 if tree is None else tree.size for tree in trees]
        self.stats.batch_size, self.stats.tree_nodes = len(reqs), sum(sizes)
        self._phase("commit")
        target = out.logits.argmax(dim=-1)                               # [B, T] the target's token per node
        positions = [req.generated + len(settled[row]) for row, req in enumerate(reqs)]
        for row, req in enumerate(reqs):
            p = req.params
            if p.temperature > 0 or p.logit_bias or positions[row] < p.min_tokens:  # as alone, its own draws
                target[row, :sizes[row]] = self._choose(req, out.logits[row, :sizes[row]], positions[row],
                                                        out.depths[row, :sizes[row]])
        pending = [self._logprobs(req, out.logits[row, :sizes[row]], target[row, :sizes[row]])
                   for row, req in enumerate(reqs)]
        result = walk_rows(out.tokens, out.parents, out.depths, out.mask, target, depth)   # [B', W]
        n = len(reqs)
        self.batch_readback.start(result[:n].flatten())
        drafted = None
        if any(req.mode.drafts for req in reqs):
            self._phase("draft")
            drafted = self.batch_draft.run(result[:, 1], result[:, 0], result[:, 2:3 + depth], out.feats, starts)
        self._phase("commit")
        host = self.batch_readback.wait()
        rounds, width = [], Walk.size(depth)
        moved = 0  # the longest committed path not already in place (compact_rows)
        for row, req in enumerate(reqs):
            accepted = Walk.read(host[row * width:(row + 1) * width], depth)
            tokens = settled[row] + accepted.tokens[1:] + [accepted.next_token]
            # a finishing row commits only what it emits (_emitted), its root at least
            keep = max(self._emitted(req, tokens), len(settled[row]) + 1)
            path = keep - len(settled[row])
            if path < len(accepted.path):
                result[row, 0] = path  # the commit's length (the drafter pass queued before read the walk's)
            if accepted.path[:path] != list(range(path)):
                moved = max(moved, path)
            req.n_ctx += path
            req.bonus = tokens[keep - 1]
            if req.mode.drafts:
                req.drafted = drafted[row]
            logprobs = None
            if pending[row] is not None:
                logprobs = (settled_logprobs[row] + pending[row].rows(accepted.path))[:keep]
            rounds.append((tokens[:keep], len(accepted.path) - 1, logprobs))
        # only the KV of paths that are not in place already moves (none for a batch of AR steps)
        self.target_cache.rows(0, n).compact_rows(out.start[:n], result[:n, 2:3 + depth], result[:n, 0], moved)
        self._phase("end")
        return rounds

    def _settle(self, req: RequestState) -> list[int]:
        """An AR request coming from the single-stream path has its next pass already run and its
        token chosen (req.ahead): commit that pass and take the token, as its next step would."""
        if req.ahead is None:
            return []
        self.runner.cache.compact(req.n_ctx, [0], self.root_node)  # it ran alone: it is in slot 0
        req.n_ctx += 1
        req.bonus = int(req.ahead[0])
        req.ahead = req.ahead_logprobs = None
        return [req.bonus]

    def _batch_trees(self, reqs: list[RequestState], budgets: list[int]) -> list[Tree | None]:
        """Each request's tree (None: AR): the requests of one mode and budget built together."""
        groups: dict[tuple, list[int]] = {}
        for row, req in enumerate(reqs):
            groups.setdefault((req.mode.name, budgets[row]), []).append(row)
        trees: list[Tree | None] = [None] * len(reqs)
        for (_, budget), rows in groups.items():
            mode = reqs[rows[0]].mode
            for row, tree in zip(rows, mode.trees(self.trees, [reqs[r].drafted for r in rows], budget,
                                                  self.block_size)):
                trees[row] = tree
        return trees


def _cut(logprobs: list[TokenLogprob] | None, n: int) -> list[TokenLogprob] | None:
    return None if logprobs is None else logprobs[:n]


def _rows_of(pending: PendingLogprobs | None) -> list[TokenLogprob]:
    return [] if pending is None else pending.rows([0])

"""A round: draft (queued by the last round) -> build trees -> verify -> accept and commit, for the
requests decoding; a lone request is a batch of one.

One target pass verifies every request's tree (an AR request's root alone), one walk finds each
accepted path, and the next round's first pass is queued from the walk's device result before the host
reads it: one drafter pass for the requests that draft, and for a lone AR request its next step
(`_run_ahead`), so the device does not wait for the host between rounds. One host sync a round. Tokens
are chosen per request (its own sampling draws, sampling.py) and cut at its stop or length (`_emit`). A
part of the Engine (engine.py), on its state: the runners, the tree builder, the scheduler's budgets."""

from __future__ import annotations

import torch

from .runner import TreePass
from .sampling import PendingLogprobs, choose_tokens, start_logprobs, suppress_stops
from .tree import Tree, Walk, walk
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

    # ---- the round --------------------------------------------------------------------------------

    def _round(self, reqs: list[RequestState]) -> list[Round]:
        """draft (queued by the last round) -> each request's tree -> one verify pass over all of them
        -> the walks -> the next round's first pass, queued before the host reads the walks -> each
        row's commit. Rows are the pool's rows 0..B-1."""
        depth, n = self.block_size - 1, len(reqs)
        drafting = any(req.mode.drafts for req in reqs)
        ahead = n == 1 and not drafting  # a lone AR request: its next step runs before this one's read
        settled_logprobs = [[] if ahead else _rows_of(req.ahead_logprobs) for req in reqs]  # _settle drops them
        settled = [[] if ahead else self._settle(req) for req in reqs]
        self._phase("tree")
        budgets = self.scheduler.tree_budgets(reqs, self.config.round_nodes)
        trees = self._trees(reqs, budgets)
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
        self.readback.start(result[:n].flatten())
        drafted = None
        if drafting:
            self._phase("draft")
            drafted = self.draft_runner.run(result[:, 1], result[:, 0], result[:, 2:3 + depth], out.feats, starts)
        elif ahead:
            self._phase("verify")
            self._run_ahead(reqs[0], result)
        self._phase("commit")
        host = self.readback.wait()
        width = Walk.size(depth) if drafting else 1
        rounds = []
        moved = 0  # the longest committed path not already in place (KVCache.compact)
        for row, req in enumerate(reqs):
            cells = host[row * width:(row + 1) * width]
            accepted = Walk.read(cells, depth) if drafting else Walk([0], [req.bonus], cells[0])
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
        # only the KV of paths that are not in place already moves (none for AR steps, whose pass ahead
        # committed this one's already)
        if drafting:
            self.target_cache.rows(0, n).compact(out.start[:n], result[:n, 2:3 + depth], result[:n, 0], moved)
        elif not ahead:
            self._commit_roots(0, n)
        self._phase("end")
        return rounds

    def _verify(self, reqs: list[RequestState], roots: list[int] | torch.Tensor, starts: list[int],
                trees: list[Tree | None], positions: list[int]) -> tuple[TreePass, torch.Tensor,
                                                                         list[PendingLogprobs | None]]:
        """One target pass over the rows' trees (TargetRunner.run), then the target's token at every
        node, [B', T]: the greedy rows' by one argmax over the batch, the others' by their own draws as
        alone (row b's node at depth d chooses output token positions[b] + d); and the log-probabilities
        of the rows that asked for them."""
        out = self.runner.run(roots, starts, trees)
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
        """A lone AR request's next step, queued from this step's token on the device ([1] `tokens`)
        before the host reads it: this step's pass is committed (only a hybrid's state moves), the next
        one runs at the next position and its token is chosen; both wait in req.ahead for the next
        round (or _settle)."""
        self._commit_roots(req.slot, req.slot + 1)
        _, req.ahead, (req.ahead_logprobs,) = self._verify([req], tokens, [req.n_ctx + 1], [None],
                                                           [req.generated + 1])

    def _settle(self, req: RequestState) -> list[int]:
        """An AR request that ran alone has its next step's pass already run and its token chosen
        (req.ahead): commit that pass and take the token, as its next round would."""
        if req.ahead is None:
            return []
        self._commit_roots(req.slot, req.slot + 1)
        req.n_ctx += 1
        req.bonus = int(req.ahead[0, 0])
        req.ahead = req.ahead_logprobs = None
        return [req.bonus]

    def _commit_roots(self, lo: int, hi: int) -> None:
        """Commit the AR steps of rows lo..hi-1: each path is its root, already in place, so only a
        hybrid's recurrent state moves on (nothing at all for attention-only KV)."""
        self.target_cache.rows(lo, hi).compact(None, self.root_paths[:hi - lo], self.root_lengths[:hi - lo], moved=0)

    def _trees(self, reqs: list[RequestState], budgets: list[int]) -> list[Tree | None]:
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

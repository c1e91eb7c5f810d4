"""The drafter's own forecast of how many of a tree's draft tokens the target will accept, on the device.

A node's score (tree.py) is its path's summed per-depth log-probability under the drafter, so exp(score)
is the drafter's probability that the target follows that whole path. Every accepted draft token is one
node on the accepted path, so the expected count is the sum of exp(score) over the tree's nodes; for the
best-first tree of b nodes, the b best scores (its prefix). The build chose the tree from each level's
best path scores (tree.scored_trees), so one tree built at a request's largest budget forecasts every
smaller budget from those, and the engine verifies a prefix of it. The drafter is not calibrated (its
depths are drafted independently of each other), so the policy scales the forecast by what each request
accepted against it (policy.Acceptance)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

MILLI = 1000  # forecasts travel to the host as integers (the round's one int64 read), in thousandths


def forecast_accepted(scores: torch.Tensor, nodes: int, budgets: Sequence[int]) -> torch.Tensor:
    """scores [R, D, B] (each level's best path scores, tree.scored_trees) of R trees of `nodes` draft
    nodes -> [R, len(budgets)] expected accepted draft tokens of the tree's first b nodes, for each b in
    budgets, in thousandths (int64). Seven device ops, nothing waits for the device: the scores come
    with the build, where reading each node's log-prob again from the drafts took a log-sum-exp over
    the vocabulary and ~40 launches a tree round, in the host's window before the verify."""
    best = scores.flatten(1).topk(nodes, dim=1).values                           # [R, N] best first
    expected = best.exp().cumsum(dim=1)
    cols = _columns(tuple(min(b, nodes) - 1 for b in budgets), scores.device)
    return (expected.index_select(1, cols) * MILLI).round().long()


@functools.cache
def _columns(cols: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The columns as a device tensor, made once (a copy from the host each round would wait for the device)."""
    return torch.tensor(cols, device=device)

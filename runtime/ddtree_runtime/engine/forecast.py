"""The drafter's own forecast of how many of a tree's draft tokens the target will accept, on the device.

A node's score (tree.py) is its path's summed per-depth log-probability under the drafter, so exp(score)
is the drafter's probability that the target follows that whole path. Every accepted draft token is one
node on the accepted path, so the expected count is the sum of exp(score) over the tree's nodes; for the
best-first tree of b nodes, over the first b nodes of a bigger one (its prefix). One tree built at a
request's largest budget thus forecasts every smaller budget, and the engine verifies a prefix of it.
The drafter is not calibrated (its depths are drafted independently of each other), so the policy
scales the forecast by what each request accepted against it (policy.Acceptance)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

MILLI = 1000  # forecasts travel to the host as integers (the round's one int64 read), in thousandths


def forecast_accepted(nodes: torch.Tensor, drafts: torch.Tensor, budgets: Sequence[int]) -> torch.Tensor:
    """nodes [R, 3, N] (tokens, parents, depths; best first) of trees built from draft logits drafts
    [R, D, V] -> [R, len(budgets)] expected accepted draft tokens of the tree's first b nodes, for each b
    in budgets, in thousandths (int64). A fixed sequence of device ops: nothing waits for the device."""
    tokens, parents, depths = nodes.unbind(1)                                    # [R, N] each
    rows, depth, vocab = drafts.shape
    at = (depths - 1).clamp(0, depth - 1)
    lse = torch.logsumexp(drafts.float(), dim=-1)                                # [R, D]
    own = drafts.flatten(1).gather(1, at * vocab + tokens).float() - lse.gather(1, at)   # [R, N] log p(token)
    # a path's score: the sum of its nodes' own log-probs, by pointer jumping over [root, nodes] (the
    # root at 0, its own parent, scoring 0): each step adds the sum of the 2^k nodes above and doubles
    # the stride, so ceil(log2 depth) steps (4 at depth 15, against 14 one level at a time: 26 fewer
    # launches a tree round, issued while the device runs the drafter pass the host must stay ahead of)
    score = torch.cat([own.new_zeros(rows, 1), own], dim=1)                     # [R, 1 + N]
    up = torch.cat([parents.new_zeros(rows, 1), parents], dim=1)
    for _ in range(max(depth - 1, 0).bit_length()):
        score = score + score.gather(1, up)
        up = up.gather(1, up)
    expected = score[:, 1:].exp().cumsum(dim=1)                                  # [R, N]
    n = expected.shape[1]
    cols = [expected[:, min(b, n) - 1] for b in budgets]
    return (torch.stack(cols, dim=1) * MILLI).round().long()

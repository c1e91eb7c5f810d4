"""How big each request's tree is this round.

A round's verify cost grows with the nodes of all trees in the batch (rows x the padded tree), while
each extra node of a tree buys less acceptance than the one before (best-first order). With a total
node budget per round (`round_nodes`, near the GEMM knee of the device), each request gets an equal
share, rounded down to a tree bucket so no row pays for padding; a request never gets more than its
own budget. None: fixed budgets, each request's own."""

from __future__ import annotations

from .runner import TREE_BUCKETS


def round_budgets(budgets: list[int], rows: int, round_nodes: int | None) -> list[int]:
    """Each request's tree budget (draft nodes) this round, for `rows` requests in the batch."""
    if round_nodes is None:
        return budgets
    share = max(2, round_nodes // rows)                      # nodes per row, the root included
    cap = max(b for b in TREE_BUCKETS if b <= share) - 1
    return [min(budget, cap) for budget in budgets]

"""Tree builder and verification-walk unit tests (no models needed)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ddtree_runtime.engine.tree import build_chain, build_tree, walk


def _logprobs(depth: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(depth, vocab, generator=g) * 2.5, dim=-1)


def _score(lp: torch.Tensor, tree, i: int) -> float:
    """Cumulative draft log-prob of node i: the sum of its path's per-depth log-probs."""
    s = 0.0
    while i != 0:
        s += lp[int(tree.depths[i]) - 1, tree.token_list[i]].item()
        i = int(tree.parents[i])
    return s


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_budget_respected_and_structure(budget):
    lp = _logprobs(15, 50, budget)
    t = build_tree(3, lp, budget)
    assert t.size == budget + 1                       # enough candidates: the budget is filled exactly
    assert t.token_list[0] == 3 and int(t.depths[0]) == 0
    for i in range(1, t.size):
        p = int(t.parents[i])
        assert p < i                                  # parents precede children
        assert int(t.depths[i]) == int(t.depths[p]) + 1
    # no two children of one parent carry the same token
    assert len(t.children) == t.size - 1


def test_best_first_order_is_the_top_budget_set():
    # depth 3, vocab 4: every path prefix can be enumerated; since log-probs are <= 0 the best
    # `budget` prefixes are closed under taking parents, so best-first must select exactly them
    lp = _logprobs(3, 4, 1)
    budget = 20
    t = build_tree(0, lp, budget)
    scores = [_score(lp, t, i) for i in range(1, t.size)]
    assert all(a >= b - 1e-6 for a, b in zip(scores, scores[1:]))  # popped in best-first order
    every = [sum(lp[d, tok].item() for d, tok in enumerate(path))
             for depth in (1, 2, 3) for path in itertools.product(range(4), repeat=depth)]
    best = sorted(every, reverse=True)[:budget]
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(scores, best))


def test_sibling_and_child_pushes():
    # depth 1 favours token 5 then 6; depth 2 favours token 7 then 8, with a large margin
    lp = torch.full((3, 10), -20.0)
    lp[0, 5], lp[0, 6] = -0.1, -2.5
    lp[1, 7], lp[1, 8] = -0.2, -3.0
    lp[2, 9] = -0.3
    t = build_tree(1, lp, 4)
    # pops: (d1 r0)=5 -> pushes sibling 6 and child 7; 7 (-0.3) -> child 9 (-0.6); 9; then sibling 6 (-2.5)
    assert t.token_list == [1, 5, 7, 9, 6]
    assert t.parents.tolist() == [0, 0, 1, 2, 0]
    assert t.depths.tolist() == [0, 1, 2, 3, 1]


def test_ancestor_mask():
    lp = _logprobs(8, 12, 7)
    t = build_tree(0, lp, 32)
    for i in range(t.size):
        anc = {i}
        j = i
        while j != 0:
            j = int(t.parents[j])
            anc.add(j)
        expect = [k in anc for k in range(t.size)]
        assert t.mask[i].tolist() == expect


def test_depth_capped_by_budget_and_draft_length():
    lp = torch.zeros(15, 4)
    lp[:, 0] = 0.0
    lp[:, 1:] = -50.0
    t = build_tree(0, lp, 64)
    assert int(t.depths.max()) == 15                  # a confident drafter gives a deep chain
    t2 = build_tree(0, lp, 3)
    assert t2.depths.tolist() == [0, 1, 2, 3]


def test_chain():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    t = build_chain(9, logits)
    assert t.token_list == [9, 1, 0, 2]
    assert t.parents.tolist() == [0, 0, 1, 2]
    assert t.mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def test_walk_follows_target_tokens():
    t = build_tree(1, torch.tensor([[-0.1, -1.0, -9, -9], [-0.1, -1.0, -9, -9]]), 4)
    # nodes: 0 root(1); 1 tok0 d1; 2 tok0 d2 (child of 1); 3 tok1 d1 ... (structure checked via dict)
    target = [None] * t.size
    # root -> wants token 0 (node 1) -> node 1 wants 1 (its rank-1 child, if present) else stops
    target[0] = 0
    for i in range(1, t.size):
        target[i] = 3  # a token no child has: stop there
    assert walk(t, target) == [0, 1]
    target[1] = 0
    assert walk(t, target) == [0, 1, t.children[(1, 0)]]
    target[0] = 3
    assert walk(t, target) == [0]

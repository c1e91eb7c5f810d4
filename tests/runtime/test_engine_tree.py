"""Tree builder and verification-walk unit tests (no models needed): the device-side build against a
brute-force enumeration of every draft path, and the walk against a host-side reference."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ddtree_runtime.engine.tree import (Walk, ancestor_mask, build_chain, build_tree, build_trees, top_tokens, tree_size,
                                        walk)


def _logits(depth: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(depth, vocab, generator=g) * 2.5


def _full(tree, root: int = 0) -> tuple[list[int], list[int], list[int]]:
    """Host lists of the whole tree, root included: tokens, parents, depths."""
    return ([root, *tree.tokens.tolist()], [0, *tree.parents.tolist()], [0, *tree.depths.tolist()])


def _score(lp: torch.Tensor, tree, i: int) -> float:
    """Cumulative draft log-prob of node i: the sum of its path's per-depth log-probs."""
    tokens, parents, depths = _full(tree)
    s = 0.0
    while i != 0:
        s += lp[depths[i] - 1, tokens[i]].item()
        i = parents[i]
    return s


def _children(tree) -> dict[tuple[int, int], int]:
    tokens, parents, _ = _full(tree)
    return {(parents[i], tokens[i]): i for i in range(1, len(tokens))}


@pytest.mark.parametrize("drafts", [None, 3])
@pytest.mark.parametrize("vocab,budget", [(300, 16), (1187 * 4, 64), (97, 8), (5, 16)])
def test_top_tokens_are_the_log_softmax_top_k(vocab, budget, drafts):
    # drafts: one draft [D, V], or a batched round's [R, D, V] (each draft its own logits); the Triton
    # form (CUDA) runs in tests/runtime/test_triton_kernels.py, under Triton's interpreter
    logits = _logits(15, vocab, vocab) if drafts is None else torch.stack(
        [_logits(15, vocab, vocab + r) for r in range(drafts)])
    lp, ids, n = top_tokens(logits, budget)
    depth = min(15, budget)                           # a tree of `budget` nodes reaches no deeper
    exact = torch.log_softmax(logits[..., :depth, :], dim=-1)
    assert lp.shape == ids.shape == (*logits.shape[:-2], depth, min(budget, vocab))
    assert torch.allclose(lp, exact.topk(min(budget, vocab), dim=-1).values, atol=1e-5)
    assert torch.allclose(exact.gather(-1, ids), lp, atol=1e-5)
    assert n == tree_size(budget, depth, vocab) - 1


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_budget_respected_and_structure(budget):
    t = build_tree(_logits(15, 50, budget), budget)
    assert t.size == budget + 1                       # enough candidates: the budget is filled exactly
    _, parents, depths = _full(t)
    for i in range(1, t.size):
        assert parents[i] < i                         # parents precede children
        assert depths[i] == depths[parents[i]] + 1
    assert len(_children(t)) == t.size - 1            # no two children of one parent share a token


@pytest.mark.parametrize("seed", range(4))
def test_best_first_order_is_the_top_budget_set(seed):
    # depth 3, vocab 4: every draft path can be enumerated; since log-probs are <= 0 the best
    # `budget` paths are closed under taking parents, and the tree must be exactly them, best first
    logits = _logits(3, 4, seed)
    lp = torch.log_softmax(logits, dim=-1)
    budget = 20
    t = build_tree(logits, budget)
    scores = [_score(lp, t, i) for i in range(1, t.size)]
    assert all(a >= b - 1e-6 for a, b in zip(scores, scores[1:]))  # best-first order
    every = [sum(lp[d, tok].item() for d, tok in enumerate(path))
             for depth in (1, 2, 3) for path in itertools.product(range(4), repeat=depth)]
    best = sorted(every, reverse=True)[:budget]
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(scores, best))


def test_siblings_and_children_interleave_by_score():
    # depth 1 favours token 5 then 6; depth 2 favours 7 then 8; depth 3 favours 9; large margins
    logits = torch.full((3, 10), -20.0)
    logits[0, 5], logits[0, 6] = -0.1, -2.5
    logits[1, 7], logits[1, 8] = -0.2, -3.0
    logits[2, 9] = -0.3
    t = build_tree(logits, 4)
    # 5 (-0.1), its child 7 (-0.3), that one's child 9 (-0.6), then the sibling 6 (-2.5)
    assert _full(t, root=1) == ([1, 5, 7, 9, 6], [0, 0, 1, 2, 0], [0, 1, 2, 3, 1])


def test_a_certain_drafter_ties_parent_and_child_and_the_parent_comes_first():
    # the top token's log-prob rounds to exactly 0 at every depth: a path and its extensions tie
    logits = torch.zeros(15, 4)
    logits[:, 0] = 200.0
    assert torch.log_softmax(logits, dim=-1)[:, 0].eq(0).all()
    t = build_tree(logits, 5)
    assert _full(t) == ([0, 0, 0, 0, 0, 0], [0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5])


def test_depth_capped_by_budget_and_draft_length():
    logits = torch.full((15, 4), -50.0)
    logits[:, 0] = 0.0
    t = build_tree(logits, 64)
    assert int(t.depths.max()) == 15                  # a confident drafter gives a deep chain
    assert _full(build_tree(logits, 3))[2] == [0, 1, 2, 3]


def test_small_vocab_bounds_the_tree():
    # vocab 2 and depth 3 hold 2 + 4 + 8 paths: a budget of 64 cannot be filled
    assert tree_size(64, 3, 2) == 15
    t = build_tree(_logits(3, 2, 0), 64)
    assert t.size == 15 and len(_children(t)) == 14


def test_ancestor_mask():
    t = build_tree(_logits(8, 12, 7), 32)
    _, parents, _ = _full(t)
    mask = ancestor_mask(torch.tensor(parents), 8)
    for i in range(t.size):
        anc, j = {i}, i
        while j != 0:
            j = parents[j]
            anc.add(j)
        assert mask[i].tolist() == [k in anc for k in range(t.size)]


def test_chain():
    t = build_chain(torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]]))
    assert _full(t, root=9) == ([9, 1, 0, 2], [0, 0, 1, 2], [0, 1, 2, 3])


def _walk_on_host(tree, root: int, target: list[int]) -> list[int]:
    children, path = _children(tree), [0]
    while (path[-1], target[path[-1]]) in children:
        path.append(children[(path[-1], target[path[-1]])])
    return path


def _walk_one(tokens, parents, depths, mask, target, depth):
    """walk() over one tree (a lone request: a batch of one), its row as a host list."""
    return walk(tokens[None], parents[None], depths[None], mask[None], target[None], max_depth=depth)[0].tolist()


@pytest.mark.parametrize("seed", range(20))
def test_walk_follows_the_target_like_the_host_reference(seed):
    g = torch.Generator().manual_seed(seed)
    vocab, depth = 3, 6
    t = build_tree(_logits(depth, vocab, seed), 24)
    tokens, parents, depths = (torch.tensor(x) for x in _full(t, root=2))
    mask = ancestor_mask(parents, depth)
    target = torch.randint(0, vocab, (t.size,), generator=g)
    # follow the tree's own best path a random number of steps, so long walks are tested too
    for i in range(1, t.size):
        if torch.rand(1, generator=g).item() < 0.7:
            target[parents[i]] = tokens[i]
    expect = _walk_on_host(t, 2, target.tolist())
    got = Walk.read(_walk_one(tokens, parents, depths, mask, target, depth), depth)
    assert got.path == expect
    assert got.tokens == tokens[expect].tolist()
    assert got.next_token == target[expect[-1]].item()


def test_walk_of_a_rejected_root_is_the_root_alone():
    t = build_chain(torch.eye(4)[:3] * 5)           # tokens 0, 1, 2
    tokens, parents, depths = (torch.tensor(x) for x in _full(t, root=3))
    target = torch.tensor([3, 1, 2, 3])             # the root wants 3; no child carries it
    got = Walk.read(_walk_one(tokens, parents, depths, ancestor_mask(parents, 3), target, 3), 3)
    assert got == ([0], [3], 3)
    target[0] = 0                                   # accepted all the way: the last node's token follows
    got = Walk.read(_walk_one(tokens, parents, depths, ancestor_mask(parents, 3), target, 3), 3)
    assert got == ([0, 1, 2, 3], [3, 0, 1, 2], 3)


def test_build_trees_builds_each_rows_tree():
    """The batched build (a batched round's requests of one budget) gives each row build_tree's tree."""
    g = torch.Generator().manual_seed(7)
    for budget, depth, vocab in [(16, 15, 300), (33, 7, 3), (7, 3, 2), (1, 15, 20), (64, 15, 50)]:
        x = torch.randn(4, depth, vocab, generator=g) * 3
        nodes = build_trees(x, budget)
        for row in range(4):
            assert torch.equal(nodes[row], build_tree(x[row], budget).nodes), (budget, row)

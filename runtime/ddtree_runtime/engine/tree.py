"""Draft trees: best-first DDTree construction under a node budget, the DFlash chain, and the
verification walk.

A tree is flat: node 0 is the root (the last committed token), nodes 1..N-1 are draft tokens in the
order they were popped, so a parent always precedes its children. The drafter gives one distribution
per depth (not per path), so the score of a node is the sum of its ancestors' per-depth log-probs."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass
class Tree:
    # tensors live on the host (the runner copies them to the device with the rest of its inputs)
    tokens: torch.Tensor   # [N] long, token at each node (node 0 = root)
    parents: torch.Tensor  # [N] long, parent index (root points at itself)
    depths: torch.Tensor   # [N] long, root = 0
    mask: torch.Tensor     # [N, N] bool, mask[i, j] = j is i or an ancestor of i
    token_list: list[int]  # host copies for the walk (no device syncs per step)
    children: dict[tuple[int, int], int]  # (parent, token) -> child index

    @property
    def size(self) -> int:
        return len(self.token_list)


def _finish(tokens: list[int], parents: list[int], depths: list[int], device: torch.device) -> Tree:
    # the tree's tensors stay on the host, where they are built (a few microseconds per op, against
    # tens for a device launch); the runner copies them into its static device buffers in one go
    del device
    n = len(tokens)
    par = torch.tensor(parents, dtype=torch.long)
    dep = torch.tensor(depths, dtype=torch.long)
    # ancestor mask by pointer chasing: max_depth vectorised steps instead of one loop per node
    mask = torch.eye(n, dtype=torch.bool)
    rows = torch.arange(n)
    cur = rows
    for _ in range(max(depths)):
        cur = par[cur]
        mask[rows, cur] = True
    children = {(parents[i], tokens[i]): i for i in range(1, n)}
    return Tree(torch.tensor(tokens, dtype=torch.long), par, dep, mask, tokens, children)


def build_tree(root: int, draft_logprobs: torch.Tensor, budget: int) -> Tree:
    """Best-first tree with at most `budget` draft nodes.

    draft_logprobs: [D, V] log-probs for depths 1..D. A max-heap holds frontier candidates keyed by
    cumulative log-prob; popping (depth d, rank r, parent p) adds the node and pushes its next sibling
    (d, r+1, p) and its first child (d+1, 0, node). Only top-`budget` tokens per depth can ever be used.
    """
    depth_max = min(draft_logprobs.shape[0], budget)
    k = min(budget, draft_logprobs.shape[1])
    top_lp, top_id = draft_logprobs[:depth_max].topk(k, dim=-1)  # [D, K] each
    lp, ids = top_lp.tolist(), top_id.tolist()  # one host transfer for the whole build

    tokens, parents, depths = [root], [0], [0]
    # heap entries: (-score, seq, depth, rank, parent, parent_score); seq keeps ties in push order
    heap = [(-lp[0][0], 0, 1, 0, 0, 0.0)]
    seq = 1
    while heap and len(tokens) <= budget:
        neg, _, d, r, p, pscore = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[d - 1][r])
        parents.append(p)
        depths.append(d)
        if r + 1 < k:
            heapq.heappush(heap, (-(pscore + lp[d - 1][r + 1]), seq, d, r + 1, p, pscore))
            seq += 1
        if d < depth_max:
            heapq.heappush(heap, (neg - lp[d][0], seq, d + 1, 0, node, -neg))
            seq += 1
    return _finish(tokens, parents, depths, draft_logprobs.device)


def build_chain(root: int, draft_logits: torch.Tensor) -> Tree:
    """DFlash's single path: the top-1 token at every depth. draft_logits: [D, V]."""
    ids = draft_logits.argmax(dim=-1).tolist()
    n = len(ids)
    # node i's parent is node i-1 (the root is its own parent)
    return _finish([root, *ids], [0, *range(n)], list(range(n + 1)), draft_logits.device)


def walk(tree: Tree, target_tokens: list[int]) -> list[int]:
    """Follow the target: from the root, move to the child whose token equals the target's token at the
    current node, while one exists. Returns the accepted path as node indices, root first."""
    path = [0]
    while True:
        child = tree.children.get((path[-1], target_tokens[path[-1]]))
        if child is None:
            return path
        path.append(child)

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
    # host lists: the runner stages them into its pinned input buffer and builds the ancestor mask on
    # the device (engine/runner.py), so a round allocates no mask on the host
    token_list: list[int]  # token at each node (node 0 = root)
    parent_list: list[int]  # parent index (the root points at itself)
    depth_list: list[int]  # root = 0
    children: dict[tuple[int, int], int]  # (parent, token) -> child index, for the walk

    @property
    def size(self) -> int:
        return len(self.token_list)

    @property
    def tokens(self) -> torch.Tensor:
        return torch.tensor(self.token_list, dtype=torch.long)

    @property
    def parents(self) -> torch.Tensor:
        return torch.tensor(self.parent_list, dtype=torch.long)

    @property
    def depths(self) -> torch.Tensor:
        return torch.tensor(self.depth_list, dtype=torch.long)

    @property
    def mask(self) -> torch.Tensor:
        """[N, N] bool, mask[i, j] = j is i or an ancestor of i (for inspection; the runner builds its own)."""
        return ancestor_mask(self.parents, max(self.depth_list))


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[N] parent indices (a root or padding node points at itself) -> [N, N] ancestor-or-self mask, as
    the reachability (I + P)^(2^s) >= (I + P)^max_depth: ceil(log2 max_depth) squarings, a fixed number
    of device ops whatever the tree (CUDA-graph friendly). Positive counts stay positive in any float
    dtype, so bf16 products are exact enough."""
    n = parents.shape[0]
    rows = torch.arange(n, device=parents.device)
    reach = ((parents[:, None] == rows[None, :]) | (rows[:, None] == rows[None, :])).float()
    for _ in range(max(0, max_depth - 1).bit_length()):
        reach = (reach @ reach).clamp_(max=1.0)
    return reach > 0


def _finish(tokens: list[int], parents: list[int], depths: list[int], device: torch.device) -> Tree:
    del device
    children = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    return Tree(tokens, parents, depths, children)


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

"""Draft trees, built and walked on the device: best-first DDTree construction under a node budget, the
DFlash chain, and the verification walk.

A tree of N nodes: node 0 is the root (the last committed token, staged by the runner from the host),
nodes 1..N-1 are draft tokens in best-first order, so a parent always precedes its children. The drafter
gives one distribution per depth (not per path), so a node's score is the sum of its path's per-depth
log-probs, and the best-first tree under a budget B is the B highest-scoring paths. Every step here is a
fixed sequence of device ops whatever the drafter said (a CUDA graph replays the build), and the round's
one host sync reads the walk's result: path length, next token, path nodes and their tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from . import tree_kernel
from .graphs import capture


class Tree(NamedTuple):
    """The draft nodes 1..N-1 of a tree, on the device (node 0, the root, is implicit), as one [3, N-1]
    long tensor so the runner stages it with one copy: rows tokens, parents (node numbers, the root is
    0) and depths (the root's children are at 1)."""
    nodes: torch.Tensor

    @property
    def size(self) -> int:
        """Nodes including the root."""
        return self.nodes.shape[1] + 1

    @property
    def tokens(self) -> torch.Tensor:
        return self.nodes[0]

    @property
    def parents(self) -> torch.Tensor:
        return self.nodes[1]

    @property
    def depths(self) -> torch.Tensor:
        return self.nodes[2]


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[N] parent indices (a root or padding node points at itself) -> [N, N] ancestor-or-self mask, as
    the reachability (I + P)^(2^s) >= (I + P)^max_depth: ceil(log2 max_depth) squarings, a fixed number
    of device ops whatever the tree (CUDA-graph friendly). Positive counts stay positive in any float
    dtype, so bf16 products are exact enough. A batch of trees, [B, N] -> [B, N, N], works alike."""
    n = parents.shape[-1]
    rows = torch.arange(n, device=parents.device)
    reach = ((parents[..., :, None] == rows) | (rows[:, None] == rows[None, :])).float()
    for _ in range(max(0, max_depth - 1).bit_length()):
        reach = (reach @ reach).clamp_(max=1.0)
    return reach > 0


def tree_size(budget: int, depth: int, vocab: int) -> int:
    """Nodes (root included) of a best-first tree: the budget, unless fewer distinct paths exist."""
    k, paths = min(budget, vocab), 0
    for d in range(1, depth + 1):
        paths += min(budget, k ** d)
        if paths >= budget:
            return budget + 1
    return paths + 1


def top_tokens(draft_logits: torch.Tensor, budget: int,
               chunked: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """[..., D, V] draft logits (one draft [D, V], or a batched round's [R, D, V]) -> the per-depth
    top-K log-probs (float32, descending) and tokens, [..., D', K] for the depths a tree of `budget`
    nodes can reach, and the number of draft nodes it will have.

    On CUDA with Triton, tree_kernel.top_log_probs: one pass over all the rows of all the drafts in
    tiles, then a program per row (a torch top-K over a whole 152K row is a multi-pass radix select
    with one thread block per row: 15 blocks for an H200's 132 processors). Elsewhere (and on CUDA
    without Triton) a row at a time in torch. `chunked` overrides the choice (True: the Triton form,
    which on a CPU runs only under Triton's interpreter, for tests). Exactly equal log-probs: the Triton
    form takes the lower token first; torch's top-K leaves the order among them unspecified."""
    depth, vocab = min(draft_logits.shape[-2], budget), draft_logits.shape[-1]
    k = min(budget, vocab)
    n = tree_size(budget, depth, vocab) - 1
    logits = draft_logits[..., :depth, :]
    if chunked is None:
        chunked = draft_logits.is_cuda and tree_kernel.triton is not None
    if chunked:
        lp, ids = tree_kernel.top_log_probs(logits, k)
        return lp, ids, n
    lp, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return lp, ids, n


def build_tree(draft_logits: torch.Tensor, budget: int) -> Tree:
    """The `budget` most probable draft paths under per-depth distributions, as a tree in best-first
    order. draft_logits: [D, V] for depths 1..D. (In torch, for the CPU and as the reference;
    tree_kernel.py builds the same tree in one Triton program.)

    Only the top-`budget` tokens of a depth can be used, and the best `budget` paths of length d extend
    the best `budget` of length d-1; so level d is a top-k over [budget, K] sums of level d-1's scores
    and depth d's log-probs, then one top-k over all levels picks the tree. A child's score is made
    strictly lower than its parent's (by one float step where the log-prob rounds the sum back to the
    parent's), so the chosen set is closed under taking parents even on ties."""
    lp, ids, n = top_tokens(draft_logits, budget)
    depth, k = lp.shape
    dev = lp.device
    scores = torch.full((depth, budget), float("-inf"), device=dev)
    pick = torch.zeros((depth, budget), dtype=torch.long, device=dev)  # parent slot * K + token rank
    scores[0, :k] = lp[0]
    pick[0, :k] = torch.arange(k, device=dev)  # level 1: slot s is rank s below the root
    below = torch.tensor(float("-inf"), device=dev)
    for d in range(1, depth):
        # child = parent + log-prob, but at most the float just below the parent's score
        ceiling = torch.nextafter(scores[d - 1], below)[:, None]
        child = torch.minimum(scores[d - 1, :, None] + lp[d, None, :], ceiling)
        torch.topk(child.flatten(), budget, out=(scores[d], pick[d]))
    chosen = scores.flatten().topk(n).indices  # best first
    level, slot = chosen // budget, chosen % budget
    node_of = torch.zeros(depth * budget, dtype=torch.long, device=dev)
    node_of[chosen] = torch.arange(1, n + 1, device=dev)
    node_of = node_of.view(depth, budget)
    flat = pick[level, slot]
    parent_slot, rank = flat // k, flat % k
    parents = torch.where(level > 0, node_of[(level - 1).clamp(min=0), parent_slot], 0)
    return Tree(torch.stack([ids[level, rank], parents, level + 1]))


def build_trees(draft_logits: torch.Tensor, budget: int, chunked: bool | None = None) -> torch.Tensor:
    """build_tree for R drafts at once (the requests of a batched round that share a budget and a
    depth): [R, D, V] -> the draft nodes [R, 3, N-1], row r as build_tree makes them for draft r. One
    sequence of device ops for all R, instead of R builds (torch levels, the reference for
    build_trees_on_gpu; `chunked` as in top_tokens)."""
    return scored_trees(draft_logits, budget, chunked)[0]


def scored_trees(draft_logits: torch.Tensor, budget: int,
                 chunked: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """build_trees, and the scores it chose from: each level's `budget` best path scores [R, D, budget]
    (-inf where a level has fewer paths). The tree's nodes are the N-1 best of them, so the sum of the
    b largest exp(score) is the drafter's own forecast for the tree of b nodes (forecast.py)."""
    lp, ids, n = top_tokens(draft_logits, budget, chunked)                                   # [R, D, K]
    rows, depth, k = lp.shape
    dev = lp.device
    scores = torch.full((rows, depth, budget), float("-inf"), device=dev)
    pick = torch.zeros((rows, depth, budget), dtype=torch.long, device=dev)
    scores[:, 0, :k] = lp[:, 0]
    pick[:, 0, :k] = torch.arange(k, device=dev)
    below = torch.full((), float("-inf"), device=dev)  # a device fill: graph capture takes no host copy
    for d in range(1, depth):
        ceiling = torch.nextafter(scores[:, d - 1], below)[..., None]                       # [R, B, 1]
        child = torch.minimum(scores[:, d - 1, :, None] + lp[:, d, None, :], ceiling)        # [R, B, K]
        torch.topk(child.flatten(1), budget, dim=-1, out=(scores[:, d], pick[:, d]))
    chosen = scores.flatten(1).topk(n, dim=-1).indices                                      # [R, n] best first
    level = chosen // budget
    node_of = torch.zeros(rows, depth * budget, dtype=torch.long, device=dev)
    node_of.scatter_(1, chosen, torch.arange(1, n + 1, device=dev).expand(rows, n))
    flat = pick.flatten(1).gather(1, chosen)
    parent_slot, rank = flat // k, flat % k
    above = node_of.gather(1, (level - 1).clamp(min=0) * budget + parent_slot)
    parents = torch.where(level > 0, above, 0)
    return torch.stack([ids.flatten(1).gather(1, level * k + rank), parents, level + 1], dim=1), scores


def build_chain(draft_logits: torch.Tensor) -> Tree:
    """DFlash's single path: the top-1 token at every depth. draft_logits: [D, V]."""
    d = draft_logits.shape[0]
    steps = torch.arange(d, device=draft_logits.device)
    return Tree(torch.stack([draft_logits.argmax(dim=-1), steps, steps + 1]))  # node i+1's parent: node i


def build_trees_on_gpu(draft_logits: torch.Tensor, budget: int) -> torch.Tensor:
    """build_trees with the top-K of all R drafts' rows at once (top_tokens), then each draft's levels
    and choice in one Triton program of a launch over the drafts (tree_kernel.py): [R, D, V] -> [R, 3, N-1]."""
    return scored_trees_on_gpu(draft_logits, budget)[0]


def scored_trees_on_gpu(draft_logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """build_trees_on_gpu, and its levels' scores as scored_trees gives them."""
    lp, ids, n = top_tokens(draft_logits, budget)
    return tree_kernel.build_tree_nodes_rows(lp, ids, budget, n)


def build_tree_on_gpu(draft_logits: torch.Tensor, budget: int) -> Tree:
    """build_tree the way build_trees_on_gpu builds a batch: the batch of one draft [D, V]."""
    return Tree(build_trees_on_gpu(draft_logits[None], budget)[0])


class TreeBuilder:
    """The tree build of a round, for R drafts of one budget at once (a lone request: R = 1). On CUDA
    with Triton: a lone draft's top-K and build captured as one CUDA graph per (budget, draft shape)
    and replayed over a static copy of the draft (a few MB); several drafts eagerly, one launch over
    them (build_trees_on_gpu: a graph would need 146 MB of drafts copied in at 16 requests of
    Qwen3-8B, while the few launches queue as the device still runs the drafter pass). build_trees
    elsewhere (graphed per shape on CUDA without Triton).

    vocab_ids [V'] (a draft vocabulary, draft_vocab.py): the drafts' logits are over those target tokens
    only, logit j token vocab_ids[j], and the trees' tokens are mapped to the target's ids here."""

    def __init__(self, device: torch.device, vocab_ids: torch.Tensor | None = None) -> None:
        self.vocab_ids = vocab_ids
        self.cuda = device.type == "cuda"
        self.use_graphs = self.cuda and tree_kernel.triton is not None
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}

    def build(self, draft_logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        """R drafts [R, D, V] -> their trees' nodes [R, 3, N-1] (row r: build_tree's for draft r) and the
        levels' path scores they were chosen from (scored_trees). A graphed build's results are static
        buffers: use them before the next build of that shape."""
        if not self.cuda:
            return self._in_target_ids(scored_trees(draft_logits, budget))
        key = (budget, *draft_logits.shape, draft_logits.dtype)
        if not self.use_graphs:
            return self._replayed(key, lambda logits: self._in_target_ids(scored_trees(logits, budget)), draft_logits)
        if draft_logits.shape[0] > 1:
            return self._in_target_ids(scored_trees_on_gpu(draft_logits, budget))
        return self._replayed(key, lambda logits: self._in_target_ids(scored_trees_on_gpu(logits, budget)),
                              draft_logits)

    def chain(self, draft_logits: torch.Tensor) -> Tree:
        """build_chain's DFlash chain of one draft [D, V], its tokens the target's."""
        return Tree(self._target_tokens(build_chain(draft_logits).nodes[None])[0])

    def _in_target_ids(self, built: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A build's (nodes, scores) with the nodes' tokens the target's (inside a graphed build's capture)."""
        nodes, scores = built
        return self._target_tokens(nodes), scores

    def _target_tokens(self, nodes: torch.Tensor) -> torch.Tensor:
        """Trees' nodes [R, 3, N-1] with their tokens (row 0) made the target's ids, if the drafts were over a
        draft vocabulary (one gather)."""
        if self.vocab_ids is None:
            return nodes
        return torch.cat([self.vocab_ids[nodes[:, :1]], nodes[:, 1:]], dim=1)

    def _replayed(self, key: tuple, build: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                  draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """build(logits) captured once per key over a static copy of the input, then replayed on new
        draft logits; returns the capture's static outputs."""
        if key not in self.graphs:
            logits = draft_logits.clone()
            graph, out = capture(lambda: build(logits), draft_logits.device, self.pool)
            self.graphs[key] = (graph, logits, out)
        graph, logits, out = self.graphs[key]
        logits.copy_(draft_logits)
        graph.replay()
        return out


class Walk(NamedTuple):
    """The accepted path and the target's token after it, as read from walk()'s result."""
    path: list[int]      # accepted node indices, root first
    tokens: list[int]    # the path's tokens (root first)
    next_token: int      # the target's token at the path's last node: the next round's root

    @staticmethod
    def size(max_depth: int) -> int:
        """Length of walk()'s result vector."""
        return 2 + 2 * (max_depth + 1)

    @classmethod
    def read(cls, result: list[int], max_depth: int) -> Walk:
        length, end = result[0], 3 + max_depth
        return cls(result[2:2 + length], result[end:end + length], result[1])


def walk(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor,
         target: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Follow the target from the root while a child carries the target's token at its parent, in each
    row's tree (a round's requests; a lone request is a batch of one). [B, N] node tokens, parents,
    depths and target tokens, [B, N, N] ancestor masks (all on the device) -> [B, Walk.size(max_depth)]
    device vectors (Walk.read parses a row): path length, next token, the path's nodes by depth (zeros
    after the end) and their tokens. No host sync.

    A node is on the accepted path iff it and all its ancestors match their parents' target tokens;
    siblings carry distinct tokens, so the deepest such node is the path's end. Padding nodes (their
    own parents, at depth 0) never outrank the root."""
    b, n = tokens.shape
    matches = tokens == target.gather(1, parents)
    matches[:, :1].fill_(True)  # the root is committed (a fill: `t[:, 0] = True` copies a host scalar and waits)
    on_path = (mask.float() @ (~matches).float()[..., None])[..., 0] == 0     # [B, N]
    # the leaf stays a tensor: indexing with a 0-dim tensor would read it on the host (a sync)
    leaf = torch.argmax(on_path * (depths + 1), dim=1, keepdim=True)          # [B, 1]
    leaf_row = mask.gather(1, leaf[..., None].expand(b, 1, n))[:, 0]          # [B, N] the leaf's path
    row = torch.where(leaf_row, depths, max_depth + 1)
    nodes = torch.zeros(b, max_depth + 2, dtype=torch.long, device=tokens.device)  # (+ a spare slot)
    nodes.scatter_(1, row, torch.arange(n, device=tokens.device).expand(b, n))
    nodes = nodes[:, :max_depth + 1]
    return torch.cat([depths.gather(1, leaf) + 1, target.gather(1, leaf), nodes, tokens.gather(1, nodes)], dim=1)

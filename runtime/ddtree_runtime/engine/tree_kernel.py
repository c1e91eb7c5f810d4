"""The best-first tree build as one Triton program (CUDA): the same tree as tree.build_tree, in a few
microseconds of one thread block instead of a few torch kernels a level (each level is a dependent
top-k, and the torch top-k is a multi-pass radix select: 0.5-3 ms a build on an H200). A batched round's
drafts of one budget are one launch, a program (thread block) per draft over its own rows and scratch.

Per level, the candidates are only the pairs (parent slot i, token rank j) with (i+1)(j+1) <= budget
(a pair outside cannot be in the top `budget`: that many pairs rank at least as high), packed as
int64 keys (score bits in the high word, made to sort like the float, the pair's index in the low
word) and sorted in registers; the top `budget` go to the level's scratch rows."""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs build trees with torch (tree.build_tree)
    triton = None

@functools.cache
def candidate_pairs(budget: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent slot, token rank) pairs that can be among the top `budget` sums of two lists sorted
    descending, of lengths budget and k."""
    pairs = [(i, j) for i in range(budget) for j in range(min(k, budget // (i + 1)))]
    i, j = zip(*pairs)
    return (torch.tensor(i, dtype=torch.int32, device=device),
            torch.tensor(j, dtype=torch.int32, device=device))


if triton is not None:
    INVALID = tl.constexpr(-(2 ** 63 - 1))  # below every packed key: -inf's score word is above INT32_MIN

    @triton.jit
    def _sortable(x):
        """float32 -> int32 that orders like the float (flip the magnitude bits of negatives); its own
        inverse up to the bitcast."""
        b = x.to(tl.int32, bitcast=True)
        return b ^ ((b >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _unsortable(o):
        return (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _build_tree_kernel(lp_ptr, ids_ptr, pi_ptr, pj_ptr, scores_ptr, pick_ptr, keys_ptr, node_ptr,
                           out_ptr, K, B, P, n, KEYS, D: tl.constexpr,
                           BP: tl.constexpr, PP: tl.constexpr, DBP: tl.constexpr, NP: tl.constexpr):
        # program r builds draft r's tree from its lp, ids [D, K] into its out [3, n], over its scratch:
        # scores [D, B] float32: the best B path scores of each length, best first;
        # pick [D, B] int32: parent slot * K + token rank of each; node [D * B]: node number of a slot;
        # keys [KEYS]: the sort buffer
        row = tl.program_id(0).to(tl.int64)
        lp_ptr += row * D * K
        ids_ptr += row * D * K
        scores_ptr += row * D * B
        pick_ptr += row * D * B
        node_ptr += row * D * B
        keys_ptr += row * KEYS
        out_ptr += row * 3 * n
        slot = tl.arange(0, BP)
        in_b = slot < B
        tl.store(scores_ptr + slot, tl.load(lp_ptr + slot, mask=in_b & (slot < K), other=float("-inf")),
                 mask=in_b)
        tl.store(pick_ptr + slot, slot, mask=in_b)  # level 1: below the root, token rank = slot
        p = tl.arange(0, PP)
        live = p < P
        pi = tl.load(pi_ptr + p, mask=live, other=0)
        pj = tl.load(pj_ptr + p, mask=live, other=0)
        low = (PP - 1 - p).to(tl.int64)  # ties: the lower pair index first
        for d in range(1, D):
            tl.debug_barrier()
            parent = tl.load(scores_ptr + (d - 1) * B + pi, mask=live, other=float("-inf"))
            child = parent + tl.load(lp_ptr + d * K + pj, mask=live, other=float("-inf"))
            o_child, o_parent = _sortable(child), _sortable(parent)
            # a child always ranks strictly below its parent, also when the log-prob rounds to 0
            o_child = tl.where((o_child >= o_parent) & (parent > float("-inf")), o_parent - 1, o_child)
            key = tl.where(live, (o_child.to(tl.int64) << 32) | low, INVALID)
            tl.store(keys_ptr + p, tl.sort(key, descending=True))
            tl.debug_barrier()
            top = tl.load(keys_ptr + slot, mask=in_b, other=INVALID)
            q = PP - 1 - (top & 0xFFFFFFFF).to(tl.int32)
            ok = in_b & (top != INVALID)
            score = tl.where(ok, _unsortable((top >> 32).to(tl.int32)), float("-inf"))
            code = tl.load(pi_ptr + q, mask=ok, other=0) * K + tl.load(pj_ptr + q, mask=ok, other=0)
            tl.store(scores_ptr + d * B + slot, score, mask=in_b)
            tl.store(pick_ptr + d * B + slot, code, mask=in_b)
        tl.debug_barrier()
        # the n best paths of any length, best first (ties: the shallower first); a parent always
        # outranks its children, so the set is closed under taking parents
        f = tl.arange(0, DBP)
        flat_live = f < D * B
        sc = tl.load(scores_ptr + f, mask=flat_live, other=float("-inf"))
        key = tl.where(flat_live, (_sortable(sc).to(tl.int64) << 32) | (DBP - 1 - f).to(tl.int64), INVALID)
        tl.store(keys_ptr + f, tl.sort(key, descending=True))
        tl.debug_barrier()
        r = tl.arange(0, NP)
        rl = r < n
        flat = DBP - 1 - (tl.load(keys_ptr + r, mask=rl, other=0) & 0xFFFFFFFF).to(tl.int32)
        tl.store(node_ptr + flat, r + 1, mask=rl)
        tl.debug_barrier()
        level = flat // B
        code = tl.load(pick_ptr + flat, mask=rl, other=0)
        deep = rl & (level > 0)
        parent_node = tl.load(node_ptr + (level - 1) * B + code // K, mask=deep, other=0)
        tl.store(out_ptr + r, tl.load(ids_ptr + level * K + code % K, mask=rl, other=0), mask=rl)
        tl.store(out_ptr + n + r, tl.where(deep, parent_node, 0).to(tl.int64), mask=rl)
        tl.store(out_ptr + 2 * n + r, (level + 1).to(tl.int64), mask=rl)


def build_tree_nodes_rows(lp: torch.Tensor, ids: torch.Tensor, budget: int, n: int) -> torch.Tensor:
    """lp, ids: [R, D, K] per-depth top-K log-probs (float32, descending) and their tokens, for R
    drafts -> their trees' [R, 3, n] draft nodes (tokens, parents, depths), row r as tree.build_tree
    makes draft r's; one launch, a program per draft."""
    rows, depth, k = lp.shape
    lp, ids = lp.contiguous(), ids.contiguous()
    pi, pj = candidate_pairs(budget, k, lp.device)
    pp = triton.next_power_of_2(max(2, pi.shape[0]))
    dbp = triton.next_power_of_2(max(2, depth * budget))
    widest = max(pp, dbp)
    dev = lp.device
    scores = torch.empty(rows, depth, budget, dtype=torch.float32, device=dev)
    pick = torch.empty(rows, depth, budget, dtype=torch.int32, device=dev)
    keys = torch.empty(rows, widest, dtype=torch.int64, device=dev)
    node = torch.empty(rows, depth * budget, dtype=torch.int32, device=dev)
    out = torch.empty(rows, 3, n, dtype=torch.long, device=dev)
    _build_tree_kernel[(rows,)](lp, ids, pi, pj, scores, pick, keys, node, out, k, budget, pi.shape[0], n,
                                widest, D=depth, BP=triton.next_power_of_2(budget), PP=pp, DBP=dbp,
                                NP=triton.next_power_of_2(max(2, n)),
                                num_warps=4 if widest <= 1024 else 8 if widest <= 4096 else 16)
    return out

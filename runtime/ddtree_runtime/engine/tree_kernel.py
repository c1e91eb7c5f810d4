"""The best-first tree build as one Triton program (CUDA): the same tree as tree.build_tree, in a few
microseconds of one thread block instead of a few torch kernels a level (each level is a dependent
top-k, and the torch top-k is a multi-pass radix select: 0.5-3 ms a build on an H200). A batched round's
drafts of one budget are one launch, a program (thread block) per draft over its own rows and scratch.

Per level, the candidates are only the pairs (parent slot i, token rank j) with (i+1)(j+1) <= budget
(a pair outside cannot be in the top `budget`: that many pairs rank at least as high), packed as
int64 keys (score bits in the high word, made to sort like the float, the pair's index in the low
word) and sorted in registers; the top `budget` go to the level's scratch rows.

Before it, the per-depth top-K log-probs of the drafts' rows (tree.top_tokens on CUDA), in two launches
(top_log_probs): a torch top-K over a 152K row is a multi-pass radix select with one block per row, and
a chunked torch form is a dozen kernels (1.4 ms for 16 drafts on an H200, where reading the logits takes
~40 us). One streaming pass instead: each program reads a tile of one row, writes the tile's (max, sum
of exp) and, per group of S tokens, the group's best (value, token) as one packed key. Then a program
per row combines the tiles' statistics into the log-sum-exp and runs a K-round tournament over its
groups' heads: take the best head, then reload that one group (S tokens) for its next best below the
taken key. K rounds touch K groups, so the work after the pass is K small reloads, whatever the K."""

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

    @triton.jit
    def _pack(x, token):
        """float32 values and their token ids -> int64 keys that order by value, then by the lower token
        (the tie rule: distinct tokens give distinct keys)."""
        return (_sortable(x).to(tl.int64) << 32) | (0x7FFFFFFF - token).to(tl.int64)

    @triton.jit
    def _key_token(key):
        return 0x7FFFFFFF - (key & 0x7FFFFFFF).to(tl.int32)

    @triton.jit
    def _row_start(x_ptr, row, depth, stride_lead, stride_depth):
        """Row `row` of the [lead, depth] rows of the logits (row-major over both)."""
        return x_ptr + (row // depth) * stride_lead + (row % depth) * stride_depth

    @triton.jit
    def _tile_heads_kernel(x_ptr, heads_ptr, stats_ptr, depth, stride_lead, stride_depth, V,
                           GA: tl.constexpr, S: tl.constexpr):
        # program (row, tile) reads tokens [tile * GA * S, (tile + 1) * GA * S) of its row: writes the
        # tile's (max, sum of exp(x - max)) to stats [rows, tiles, 2] and the best key of each of its GA
        # groups of S tokens to heads [rows, tiles * GA] (INVALID for a group past the vocabulary)
        row = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        tiles = tl.num_programs(1)
        x_ptr = _row_start(x_ptr, row, depth, stride_lead, stride_depth)
        group = tile * GA + tl.arange(0, GA)
        token = group[:, None] * S + tl.arange(0, S)[None, :]                       # [GA, S]
        valid = token < V
        x = tl.load(x_ptr + token, mask=valid, other=float("-inf")).to(tl.float32)
        top = tl.max(tl.max(x, axis=1), axis=0)
        base = tl.where(top == float("-inf"), 0.0, top)  # an all -inf tile: sum 0, no inf - inf
        total = tl.sum(tl.sum(tl.exp(x - base), axis=1), axis=0)
        stats_ptr += (row * tiles + tile) * 2
        tl.store(stats_ptr, top)
        tl.store(stats_ptr + 1, total)
        heads = tl.max(tl.where(valid, _pack(x, token), INVALID), axis=1)
        tl.store(heads_ptr + row * tiles * GA + group, heads)

    @triton.jit
    def _row_top_kernel(x_ptr, heads_ptr, stats_ptr, lp_ptr, ids_ptr, depth, stride_lead, stride_depth,
                        V, H, TILES, K: tl.constexpr, S: tl.constexpr, HP: tl.constexpr, TP: tl.constexpr):
        # program `row`: the row's log-sum-exp from its tiles' stats, then K rounds of taking the best
        # group head (the next token, best first) and replacing it with that group's best key below it
        # (K a constant: one compile per budget, and Triton's interpreter takes no runtime loop bound)
        row = tl.program_id(0).to(tl.int64)
        x_ptr = _row_start(x_ptr, row, depth, stride_lead, stride_depth)
        t = tl.arange(0, TP)
        stats_ptr += row * TILES * 2 + t * 2
        tile_max = tl.load(stats_ptr, mask=t < TILES, other=float("-inf"))
        tile_sum = tl.load(stats_ptr + 1, mask=t < TILES, other=0.0)
        top = tl.max(tile_max, axis=0)
        base = tl.where(top == float("-inf"), 0.0, top)
        log_sum = tl.log(tl.sum(tile_sum * tl.exp(tile_max - base), axis=0))
        h = tl.arange(0, HP)
        heads = tl.load(heads_ptr + row * H + h, mask=h < H, other=INVALID)
        lane = tl.arange(0, S)
        for i in range(K):
            best = tl.max(heads, axis=0)
            token = _key_token(best)
            # (x - max) - log(sum): exact near the top, where x - lse would round at lse's magnitude
            value = _unsortable((best >> 32).to(tl.int32))
            tl.store(lp_ptr + row * K + i, (value - base) - log_sum)
            tl.store(ids_ptr + row * K + i, token.to(tl.int64))
            live = best != INVALID  # (never taken: K <= V, and every token is in some group)
            g = tl.where(live, token // S, 0)
            member = g * S + lane
            fresh = live & (member < V)
            rest = _pack(tl.load(x_ptr + member, mask=fresh, other=float("-inf")).to(tl.float32), member)
            rest = tl.where(fresh & (rest < best), rest, INVALID)
            heads = tl.where(h == g, tl.max(rest, axis=0), heads)


TILE = 2048  # tokens per program of the pass: 75 tiles of a 152K row, ~1,100 programs for one draft


def group_size(vocab: int) -> int:
    """Tokens per group: a row has at most 2048 groups (heads), at least 32 tokens a group."""
    return max(32, triton.next_power_of_2(-(-vocab // 2048)))


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D, V] logits (any float dtype, rows contiguous) -> each row's top-k log-probs (float32,
    descending) and token ids (int64), [..., D, k], k <= V; equal values: the lower token first. One
    pass over the logits, then a program per row (the module docstring says how)."""
    *lead, depth, vocab = logits.shape
    x = logits.reshape(-1, depth, vocab)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, dev = x.shape[0] * depth, x.device
    s = group_size(vocab)
    per_tile = max(1, TILE // s)
    tiles = -(-vocab // (per_tile * s))
    heads = torch.empty(rows, tiles * per_tile, dtype=torch.int64, device=dev)
    stats = torch.empty(rows, tiles, 2, dtype=torch.float32, device=dev)
    lp = torch.empty(rows, k, dtype=torch.float32, device=dev)
    ids = torch.empty(rows, k, dtype=torch.int64, device=dev)
    _tile_heads_kernel[(rows, tiles)](x, heads, stats, depth, x.stride(0), x.stride(1), vocab,
                                      GA=per_tile, S=s, num_warps=4)
    hp = triton.next_power_of_2(heads.shape[1])
    _row_top_kernel[(rows,)](x, heads, stats, lp, ids, depth, x.stride(0), x.stride(1), vocab,
                             heads.shape[1], tiles, K=k, S=s, HP=hp, TP=triton.next_power_of_2(tiles),
                             num_warps=4 if hp <= 2048 else 8)
    return lp.view(*lead, depth, k), ids.view(*lead, depth, k)


def build_tree_nodes_rows(lp: torch.Tensor, ids: torch.Tensor, budget: int,
                          n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """lp, ids: [R, D, K] per-depth top-K log-probs (float32, descending) and their tokens, for R
    drafts -> their trees' [R, 3, n] draft nodes (tokens, parents, depths), row r as tree.build_tree
    makes draft r's, and each level's best `budget` path scores [R, D, budget] (tree.scored_trees);
    one launch, a program per draft."""
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
    return out, scores

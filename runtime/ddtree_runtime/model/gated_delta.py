"""The gated delta rule (Gated DeltaNet's recurrence) in parallel form over any set of paths.

Per value head the recurrent state S [dk, dv] evolves token by token:

    S' = exp(g_t) S_{t-1}                 decay
    u_t = beta_t (v_t - S'^T k_t)         what the token writes (delta rule)
    S_t = S' + k_t u_t^T                  o_t = S_t^T q_t

Unrolled from a start state S0, with G_t the sum of g over the token's path (itself included):

    S_t = exp(G_t) S0 + sum_{j on the path, j <= t} exp(G_t - G_j) k_j u_j^T
    (I + A) u = beta * (v - exp(G) * K S0),   A_tj = beta_t exp(G_t - G_j) (k_t . k_j), j a strict ancestor
    o_t = exp(G_t) S0^T q_t + sum_{j on the path} exp(G_t - G_j) (q_t . k_j) u_j

Nothing here needs the path to be a chain: give each token its ancestor-or-self set as a mask and every
token sees exactly its own path: a tree's ancestor mask verifies a whole draft tree in one pass, each
node from its parent's state, with no state leaking across branches (prompts, tokens in a row, take
the chunkwise form of gdn_chunk.py instead).
Ancestors precede their descendants in the flattened order, so I + A is unit lower triangular and one
triangular solve gives u. The state a node ends in is rebuilt only for the node that is kept (`state_at`;
`advance_along` in place, a path per sequence, as a commit does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .gdn_kernels import advance_fits, advance_state, conv_tail, conv_tail_fits, tree_delta, tree_delta_fits


@dataclass
class Paths:
    """Which earlier tokens each of T tokens continues from (all on the device, fixed shapes), computed
    once per pass and shared by every linear layer."""
    mask: torch.Tensor    # [T, T] bool, mask[i, j]: j is i or one of its ancestors ([B, 1, T, T]: a
                          # batch of trees, one per sequence)
    window: torch.Tensor  # [T, K] long ([B, T, K]): the conv window of token i, oldest first, as
                          # indices into [conv state (K-1 rows), the T new tokens]
    strict: torch.Tensor = field(init=False)   # [T, T] bool: strict ancestors only
    summing: torch.Tensor = field(init=False)  # [T, T] float32: mask transposed, sums a quantity over each path

    def __post_init__(self) -> None:
        eye = torch.eye(self.mask.shape[-1], dtype=torch.bool, device=self.mask.device)
        self.strict = self.mask & ~eye
        self.summing = self.mask.transpose(-1, -2).float()


def tree_paths(mask: torch.Tensor, depth: torch.Tensor, kernel: int) -> Paths:
    """Nodes of a tree (mask [T, T] ancestor-or-self, depth [T], root depth 0; the root continues the
    committed sequence), or of a batch of trees (mask [B, T, T], depth [B, T]). Node i's conv window
    holds its own ancestors, then the committed tail."""
    t = mask.shape[-1]
    self_ext = (torch.arange(t, device=mask.device) + kernel - 1).expand_as(depth)
    taps = [self_ext]
    for back in range(1, kernel):
        # the ancestor `back` steps up sits at depth - back; past the root, read the conv state
        at_depth = mask & (depth[..., None, :] == (depth - back)[..., :, None])
        ancestor = at_depth.to(torch.int8).argmax(dim=-1) + kernel - 1
        taps.append(torch.where(depth >= back, ancestor, depth + kernel - 1 - back))
    window = torch.stack(taps[::-1], dim=-1)
    return Paths(mask if mask.dim() == 2 else mask[:, None], window)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                window: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU along each token's path. x: [B, T, C] new inputs; conv_state:
    [B, K-1, C] the committed tail; weight: [C, K]; window: [T, K]. Returns [B, T, C]."""
    ext = torch.cat([conv_state.to(x.dtype), x], dim=1)           # [B, K-1+T, C]
    if window.dim() == 2:
        taps = ext[:, window]                                     # [B, T, K, C]
    else:  # each sequence its own windows, [B, T, K]
        taps = ext[torch.arange(x.shape[0], device=x.device)[:, None, None], window]
    return F.silu((taps * weight.t().to(x.dtype)).sum(dim=2))


@dataclass
class Step:
    """What a parallel pass leaves for rebuilding the state of any token afterwards."""
    k: torch.Tensor   # [B, H, T, dk] float32, normalised keys
    u: torch.Tensor   # [B, H, T, dv] float32, the values each token wrote
    g: torch.Tensor   # [B, H, T] float32, path-summed log decay G


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor | None, paths: Paths) -> tuple[torch.Tensor, Step]:
    """q, k: [B, H, T, dk] (normalised, q scaled), v: [B, H, T, dv], g, beta: [B, H, T], all float32;
    state: [B, H, dk, dv] float32 or None (zeros); paths: each token's ancestors.
    Returns outputs [B, H, T, dv] and the Step for `state_at`. On CUDA one Triton launch for all
    sequences and heads (gdn_kernels.tree_delta), reading each state once; else torch."""
    if tree_delta_fits(q, v):
        out, u, pathsum = tree_delta(q, k, v, g, beta, state, paths.mask)
        return out, Step(k, u, pathsum)
    return gated_delta_torch(q, k, v, g, beta, state, paths)


def gated_delta_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor | None, paths: Paths) -> tuple[torch.Tensor, Step]:
    """gated_delta in torch: path sums by a matmul, [B, H, T, T] decays, a batched triangular solve."""
    if paths.summing.dim() == 2:
        pathsum = g @ paths.summing                               # [B, H, T]: G_i = sum over i's path
    else:  # a tree per sequence: summing [B, 1, T, T]
        pathsum = (g[..., None, :] @ paths.summing)[..., 0, :]
    gap = pathsum[..., :, None] - pathsum[..., None, :]           # [B, H, T, T]: G_i - G_j
    decay = torch.where(paths.mask, gap, float("-inf")).exp()     # 0 off the path (no overflow there)
    a = torch.where(paths.strict, (k @ k.transpose(-1, -2)) * decay * beta[..., None], 0.0)
    rhs = v
    if state is not None:
        rhs = v - pathsum.exp()[..., None] * (k @ state)
    u = torch.linalg.solve_triangular(a, beta[..., None] * rhs, upper=False, unitriangular=True)
    out = ((q @ k.transpose(-1, -2)) * decay) @ u
    if state is not None:
        out = out + pathsum.exp()[..., None] * (q @ state)
    return out, Step(k, u, pathsum)


def state_at(step: Step, state: torch.Tensor | None, path: torch.Tensor) -> torch.Tensor:
    """The state after the last token of `path` ([P] long, root first, each the parent of the next):
    exp(G_L) S0 + sum_j exp(G_L - G_j) k_j u_j^T over the path. Works batched over leading dims."""
    g = step.g[..., path]                                          # [..., H, P]
    last = g[..., -1:]
    w = (last - g).exp()                                           # [..., H, P]
    k = step.k[..., path, :] * w[..., None]
    new = k.transpose(-1, -2) @ step.u[..., path, :]               # [..., H, dk, dv]
    if state is not None:
        new = new + last.exp()[..., None] * state
    return new


def advance_along(step: Step, state: torch.Tensor, nodes: torch.Tensor, length: torch.Tensor) -> None:
    """state_at for a batch, each sequence its own path, written into `state` in place (it is the
    largest tensor a commit touches: on CUDA one Triton pass reads and writes it once): step tensors
    [n, B, H, T, ...], state [n, B, H, dk, dv], nodes [B, P] (the path's nodes, root first, anything
    past length[b]) and length [B] (each >= 1: an AR step still advances by its root)."""
    if advance_fits(state):
        advance_state(step.k, step.u, step.g, state, nodes, length)
    else:
        advance_along_torch(step, state, nodes, length)


def conv_tail_along(conv: torch.Tensor, inputs: torch.Tensor, nodes: torch.Tensor, length: torch.Tensor) -> None:
    """Each row's conv tail after its accepted path, in place: the last K-1 inputs of [old tail | path],
    conv [n, B, K-1, C], inputs [n, B, T, C] (the tree pass's, by node), nodes [B, P] and length [B] as
    advance_along's. On CUDA one launch (in torch, ~10 small kernels: 0.27 ms a 16-row round on an H200)."""
    if conv_tail_fits(conv, inputs):
        conv_tail(conv, inputs, nodes, length)
    else:
        conv_tail_torch(conv, inputs, nodes, length)


def conv_tail_torch(conv: torch.Tensor, inputs: torch.Tensor, nodes: torch.Tensor, length: torch.Tensor) -> None:
    """conv_tail_along in torch: only the K-1 rows kept are read (gathering every layer's whole path and
    concatenating cost ~0.6 ms a round at 16 rows on an H200), whole rows at a time (index_select: an
    element-wise gather took ~0.1 ms for these 3 rows)."""
    _, b, k1, _ = conv.shape
    keep = length[:, None] + torch.arange(k1, device=nodes.device)     # [B, K-1] in [tail | path]
    node = nodes.gather(1, (keep - k1).clamp(min=0))
    rows = torch.arange(b, device=nodes.device)[:, None]
    picked = inputs.flatten(1, 2).index_select(1, (rows * inputs.shape[2] + node).flatten())
    old = conv.flatten(1, 2).index_select(1, (rows * k1 + keep.clamp(max=k1 - 1)).flatten())
    conv.copy_(torch.where((keep >= k1).view(1, b, k1, 1), picked.view_as(conv), old.view_as(conv)))


def advance_along_torch(step: Step, state: torch.Tensor, nodes: torch.Tensor, length: torch.Tensor) -> None:
    """advance_along in torch: no temporaries of the state's size, but two passes over it (the decay,
    then a layer at a time the rank-P update). Nodes past a path's end get weight 0."""
    n, b, h = step.g.shape[:3]
    p = nodes.shape[1]
    dk, dv = state.shape[-2:]
    idx = nodes[None, :, None, :].expand(n, b, h, p)
    g = step.g.gather(3, idx)                                              # [n, B, H, P]
    last = g.gather(3, (length - 1)[None, :, None, None].expand(n, b, h, 1))
    on_path = torch.arange(p, device=nodes.device)[None, :] < length[:, None]  # [B, P]
    w = torch.where(on_path[None, :, None, :], (last - g).exp(), 0.0)
    k = step.k.gather(3, idx[..., None].expand(n, b, h, p, dk)) * w[..., None]
    u = step.u.gather(3, idx[..., None].expand(n, b, h, p, dv))
    state.mul_(last.exp()[..., None])
    for layer in range(n):  # a layer's [B, H, dk, dv] is contiguous in the pool, whatever B
        state[layer].view(-1, dk, dv).baddbmm_(k[layer].reshape(-1, p, dk).transpose(1, 2),
                                                u[layer].reshape(-1, p, dv))

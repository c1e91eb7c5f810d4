"""Gated DeltaNet prompt prefill in the chunkwise-parallel form (the WY / UT-transform formulation).

The recurrence (gated_delta.py has it token by token, and over trees for the verify) is split into
chunks of C tokens. Within a chunk, with G the cumulative log decay from the chunk's start and S the
state entering it, every token's written value is

    u = (I + A)^-1 beta * (v - exp(G) * K S)            A_ij = beta_i exp(G_i - G_j) (k_i . k_j), j < i
      = U - W S,   U = (I + A)^-1 (beta v),   W = (I + A)^-1 (beta exp(G) k)

U and W (the WY form) and the chunk's causal scores depend on no state, so they are computed for all
chunks at once; only the [dk, dv] state walks from chunk to chunk:

    o = (Q K^T * decay) u + exp(G) Q S,   S' = exp(G_C) S + (exp(G_C - G) K)^T u

On CUDA in 16 bits the same algorithm runs as fla-core's Triton kernels (flash-linear-attention's
`chunk_gated_delta_rule`, what SGLang and vLLM run for these layers; an optional, lazily imported
dependency). Everywhere else, and in float32, it runs in torch (float32 inside), here."""

from __future__ import annotations

import functools
import importlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk: [C, C] scores and triangular solves per chunk and head
L2_EPS = 1e-6


class PaddedPrompt(NamedTuple):
    """A prompt piece padded to a fixed width W (engine/runner.py's PrefillRunner), as a linear layer
    needs it with every offset on the device, so one CUDA graph serves any piece of that width in any
    cache row."""
    row: torch.Tensor           # [1] long: the cache row whose conv tail and state the piece continues
    resume: torch.Tensor        # [1] bool: from that row's state (False: from zeros, a prompt's start)
    length: torch.Tensor        # [1] long: the piece's real tokens, 1..W; the rest is padding
    keep: torch.Tensor | None   # [1] long, 1..length: where the state is kept (the snapshot); None: nowhere


def prompt_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over tokens in a row: x [B, T, C] after the committed tail
    conv_state [B, K-1, C]; weight [C, K]. Returns the output [B, T, C] and the new tail [B, K-1, C]."""
    ext = conv_inputs(x, conv_state)
    return conv_silu(ext, weight), ext[:, -(weight.shape[1] - 1):]


def conv_inputs(x: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """The conv's inputs over x [B, T, C]: the committed tail, then x, [B, K-1+T, C]."""
    return torch.cat([conv_state.to(x.dtype), x], dim=1)


def conv_silu(ext: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU of the inputs ext [B, K-1+T, C] (conv_inputs) -> [B, T, C]."""
    y = F.conv1d(ext.transpose(1, 2), weight[:, None].to(ext.dtype), groups=ext.shape[-1])   # [B, C, T]
    return F.silu(y).transpose(1, 2).contiguous()


def tail_before(ext: torch.Tensor, end: torch.Tensor, kernel: int) -> torch.Tensor:
    """The K-1 conv inputs before token `end` ([1] long, on the device) of ext [B, K-1+T, C]
    (conv_inputs): the tail a state after `end` tokens continues from, [B, K-1, C]."""
    return ext.index_select(1, end + torch.arange(kernel - 1, device=ext.device))


def l2_normalised(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def chunk_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor | None = None,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens in a row from `state`.

    q, k: [B, T, Hk, dk] as the conv gives them (L2-normalised here, q then scaled by `scale`, default
    dk^-0.5); v: [B, T, Hv, dv], Hv a multiple of Hk (each key head serves Hv/Hk value heads); g (log
    decay) and beta: [B, T, Hv] float32; state: [B, Hv, dk, dv] float32 or None (zeros).
    Returns outputs [B, T, Hv, dv] (v's dtype on the fla path, float32 in torch) and the final state
    [B, Hv, dk, dv] float32."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.is_cuda and v.dtype in (torch.bfloat16, torch.float16) and _fla_chunk() is not None:
        return _fla(q, k, v, g, beta, state, scale)
    return chunk_gated_delta_torch(q, k, v, g, beta, state, scale)


FLA_MODULE = "fla.ops.gated_delta_rule"   # its kernels are autotuned: compile_pool's workers import it


@functools.cache
def _fla_chunk():
    """fla-core's chunked kernel, or None where it is not installed (CPU hosts, the lab)."""
    try:
        return importlib.import_module(FLA_MODULE).chunk_gated_delta_rule
    except ImportError:
        return None


def _fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         state: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    # fla indexes its inputs as contiguous [B, T, H, d]; its state is float32 [B, Hv, dk, dv] like ours
    out, final = _fla_chunk()(q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
                              beta.to(v.dtype).contiguous(), scale=scale, initial_state=state,
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out, final.float()


def chunk_gated_delta_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state: torch.Tensor | None, scale: float,
                            chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_gated_delta in torch, float32. The tail is padded to a whole chunk with tokens that
    write nothing and do not decay (k = v = beta = g = 0), so the final state is exact."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    group = hv // hk
    pad = -t % chunk
    n = (t + pad) // chunk

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        # [B, T, H, ...] -> [B, Hv, N, C, ...]: key heads repeated for their value heads, tail padded
        x = x.float()
        if x.dim() == 4 and x.shape[2] != hv:
            x = x.repeat_interleave(group, dim=2)
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.view(b, n, chunk, hv, *x.shape[3:]).transpose(1, 3).transpose(2, 3)

    q = heads_first(l2_normalised(q.float()) * scale)                          # [B, Hv, N, C, dk]
    k = heads_first(l2_normalised(k.float()))                                  # [B, Hv, N, C, dk]
    v = heads_first(v)                                                         # [B, Hv, N, C, dv]
    beta, g = heads_first(beta), heads_first(g).cumsum(-1)                     # [B, Hv, N, C]: G

    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    gap = g[..., :, None] - g[..., None, :]                                    # [B, Hv, N, C, C]
    decay = torch.where(causal, gap, float("-inf")).exp()                      # 0 above the diagonal
    a = (k @ k.transpose(-1, -2)) * decay * beta[..., None]
    a = a.masked_fill(~causal.tril(-1), 0.0)                                   # strictly lower
    rhs = beta[..., None] * torch.cat([v, g.exp()[..., None] * k], dim=-1)     # [B, Hv, N, C, dv+dk]
    uw = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u0, w = uw[..., :dv], uw[..., dv:]                                         # U, W
    scores = (q @ k.transpose(-1, -2)) * decay                                 # [B, Hv, N, C, C]
    q_decayed = q * g.exp()[..., None]                                         # reads the entering state
    k_to_end = k * (g[..., -1:] - g).exp()[..., None]                          # writes the leaving state
    end_decay = g[..., -1].exp()[..., None, None]                              # [B, Hv, N, 1, 1]

    s = q.new_zeros(b, hv, dk, dv) if state is None else state.float()
    outs = []
    for i in range(n):
        u = u0[:, :, i] - w[:, :, i] @ s                                       # [B, Hv, C, dv]
        outs.append(scores[:, :, i] @ u + q_decayed[:, :, i] @ s)
        s = end_decay[:, :, i] * s + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).reshape(b, hv, n * chunk, dv)[:, :, :t]     # [B, Hv, T, dv]
    return out.transpose(1, 2), s


def padded_chunk_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, length: torch.Tensor,
                             keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """chunk_gated_delta over the first `length` of W tokens, at the fixed width W (length, keep: [1]
    long, on the device; inputs as chunk_gated_delta's, `state` given). The padding's gates and betas
    are zeroed: a token with beta = 0 writes nothing and one with g = 0 does not decay, so the state
    passes through the padding unchanged. With `keep` the recurrence runs in two calls as the eager
    prompt pass's does (qwen3_5.GatedDeltaNet._chain): the tokens before `keep`, whose final state is
    the snapshot, then from there the tokens from `keep` on, moved to the front so that their chunks
    start where the eager pass's second call's do. Returns outputs [B, W, Hv, dv] (the padding's are
    anything), the state after `length` tokens, and the snapshot (None without `keep`)."""
    width = q.shape[1]
    offsets = torch.arange(width, device=q.device)

    def gates(live: torch.Tensor, moved: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        g_, beta_ = (g, beta) if moved is None else (g.index_select(1, moved), beta.index_select(1, moved))
        return g_.where(live[None, :, None], 0.0), beta_.where(live[None, :, None], 0.0)

    if keep is None:
        out, final = chunk_gated_delta(q, k, v, *gates(offsets < length), state)
        return out, final, None
    first = offsets < keep
    out, kept = chunk_gated_delta(q, k, v, *gates(first), state)
    moved = (offsets + keep).clamp(max=width - 1)                             # token keep + i at i
    rest, final = chunk_gated_delta(*(x.index_select(1, moved) for x in (q, k, v)),
                                    *gates(offsets + keep < length, moved), kept)
    back = rest.index_select(1, (offsets - keep).clamp(min=0))                # token i from keep on, at i
    return torch.where(first[None, :, None, None], out, back), final, kept

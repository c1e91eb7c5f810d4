"""Building blocks shared by the Qwen3 target and the DFlash drafter."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from . import kernels
from .fp8 import BLOCK, BlockFP8, FP8Linear, cdiv, fp8_linear, fuse_fp8_rows, slice_rows
from .kernels import (DecodeLaunch, FitPlan, decode_attention, decode_attention_fits, rms_norm, rms_norm_rope,
                      rms_norm_rope_to_cache, silu_mul)
from .parallel import TensorParallel, add_reduced
from .prompt_attention import attend_prompt, gather_pages, prompt_flash_fits, prompt_splits


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # float32 inside, as HF does; fused on CUDA


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

        self._gate_up: Weight | None = None  # [2*inter, hidden] once fuse() ran
        self.tp: TensorParallel | None = None  # a target's shard: down_proj's output summed over the ranks

    def fuse(self) -> None:
        """One GEMM for gate and up (inference): the two weights become views of one tensor."""
        self._gate_up = fuse_rows([self.gate_proj, self.up_proj])[0]

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x): the input of down_proj."""
        if self._gate_up is not None:
            return silu_mul(linear(x, self._gate_up))
        return F.silu(self.gate_proj(x)) * self.up_proj(x)

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """x + mlp(h), the residual added by the down projection's GEMM (kernels.residual_linear)."""
        return add_reduced(x, self.act(h), self.down_proj, self.tp)


class Rotary(nn.Module):
    """Default (unscaled) RoPE; cos/sin are computed per call from explicit position ids."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # pos: [B, T] -> cos, sin: [B, 1, T, D] (broadcast over heads)
        freqs = pos.float()[..., None] * self.inv_freq.to(pos.device)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class TreeInputs(NamedTuple):
    """A fixed-shape target forward over tree nodes (see engine/runner.py): offsets live on the device,
    so a CUDA graph can replay it. Models with recurrent layers add `paths` in their forward."""
    slots: torch.Tensor     # [T] cache slot of each node
    bias: torch.Tensor      # [1, 1, T, kv_len] additive attention bias over the first kv_len slots
    kv_len: int
    tree: torch.Tensor      # [T, T] bool, node j is node i or one of its ancestors
    paths: object = None    # gated_delta.Paths, filled by a hybrid model
    # [B] keys each row may attend (a batched pass: see attend_decode); a prompt piece's (tree None):
    # its start + width, its queries the last width of them (prompt_attention.attend_prompt)
    lengths: torch.Tensor | None = None
    launch: DecodeLaunch | None = None   # the decode kernel's launch (kernels.DECODE_EAGER for passes not graphed)
    prompt: object = None   # a hybrid's padded prompt piece (gdn_chunk.PaddedPrompt; `tree` is then None)
    attn_plan: FitPlan | None = None  # the attention's fitted split at these lengths (the model's prepare)


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, idx: int, start: int,
                  mask: torch.Tensor | None, tree: TreeInputs | None) -> torch.Tensor:
    """Store k/v in layer `idx` of the cache and attend: a tree pass writes at its slots and attends with
    its bias; a plain pass writes at `start` and is causal unless a mask is given (a later piece of a
    prompt, start > 0, causal with its queries aligned to the end of the keys)."""
    if tree is not None:
        cache.put_at(idx, tree.slots, k, v)
        return attend_static(q, cache, idx, tree)
    if cache is not None:
        k, v = cache.write(idx, start, k, v)
    if mask is None and q.shape[2] > 1 and q.shape[2] < k.shape[2]:
        # no [T, start+T] mask is built: SDPA runs the lower-right causal variant in a fused kernel
        # (slower than one causal pass with grouped KV heads on an H200: engine/prefill.py)
        mask = causal_lower_right(q.shape[2], k.shape[2])
    return attend(q, k, v, mask, mask is None and q.shape[2] > 1)


def store_roped_kv(k: torch.Tensor, v: torch.Tensor, k_norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor, cache,
                   idx: int, slots: torch.Tensor) -> None:
    """RMSNorm + RoPE k [B, T, Hkv, D] and store it and v [B, T, Hkv, D] at positions `slots` of layer idx: one
    kernel where the cache names one target for it (kernels.rms_norm_rope_to_cache), else the RoPE kernel and
    the cache's own stores."""
    target = cache.kernel_target(idx, slots)
    if target is None or not rms_norm_rope_to_cache(k, v, k_norm.weight, k_norm.eps, cos, sin, *target):
        cache.put_at(idx, slots, rms_norm_rope(k, k_norm.weight, k_norm.eps, cos, sin), v.transpose(1, 2))


class QKVProj(nn.Module):
    """Qwen3 projections: q/k/v/o plus per-head RMSNorm on q and k (before RoPE)."""

    def __init__(self, hidden: int, n_heads: int, n_kv: int, head_dim: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.q_proj = nn.Linear(hidden, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, n_kv * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, n_kv * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self._qkv: tuple[Weight, torch.Tensor | None] | None = None  # fused weight, bias
        self.tp: TensorParallel | None = None  # a target's shard: o_proj's output summed over the ranks

    def fuse(self) -> None:
        """One GEMM for q, k and v (inference): the three weights become views of one tensor."""
        self._qkv = fuse_rows([self.q_proj, self.k_proj, self.v_proj])

    def qkv(self, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, hidden] -> q [B, Hq, T, D], k, v [B, Hkv, T, D]."""
        if self._qkv is None:
            return (self.q(x, cos, sin), *self.kv(x, cos, sin))
        q, k, v = self._heads(linear(x, *self._qkv), self.n_heads)
        return self._rope_q(q, cos, sin), self._rope_k(k, cos, sin), v.transpose(1, 2)

    def qkv_to_cache(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, idx: int,
                     slots: torch.Tensor) -> torch.Tensor:
        """A tree pass's projections: q [B, Hq, T, D], with k/v stored at cache positions `slots` of
        layer `idx` (attend_cache reads them back; on CUDA the RoPE of k and both stores are one
        kernel)."""
        if self._qkv is None:
            q, k, v = self.qkv(x, cos, sin)
            cache.put_at(idx, slots, k, v)
            return q
        q, k, v = self._heads(linear(x, *self._qkv), self.n_heads)
        store_roped_kv(k, v, self.k_norm, cos, sin, cache, idx, slots)
        return self._rope_q(q, cos, sin)

    def kv_to_cache(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, idx: int,
                    slots: torch.Tensor) -> None:
        """As qkv_to_cache without q: the drafter's context rows (one GEMM for k and v)."""
        if self._qkv is None:
            cache.put_at(idx, slots, *self.kv(x, cos, sin))
            return
        _, k, v = self._heads(linear(x, *rows_from(*self._qkv, self.n_heads * self.head_dim)), 0)
        store_roped_kv(k, v, self.k_norm, cos, sin, cache, idx, slots)

    def _heads(self, y: torch.Tensor, n_q: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A fused projection's output [B, T, (n_q + 2 Hkv) D] -> q, k, v views [B, T, heads, D]."""
        b, t, _ = y.shape
        nq, nk = n_q * self.head_dim, self.n_kv * self.head_dim
        kv = (b, t, self.n_kv, self.head_dim)
        return y[..., :nq].view(b, t, n_q, self.head_dim), y[..., nq:nq + nk].view(kv), y[..., nq + nk:].view(kv)

    def _rope_q(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rms_norm_rope(q, self.q_norm.weight, self.q_norm.eps, cos, sin)

    def _rope_k(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rms_norm_rope(k, self.k_norm.weight, self.k_norm.eps, cos, sin)

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [B, T, hidden] -> [B, Hq, T, D]
        b, t, _ = x.shape
        return self._rope_q(self.q_proj(x).view(b, t, self.n_heads, self.head_dim), cos, sin)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [B, T, hidden] -> k, v: [B, Hkv, T, D]
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return self._rope_k(k, cos, sin), v

    def add_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x + o_proj(o) for attention output o [B, Hq, T, D], the residual added by the output
        projection's GEMM (kernels.residual_linear)."""
        b, _, t, _ = o.shape
        return add_reduced(x, o.transpose(1, 2).reshape(b, t, -1), self.o_proj, self.tp)


class LayerWeights(nn.Module):
    """The weights of one Qwen3-style layer, named as in HF and z-lab checkpoints; the target's decoder
    layer and the drafter's layer share them and differ only in what their attention reads."""

    def __init__(self, cfg) -> None:  # a Qwen3Config or a DFlashConfig
        super().__init__()
        self.self_attn = QKVProj(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                 cfg.head_dim, cfg.rms_norm_eps, cfg.attention_bias)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
    """SDPA with grouped KV heads; mask is boolean (True = may attend) or additive, broadcastable to
    [B, H, Tq, Tk]. (Folding the query heads of each KV head into the query axis, so a masked call
    runs without grouped heads, measured slower on an H200: 5.5 -> 6.1 ms per AR step, see
    docs/performance.md.)"""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def attend_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Attention for few queries over a long, bucketed KV with an additive bias (the graphed decode
    path): q [B, Hq, T, D], k/v [B, Hkv, L, D], bias broadcastable to [B, 1, T, L] -> [B, Hq, T, D].

    Each KV head's query heads are folded into its query rows, so K and V are read once per KV head
    by two batched GEMMs spread over all of L; softmax in float32. SDPA here either repeats K/V per
    query head (math) or runs one block per head with no split over L (memory-efficient kernel),
    both several times slower at a 4K context on an H200."""
    b, hq, t, d = q.shape
    hk, g = k.shape[1], q.shape[1] // k.shape[1]
    qf = q.reshape(b, hk, g * t, d)                                   # rows j*T + i: head kv*g + j
    scores = torch.matmul(qf, k.transpose(-1, -2)).float()             # [B, Hkv, gT, L]
    scores = scores.view(b, hk, g, t, -1) * (d ** -0.5) + bias.unsqueeze(2).float()
    p = torch.softmax(scores, dim=-1).to(v.dtype).view(b, hk, g * t, -1)
    return torch.matmul(p, v).view(b, hk, g, t, d).reshape(b, hq, t, d)


def attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                  lengths: torch.Tensor | None = None, launch: DecodeLaunch | None = None,
                  shared: bool = False, plan: FitPlan | None = None) -> torch.Tensor:
    """Attention of the graphed decode path (bias additive, KV length bucketed). On CUDA in 16 bits the
    split-KV kernel (kernels.decode_attention) takes every shape it fits. Otherwise, as measured on an
    H200 (docs/performance.md): the batched-GEMM form wins for small blocks of queries over a long
    context (a 16-node tree or the drafter's block at 4K: 9.1 -> 7.7 ms per verify); SDPA wins for one
    query (the AR step) and for large trees, whose float32 score matrix the GEMM form materialises.

    lengths ([B] on the device, optional): row b's bias masks every key from lengths[b] on, so the
    kernel stops reading there (the bucket's padding is free); the other forms rely on the bias.
    launch: the kernel's, where the caller fixes it (kernels.decode_attention); shared: its promise that
    every query sees the keys before lengths - T (kernels.decode_attention); plan: the fitted split's
    (kernels.decode_attention)."""
    if decode_attention_fits(q, k, lengths):
        return decode_attention(q, k, v, bias, lengths, launch, shared=shared, plan=plan)
    if 1 < q.shape[2] <= 33 and k.shape[2] >= 2048:
        return attend_grouped(q, k, v, bias)
    return attend(q, k, v, bias)


def attend_static(q: torch.Tensor, cache, idx: int, static: TreeInputs) -> torch.Tensor:
    """A fixed-shape pass's attention over layer idx of the cache, its k/v already stored: a prompt
    piece with its lengths through attend_prompt where that fits (no bias read, no key past the row's
    length), anything else through attend_cache with the pass's bias."""
    if static.tree is None and static.lengths is not None and prompt_flash_fits(q):
        return attend_prompt(q, *prompt_keys(cache, idx, static.kv_len, static.lengths), static.lengths,
                             prompt_splits(static.kv_len))
    return attend_cache(q, cache, idx, static.kv_len, static.bias, static.lengths, static.launch, static.attn_plan)


def prompt_keys(cache, idx: int, kv_len: int, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer idx's first kv_len keys and values of each row [B, Hkv, kv_len, D] for attend_prompt: a
    paged cache's copied only up to each row's length."""
    pages = cache.pages(idx)
    if pages is None:
        return cache.view(idx, kv_len)
    return tuple(gather_pages(x[0], pages.block, pages.page_size, lengths, kv_len) for x in (pages.k, pages.v))


def attend_cache(q: torch.Tensor, cache, idx: int, kv_len: int, bias: torch.Tensor,
                 lengths: torch.Tensor | None = None, launch: DecodeLaunch | None = None,
                 plan: FitPlan | None = None) -> torch.Tensor:
    """A tree pass's attention over layer idx's first kv_len cache positions (attend_decode's rules):
    a paged cache is read through its block tables by the paged split-KV kernel where that fits, and
    otherwise (the torch path, the shapes the kernel leaves to SDPA) from a gathered copy. Every pass
    that gives lengths (a tree, a drafter's block, a prompt piece) has its T queries after the row's
    context, which all of them see: the kernel skips the bias there (kernels.DECODE_SHARED_CONTEXT).
    plan: the pass's fitted split (kernels.tree_attention_plan), made once for its layers."""
    shared = lengths is not None and kernels.DECODE_SHARED_CONTEXT
    pages = cache.pages(idx)
    if pages is not None and decode_attention_fits(q, pages.k, lengths):
        return decode_attention(q, pages.k, pages.v, bias, lengths, launch, table=pages.block,
                                page_size=pages.page_size, length=kv_len, shared=shared, plan=plan)
    return attend_decode(q, *cache.view(idx, kv_len), bias, lengths, launch, shared, plan)


class RowParts(NamedTuple):
    """A fused projection whose parts are not all of one kind (an FP8 checkpoint that left some of
    them in 16 bits): one GEMM per run of parts of the same kind, the outputs side by side."""
    parts: tuple[tuple[torch.Tensor | BlockFP8, torch.Tensor | None], ...]


Weight = torch.Tensor | BlockFP8 | RowParts


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for any weight fuse_rows makes: a 16-bit one, FP8 blocks (model/fp8.py), or parts of both."""
    if isinstance(w, BlockFP8):
        return fp8_linear(x, w, b)
    if isinstance(w, RowParts):
        return torch.cat([linear(x, *part) for part in w.parts], dim=-1)
    return F.linear(x, w, b)


def rows_from(w: Weight, b: torch.Tensor | None, start: int) -> tuple[Weight, torch.Tensor | None]:
    """Output rows start.. of a fused weight and its bias."""
    b = None if b is None else b[start:]
    if isinstance(w, BlockFP8):
        return slice_rows(w, start), b
    if isinstance(w, RowParts):
        raise ValueError("a projection fused from FP8 and 16-bit parts cannot be sliced")
    return w[start:], b


def fuse_rows(linears: list[nn.Module], pad: bool = False) -> tuple[Weight, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input (inference): each Linear's
    parameters become row slices of it, so the state dict and the unfused path see the same numbers.
    FP8 projections fuse into FP8 blocks (with `pad`, each starting on a 128-row block: fp8.fuse_fp8_rows;
    split the output with split_parts); a mix of kinds into RowParts (bias then inside the parts)."""
    fp8 = [isinstance(lin, FP8Linear) for lin in linears]
    if any(fp8) and not all(fp8):
        runs: list[list[nn.Module]] = []
        for lin, kind in zip(linears, fp8):
            if runs and isinstance(runs[-1][0], FP8Linear) == kind:
                runs[-1].append(lin)
            else:
                runs.append([lin])
        return RowParts(tuple(fuse_rows(run) for run in runs)), None
    if all(fp8):
        return fuse_fp8_rows(linears, pad)
    w = torch.cat([lin.weight for lin in linears])
    b = torch.cat([lin.bias for lin in linears]) if linears[0].bias is not None else None
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(w[row:row + n], requires_grad=False)
        if b is not None:
            lin.bias = nn.Parameter(b[row:row + n], requires_grad=False)
        row += n
    return w, b


def split_parts(y: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The output of fuse_rows(..., pad=True)'s weight -> each projection's columns (views): side by side,
    or each from the next multiple of 128 where the FP8 parts were padded to whole blocks."""
    if y.shape[-1] == sum(sizes):
        return list(y.split(sizes, dim=-1))
    starts = itertools.accumulate((cdiv(n, BLOCK) * BLOCK for n in sizes), initial=0)
    return [y[..., s:s + n] for s, n in zip(starts, sizes)]


def fuse_projections(module: nn.Module) -> None:
    """Fuse the GEMMs that read the same input in every layer of an inference model (fewer, larger
    GEMMs): every submodule that has a `fuse()` method does it."""
    for m in list(module.modules()):
        if hasattr(m, "fuse") and m is not module:
            m.fuse()

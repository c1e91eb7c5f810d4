"""Hybrid Qwen3.5/3.6 causal LM (the target): Gated DeltaNet linear-attention layers with a gated
full-attention layer every few. Same interface as the Qwen3 target, so the engine, runner and drafter
code do not change: full-attention layers use the KV cache and the tree's ancestor mask as before;
linear-attention layers run the gated delta rule in parallel form over each node's own path
(gated_delta.py), from the committed recurrent and conv state that the cache keeps (engine/kv_cache.py);
a prompt takes the chunkwise-parallel form (gdn_chunk.py).

HF checkpoints store the RMSNorm weights zero-centred (the norm scales by 1 + w); the loader turns
them into plain scales (`from_hf_state`) so one RMSNorm serves every model."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from .config import Qwen35Config
from .gated_delta import Paths, Step, causal_conv, gated_delta, tree_paths
from .gdn_chunk import (PaddedPrompt, chunk_gated_delta, conv_inputs, conv_silu, padded_chunk_gated_delta,
                        prompt_conv, tail_before)
from .gdn_kernels import Gates, conv_heads, fused_fits, gated_norm, tree_delta, tree_delta_fits
from .gdn_prompt import prompt_conv_heads, prompt_delta, prompt_fits, prompt_gated_norm, prompt_gates
from .kernels import rms_norm_rope, sigmoid_gate
from .layers import (MLP, RMSNorm, TreeInputs, attend_cached, attend_static, fuse_rows, linear, split_parts,
                     store_roped_kv)
from .parallel import TensorParallel, add_reduced, reduced
from .qwen3 import Qwen3ForCausalLM

ZERO_CENTRED = re.compile(r"(^model\.norm|layernorm|self_attn\.[qk]_norm)\.weight$")


def from_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF Qwen3.5 state dict -> ours: the language model's weights under model.*, norm scales 1 + w."""
    out = {}
    for key, value in state.items():
        key = key.replace("model.language_model.", "model.", 1)
        out[key] = value.float() + 1.0 if ZERO_CENTRED.search(key) else value
    return out


def to_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Ours -> HF Qwen3_5ForCausalLM layout (zero-centred norm weights)."""
    return {k: (v - 1.0 if ZERO_CENTRED.search(k) else v) for k, v in state.items()}


def projected(y: torch.Tensor, out_proj: nn.Linear, tp: TensorParallel | None,
              residual: torch.Tensor | None) -> torch.Tensor:
    """out_proj(y) summed over the ranks, added to `residual` where given by the GEMM itself on CUDA
    (parallel.add_reduced: no add kernel, 64 of them a pass at Qwen3.6-27B)."""
    if residual is None:
        return reduced(out_proj(y), tp)
    return add_reduced(residual, y, out_proj, tp)


class GatedAttention(nn.Module):
    """Full attention with an output gate (q_proj yields [query | gate] per head) and partial RoPE."""

    def __init__(self, cfg: Qwen35Config, slot: int) -> None:
        super().__init__()
        h, self.n_heads, self.n_kv, self.head_dim = (cfg.hidden_size, cfg.num_attention_heads,
                                                     cfg.num_key_value_heads, cfg.head_dim)
        self.slot = slot  # this layer's index in the KV cache (full-attention layers only)
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fused weight, bias (fuse())
        self.tp: TensorParallel | None = None  # a shard: o_proj's output summed over the ranks

    def fuse(self) -> None:
        self._qkv = fuse_rows([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, start: int,
                mask: torch.Tensor | None, tree: TreeInputs | None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The attention's output; with `residual`, residual + it (on CUDA the out-projection's GEMM adds
        it in place: the residual stream must be held by nothing else)."""
        b, t, _ = x.shape
        d = self.head_dim
        if self._qkv is not None:
            q_gate, k, v = linear(x, *self._qkv).split([2 * self.n_heads * d, self.n_kv * d, self.n_kv * d], -1)
        else:
            q_gate, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_gate = q_gate.view(b, t, self.n_heads, 2 * d)
        # RMSNorm + partial RoPE, one kernel each on CUDA (q read in place from [query | gate]); a tree
        # pass (or prompt piece) also stores k and v in the same kernel as k's, where the cache names a target
        q = rms_norm_rope(q_gate[..., :d], self.q_norm.weight, self.q_norm.eps, cos, sin)     # [B, Hq, T, D]
        k = k.view(b, t, self.n_kv, d)
        v = v.reshape(b, t, self.n_kv, d)
        if tree is not None:
            store_roped_kv(k, v, self.k_norm, cos, sin, cache, self.slot, tree.slots)
            o = attend_static(q, cache, self.slot, tree)
        else:
            k = rms_norm_rope(k, self.k_norm.weight, self.k_norm.eps, cos, sin)
            o = attend_cached(q, k, v.transpose(1, 2), cache, self.slot, start, mask, None)   # [B, Hq, T, D]
        return projected(sigmoid_gate(o, q_gate), self.o_proj, self.tp, residual)


class GatedDeltaNet(nn.Module):
    """Linear attention: causal conv over q/k/v, then the gated delta rule, then a SiLU-gated RMSNorm."""

    def __init__(self, cfg: Qwen35Config, slot: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.slot = slot  # this layer's index in the cache's recurrent state
        self.n_k, self.n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.conv_dim = cfg.linear_conv_dim
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.n_v * self.dv, bias=False)
        self.in_proj_b = nn.Linear(h, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(h, self.n_v, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = RMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.n_v * self.dv, h, bias=False)
        self._in_proj = None  # qkv | z | b | a in one weight once fuse() ran (layers.Weight)
        self.tp: TensorParallel | None = None  # a shard: out_proj's output summed over the ranks

    def fuse(self) -> None:
        # padded: the 48-row b and a each on a 128-row block of its own, so the whole projection keeps
        # the checkpoint's block scales and can take cuBLASLt's block-scaled GEMM (model/fp8.py)
        self._in_proj = fuse_rows([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a], pad=True)[0]

    def forward(self, x: torch.Tensor, cache, start: int, tree: TreeInputs | None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output; with `residual`, residual + it (as GatedAttention.forward)."""
        b, t, _ = x.shape
        if self._in_proj is not None:
            mixed, z, b_in, a = split_parts(linear(x, self._in_proj),
                                            [self.conv_dim, self.n_v * self.dv, self.n_v, self.n_v])
        else:
            mixed, z, b_in, a = (p(x) for p in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a))
        prompt = None if tree is None else tree.prompt
        if tree is not None and prompt is None and fused_fits(mixed, self.dk, self.dv, self.kernel):
            # the graphed tree pass on CUDA: conv..normalisation, the recurrence (with the gates) and the
            # gated norm as one kernel each, the inputs and keys written straight into the scratch that
            # `compact` reads
            inputs, scratch = cache.scratch(self.slot, t)
            q, k, v = conv_heads(mixed, cache.conv[self.slot], self.conv1d.weight[:, 0], tree.paths.window,
                                 self.n_k, self.n_v, self.dk, self.dv, k=scratch.k, keep=inputs)
            if tree_delta_fits(q, v):
                core, u, pathsum = tree_delta(q, k, v, None, None, cache.state[self.slot], tree.paths.mask,
                                              gates=Gates(b_in, a, self.A_log, self.dt_bias), u=scratch.u,
                                              pathsum=scratch.g)
                cache.save_step(self.slot, inputs, Step(k, u, pathsum), t)   # all in place: nothing copied
            else:
                beta, g = self._gates(b_in, a)
                core = self._tree(inputs, q, k, v, beta.transpose(1, 2), g.transpose(1, 2), cache, tree.paths)
            return projected(gated_norm(core, z, self.norm.weight, self.norm.eps, x.dtype), self.out_proj, self.tp,
                             residual)
        if prompt is not None and prompt_fits(mixed, self.dk, self.dv, self.kernel):
            # the graphed prompt piece on CUDA: fla's chunked calls between three kernels of gdn_prompt.py
            return projected(self._fused_padded_chain(mixed, z, b_in, a, cache, prompt), self.out_proj, self.tp,
                             residual)
        beta, g = self._gates(b_in, a)
        if prompt is not None:
            core = self._padded_chain(mixed, beta, g, cache, prompt)
        elif tree is not None:
            conv = causal_conv(mixed, cache.conv[self.slot], self.conv1d.weight[:, 0], tree.paths.window)
            core = self._tree(mixed, *self._heads(conv, beta, g), cache, tree.paths)
        else:
            core = self._chain(mixed, beta, g, cache, resume=cache is not None and start > 0)
        core = core.transpose(1, 2).to(x.dtype)                                    # [B, T, Hv, dv]
        z = z.reshape(b, t, self.n_v, self.dv)
        out = (self.norm(core) * F.silu(z.float())).to(x.dtype)
        return projected(out.reshape(b, t, -1), self.out_proj, self.tp, residual)

    def _gates(self, b_in: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The in-projection's b and a columns -> beta, g [B, T, Hv] float32 (gdn_kernels.tree_delta makes
        them the same way in its kernel)."""
        beta = torch.sigmoid(b_in).float()
        return beta, -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

    def _heads(self, conv: torch.Tensor, beta: torch.Tensor, g: torch.Tensor):
        """Conv output [B, T, C] -> q, k [B, Hv, T, dk] (L2-normalised, q scaled), v [B, Hv, T, dv],
        beta, g [B, Hv, T]; all float32, key heads shared by groups of value heads."""
        b, t, _ = conv.shape
        nk = self.n_k * self.dk
        q, k, v = conv.float().split([nk, nk, self.n_v * self.dv], dim=-1)
        group = self.n_v // self.n_k
        q, k = (y.view(b, t, self.n_k, self.dk).repeat_interleave(group, dim=2).transpose(1, 2) for y in (q, k))
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * self.dk ** -0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        v = v.view(b, t, self.n_v, self.dv).transpose(1, 2)
        return q, k, v, beta.transpose(1, 2), g.transpose(1, 2)

    def _tree(self, mixed: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
              g: torch.Tensor, cache, paths: Paths) -> torch.Tensor:
        """Every node from its parent's state; the committed state is only read. What `compact` needs
        to advance it along the accepted path goes to the cache's scratch."""
        out, step = gated_delta(q, k, v, g, beta, cache.state[self.slot], paths)
        cache.save_step(self.slot, mixed, step, mixed.shape[1])
        return out

    def _split(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A prompt's conv output [B, T, C] -> q, k [B, T, Hk, dk], v [B, T, Hv, dv] (views, as the
        chunked form takes them)."""
        b, t, _ = conv.shape
        nk = self.n_k * self.dk
        return tuple(y.view(b, t, -1, d) for y, d in zip(conv.split([nk, nk, self.n_v * self.dv], dim=-1),
                                                         (self.dk, self.dk, self.dv)))

    def _chain(self, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, cache, resume: bool) -> torch.Tensor:
        """Tokens in a row (a prompt), chunkwise-parallel (gdn_chunk.py): from the cache's state when
        resuming (start > 0), else from zeros; the final state goes back to the cache (if any).
        Returns [B, Hv, T, dv]."""
        b, t, _ = mixed.shape
        if resume:
            conv_state, state = cache.conv[self.slot], cache.state[self.slot]
        else:
            conv_state, state = mixed.new_zeros(b, self.kernel - 1, self.conv_dim), None
        # the prompt's kept state may fall in this pass, `keep` tokens in (a later turn resumes there)
        keep = None if cache is None else cache.keep_at
        conv, tail = prompt_conv(mixed, conv_state, self.conv1d.weight[:, 0])
        q, k, v = self._split(conv)
        cut = t if keep is None else keep  # the recurrence runs in two calls where the state is kept
        out, state = chunk_gated_delta(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], state)
        if keep is not None:  # the snapshot: the K-1 conv inputs before that point, the state there
            inputs = torch.cat([conv_state.to(mixed.dtype), mixed[:, :keep]], dim=1)
            cache.snap_conv[self.slot] = inputs[:, -(self.kernel - 1):]
            cache.snap_state[self.slot] = state
        if cut < t:
            rest, state = chunk_gated_delta(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], state)
            out = torch.cat([out, rest], dim=1)
        if cache is not None:
            cache.conv[self.slot] = tail
            cache.state[self.slot] = state
        return out.transpose(1, 2)

    def _padded_chain(self, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, cache,
                      prompt: PaddedPrompt) -> torch.Tensor:
        """A prompt piece padded to a fixed width, as _chain runs it (the same conv, the same chunks)
        but with every offset on the device: the row's conv tail and state are read and written by
        index, the padding writes nothing into the state (gdn_chunk.padded_chunk_gated_delta) and the
        tails are taken at the piece's real end and at `keep`. Returns [1, Hv, W, dv]. (On CUDA in 16
        bits _fused_padded_chain does the same in fused kernels.)"""
        conv_state, state = (x[self.slot].index_select(0, prompt.row).where(prompt.resume, 0)
                             for x in (cache.conv, cache.state))
        ext = conv_inputs(mixed, conv_state)
        q, k, v = self._split(conv_silu(ext, self.conv1d.weight[:, 0]))
        out, state, kept = padded_chunk_gated_delta(q, k, v, g, beta, state, prompt.length, prompt.keep)
        cache.conv[self.slot].index_copy_(0, prompt.row, tail_before(ext, prompt.length, self.kernel))
        cache.state[self.slot].index_copy_(0, prompt.row, state)
        if prompt.keep is not None:
            cache.snap_conv[self.slot].index_copy_(0, prompt.row, tail_before(ext, prompt.keep, self.kernel))
            cache.snap_state[self.slot].index_copy_(0, prompt.row, kept)
        return out.transpose(1, 2)

    def _fused_padded_chain(self, mixed: torch.Tensor, z: torch.Tensor, b_in: torch.Tensor, a: torch.Tensor, cache,
                            prompt: PaddedPrompt) -> torch.Tensor:
        """_padded_chain and the gated norm after it through gdn_prompt.py's kernels: the conv (writing the
        row's tails), the gates with the initial state, fla's one or two calls, the norm over both calls'
        outputs. Returns [1, W, Hv*dv] in the model dtype."""
        keep = prompt.keep is not None
        first, moved = prompt_conv_heads(mixed, cache.conv[self.slot], cache.snap_conv[self.slot] if keep else None,
                                         self.conv1d.weight[:, 0], prompt, self.n_k, self.n_v, self.dk, self.dv)
        first, moved, state = prompt_gates(b_in, a, self.A_log, self.dt_bias, cache.state[self.slot], prompt,
                                           first, moved)
        out, state = prompt_delta(first, state)
        rest = None
        if moved is not None:  # the snapshot, then on from there
            cache.snap_state[self.slot].index_copy_(0, prompt.row, state)
            rest, state = prompt_delta(moved, state)
        cache.state[self.slot].index_copy_(0, prompt.row, state)
        return prompt_gated_norm(out, rest, prompt.keep, z, self.norm.weight, self.norm.eps)


class HybridLayer(nn.Module):
    def __init__(self, cfg: Qwen35Config, index: int) -> None:
        super().__init__()
        kind = cfg.layer_types[index]
        slot = cfg.layer_types[:index].count(kind)
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, slot)
        else:
            self.self_attn = GatedAttention(cfg, slot)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, idx: int, cache, start: int,
                mask: torch.Tensor | None, static: TreeInputs | None = None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            if mask is not None:
                raise ValueError("linear-attention layers take no mask: use a tree pass")
            x = self.linear_attn(h, cache, start, static, residual=x)
        else:
            x = self.self_attn(h, cos, sin, cache, start, mask, static, residual=x)
        return self.mlp.add_to(x, self.post_attention_layernorm(x))


class Qwen35Body(nn.Module):
    def __init__(self, cfg: Qwen35Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35ForCausalLM(Qwen3ForCausalLM):
    """Parameter names mirror HF's Qwen3_5ForCausalLM (after `from_hf_state`)."""

    body = Qwen35Body

    def prepare(self, static: TreeInputs | None, pos: torch.Tensor) -> TreeInputs | None:
        # the attention's plan (Qwen3ForCausalLM.prepare), then one set of node paths for all linear layers;
        # the root sits at the first slot's position (a padded prompt piece is no tree: its linear layers
        # run the chunked form)
        static = super().prepare(static, pos)
        if static is None or static.prompt is not None:
            return static
        if static.slots.dim() == 1:
            depth = pos[0] - static.slots[0]
        else:  # a batch of trees, each sequence its own slots: [B, T]
            depth = pos - static.slots[:, :1]
        return static._replace(paths=tree_paths(static.tree, depth, self.config.linear_conv_kernel_dim))


"""Compact Qwen3 causal LM (the target): loads HF Qwen3 weights, returns final hidden states plus the
hidden states of chosen layers (the drafter's context features). Logits are a separate call so callers
only pay the LM head for the rows they need."""

from __future__ import annotations

import torch
from torch import nn

from .config import Qwen3Config
from .kernels import tree_attention_plan
from .layers import LayerWeights, RMSNorm, Rotary, TreeInputs, attend_cached, attend_static


class DecoderLayer(LayerWeights):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, idx: int,
                cache, start: int, mask: torch.Tensor | None, static: TreeInputs | None = None) -> torch.Tensor:
        attn = self.self_attn
        h = self.input_layernorm(x)
        if static is not None:  # a tree pass: k/v stored at the nodes' slots, attention over the cache
            q = attn.qkv_to_cache(h, cos, sin, cache, idx, static.slots)
            o = attend_static(q, cache, idx, static)
        else:
            o = attend_cached(*attn.qkv(h, cos, sin), cache, idx, start, mask, None)
        x = attn.add_out(x, o)
        return self.mlp.add_to(x, self.post_attention_layernorm(x))


class Qwen3Body(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """Parameter names mirror HF (model.*, lm_head) so a state dict loads as is."""

    body = Qwen3Body

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
        self.feature_layers: list[int] = []  # decoder layers whose outputs feed the drafter

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, pos: torch.Tensor, cache=None, start: int = 0,
                mask: torch.Tensor | None = None, *,
                static: TreeInputs | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, pos: [B, T]; mask: bool [T, start+T] (None = causal from position 0).

        static: a tree pass: write k/v at cache slots static.slots and attend over the first kv_len
        cache entries with static.bias (no host-side offsets).

        Returns final-normed hidden [B, T, H] and features [B, T, len(feature_layers)*H] (or None).
        """
        static = self.prepare(static, pos)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(pos, x.dtype)
        # the drafter wants features in target_layer_ids order; each is copied out as its layer ends
        # (the layers update the residual stream in place on CUDA)
        width = x.shape[-1]
        slot = {layer: j * width for j, layer in enumerate(self.feature_layers)}
        feats = x.new_empty(*x.shape[:2], len(slot) * width) if slot else None
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, i, cache, start, mask, static)
            if i in slot and i != last:
                feats[..., slot[i]:slot[i] + width] = x
        x = self.model.norm(x)
        if last in slot:  # HF's hidden_states[-1] is taken after the final norm
            feats[..., slot[last]:slot[last] + width] = x
        return x, feats

    def prepare(self, static: TreeInputs | None, pos: torch.Tensor) -> TreeInputs | None:
        """What every layer of a tree pass shares, computed once: a batch of trees' attention plan where
        it takes the split fitted to the rows' lengths (kernels.tree_attention_plan)."""
        if static is None or static.tree is None:
            return static
        cfg = self.config
        plan = tree_attention_plan(static.lengths, static.kv_len, static.slots.shape[-1], cfg.num_attention_heads,
                                   cfg.num_key_value_heads, cfg.head_dim)
        return static if plan is None else static._replace(attn_plan=plan)

    def logits(self, h: torch.Tensor, float32: bool = True, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for h [..., H], in float32 unless `float32` is False (the model's dtype: the batched
        passes, whose readers convert where they compute, argmax and the tree's top-K need not: a
        [272, 151936] float32 copy is 60 us on an H200). The rows go to the LM head as one 2-D GEMM:
        a strided 3-D slice (the batched drafter's h[:, 1:]) would run as a batched GEMM that reads the
        whole head once per batch row (4.8 ms instead of 0.3 ms at 16 requests on an H200).
        rows [N, H]: a copy of some of the head's rows (a draft vocabulary), the logits over those only."""
        h2 = h.reshape(-1, h.shape[-1])
        out = self.lm_head(h2) if rows is None else torch.nn.functional.linear(h2, rows)
        return (out.float() if float32 else out).view(*h.shape[:-1], -1)

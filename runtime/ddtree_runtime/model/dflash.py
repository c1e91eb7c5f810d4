"""DFlash block-diffusion drafter (z-lab checkpoint layout).

The drafter has no embeddings or LM head of its own: the block [bonus, MASK, ...] is embedded with the
target's embed_tokens and its final hidden states go through the target's lm_head. Context comes from
the target's hidden states at `target_layer_ids`, projected by `fc` + `hidden_norm`; every layer's
k/v projections read both that context and the block, and the block attends to all of it (no causal
mask inside the block). Only context k/v is cached, since the block is rebuilt each round. A position's
context k/v depend on that position's features alone, so a prompt's are written a piece at a time as
the target computes them (`write_context`), and its first draft runs the block alone (feats None)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .config import DFlashConfig
from .kernels import DecodeLaunch
from .layers import LayerWeights, RMSNorm, Rotary, attend, attend_cache


class DraftInputs(NamedTuple):
    """The graphed drafter pass's device-side offsets (a plain 3-tuple is read as one without lengths)."""
    ctx_slots: torch.Tensor               # [C] or [B, C] cache slots of the new context
    block_slots: torch.Tensor             # [Q] or [B, Q] cache slots of the block
    kv_len: int
    lengths: torch.Tensor | None = None   # [B] keys each row's bias allows (layers.attend_decode)
    launch: DecodeLaunch | None = None    # the decode kernel's launch (kernels.DECODE_EAGER for the first draft)


class DFlashLayer(LayerWeights):
    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None, rope_q: tuple[torch.Tensor, torch.Tensor],
                rope_c: tuple[torch.Tensor, torch.Tensor], idx: int, cache, ctx_start: int,
                mask: torch.Tensor | None, static=None) -> torch.Tensor:
        # x: [B, Q, H] block stream; ctx: [B, C, H] projected context (new entries only when cached)
        attn = self.self_attn
        h = self.input_layernorm(x)
        if static is not None:
            # the graphed path (device-side offsets, see engine/runner.py): the block's k/v go to the
            # cache slots right after the context (free until the next round writes context there),
            # so attention reads one bucketed cache view with an additive bias and nothing is copied
            ctx_slots, block_slots, kv_len, lengths, launch = DraftInputs(*static)
            if ctx is not None:  # None: the context is in the cache already (write_context)
                attn.kv_to_cache(ctx, *rope_c, cache, idx, ctx_slots)
            q = attn.qkv_to_cache(h, *rope_q, cache, idx, block_slots)
            x = attn.add_out(x, attend_cache(q, cache, idx, kv_len, mask, lengths, launch))
            return self.mlp.add_to(x, self.post_attention_layernorm(x))
        q, kb, vb = attn.qkv(h, *rope_q)
        kc, vc = attn.kv(ctx, *rope_c)
        if cache is not None:
            kc, vc = cache.write(idx, ctx_start, kc, vc)
        k = torch.cat([kc, kb], dim=2)
        v = torch.cat([vc, vb], dim=2)
        x = attn.add_out(x, attend(q, k, v, mask))
        return self.mlp.add_to(x, self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Parameter names mirror the z-lab checkpoint (layers.*, norm, fc, hidden_norm)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def forward(self, block_emb: torch.Tensor, block_pos: torch.Tensor, feats: torch.Tensor | None,
                ctx_pos: torch.Tensor | None, cache=None, ctx_start: int = 0,
                mask: torch.Tensor | None = None, *, static=None) -> torch.Tensor:
        """block_emb: [B, Q, H] target embeddings of the block; feats: [B, C, L*H] raw target features
        (with a cache: only the ones not cached yet, at positions ctx_start..; None with `static`: no new
        context, the cache holds all of it); mask: bool
        [B, 1, Q, C+Q] or None (see everything); static = DraftInputs (context slots, block slots, kv_len):
        write the context and the block k/v at those cache slots and attend over the first kv_len cache
        entries (mask is then an additive bias over [kv_len]). Returns final-normed block hidden
        states [B, Q, H]."""
        ctx = rope_c = None
        if feats is not None:
            ctx = self.hidden_norm(self.fc(feats))
            rope_c = self.rotary(ctx_pos, block_emb.dtype)
        rope_q = self.rotary(block_pos, block_emb.dtype)
        x = block_emb
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, rope_q, rope_c, i, cache, ctx_start, mask, static)
        return self.norm(x)

    def write_context(self, feats: torch.Tensor, slots: torch.Tensor, cache) -> None:
        """Store the context k/v of target features feats [B, C, L*H] at cache positions slots [B, C]
        (also their RoPE positions) in every layer, with no block: a prefill hands each piece's features
        over as it computes them, so no buffer of the whole prompt's features is ever held."""
        ctx = self.hidden_norm(self.fc(feats))
        rope_c = self.rotary(slots, ctx.dtype)
        for i, layer in enumerate(self.layers):
            layer.self_attn.kv_to_cache(ctx, *rope_c, cache, i, slots)

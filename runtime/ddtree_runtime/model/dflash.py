"""DFlash block-diffusion drafter (z-lab checkpoint layout).

The drafter has no embeddings or LM head of its own: the block [bonus, MASK, ...] is embedded with the
target's embed_tokens and its final hidden states go through the target's lm_head. Context comes from
the target's hidden states at `target_layer_ids`, projected by `fc` + `hidden_norm`; every layer's
k/v projections read both that context and the block. What a layer's block queries see is z-lab's
(drafter_layout.py): a full layer, the whole context and the whole block; a sliding layer, causal inside
the block and only the keys in (p - window, p] for query position p (`DraftMask`). Only context k/v is
cached, since the block is rebuilt each round; the engine keeps a sliding layer's in a ring of its
last positions per row (engine/draft_cache.py), whose slots the mask then covers. A position's
context k/v depend on that position's features alone, so a prompt's are written a piece at a time as
the target computes them (`write_context`), and its first draft runs the block alone (feats None)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..drafter_layout import DraftAttention
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


class DraftMask:
    """Which keys each block query sees, per kind of draft layer (one tensor per kind, built once a pass).

    key_pos [B or 1, L]: each key's position; query_pos [B, Q]: each block query's; present [B, L] bool:
    the keys that hold this row's context or block (the rest are padding or another round's), or
    [B, 1, Q, L] where it differs by query (the tiny drafter's training: several blocks a row). additive:
    a bias in that dtype (0 / -inf, the graphed and paged paths), else bool (True = may attend). A full
    layer's is [B, 1, 1, L] (every query sees the same keys); a causal or sliding layer's [B, 1, Q, L].

    ring R > 0 (set by the drafter's graphed pass over a cache with rings, engine/draft_cache.py): a
    sliding layer's keys are instead its ring's R slots, slot j holding the latest position <= T with
    position mod R == j, T each row's last block position (the pass's highest write): [B, 1, Q, R]."""

    def __init__(self, key_pos: torch.Tensor, query_pos: torch.Tensor, present: torch.Tensor,
                 additive: torch.dtype | None = None) -> None:
        self.key_pos, self.query_pos, self.present, self.additive = key_pos, query_pos, present, additive
        self.ring = 0
        self._made: dict[DraftAttention, torch.Tensor] = {}

    def __call__(self, kind: DraftAttention) -> torch.Tensor:
        if kind not in self._made:
            self._made[kind] = self._visible(kind)
        return self._made[kind]

    def _visible(self, kind: DraftAttention) -> torch.Tensor:
        key_pos, present = self.key_pos, self.present
        if self.ring and kind.window is not None:
            top = self.query_pos[:, -1:]                                                # [B, 1]
            slot = torch.arange(self.ring, device=top.device)
            key_pos = top - (top - slot) % self.ring                                    # [B, R]
            present = key_pos >= 0
        seen = present if present.dim() == 4 else present[:, None, None, :]  # [B, 1, 1 or Q, L]
        if kind.causal or kind.window is not None:
            back = self.query_pos[:, None, :, None] - key_pos[:, None, None, :]        # [B, 1, Q, L] p - k
            if kind.causal:
                seen = seen & (back >= 0)
            if kind.window is not None:
                seen = seen & (back < kind.window)
                if not kind.causal:
                    seen = seen & (-back < kind.window)
            # a padding row's query (an AR row's, a batch bucket's pad row's) may see no key: it sees the
            # first slot, as with a full layer, since a softmax over nothing is NaN and NaN k/v it wrote
            # would poison later reads that mask them (a real query always sees its own key)
            first = torch.arange(seen.shape[-1], device=seen.device) == 0
            seen = seen | (first & ~seen.any(-1, keepdim=True))
        if self.additive is None:
            return seen
        zero = torch.zeros((), dtype=self.additive, device=seen.device)
        return torch.where(seen, zero, torch.full((), float("-inf"), dtype=self.additive, device=seen.device))


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
            if cache.windowed(idx):  # a ring (engine/draft_cache.py): every slot, its mask over them
                kv_len, lengths = cache.ring_size, None
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
        # --draft-vocab (draft_vocab.py): the target tokens it proposes [N] and their rows of the target's
        # head [N, H]; None: the whole head
        self.register_buffer("vocab_ids", None, persistent=False)
        self.register_buffer("head", None, persistent=False)

    def forward(self, block_emb: torch.Tensor, block_pos: torch.Tensor, feats: torch.Tensor | None,
                ctx_pos: torch.Tensor | None, cache=None, ctx_start: int = 0,
                mask: torch.Tensor | DraftMask | None = None, *, static=None) -> torch.Tensor:
        """block_emb: [B, Q, H] target embeddings of the block; feats: [B, C, L*H] raw target features
        (with a cache: only the ones not cached yet, at positions ctx_start..; None with `static`: no new
        context, the cache holds all of it); mask: a DraftMask (each layer its kind's), a tensor every
        layer uses (bool [B, 1, Q, C+Q]), or None (without `static`: the DraftMask of the keys' positions);
        static = DraftInputs (context slots, block slots, kv_len): write the context and the block k/v at
        those cache slots and attend over the first kv_len cache entries (the mask is then additive over
        [kv_len]). The block's embeddings are scaled by input_embedding_scale here. Returns final-normed
        block hidden states [B, Q, H]."""
        cfg = self.config
        ctx = rope_c = None
        if feats is not None:
            ctx = self.hidden_norm(self.fc(feats))
            rope_c = self.rotary(ctx_pos, block_emb.dtype)
        if mask is None and static is None:
            mask = self._keys_mask(block_pos, ctx_pos, cache, ctx_start)
        if isinstance(mask, DraftMask) and static is not None:
            mask.ring = cache.ring_size
        rope_q = self.rotary(block_pos, block_emb.dtype)
        x = block_emb if cfg.input_embedding_scale == 1.0 else block_emb * cfg.input_embedding_scale
        for i, layer in enumerate(self.layers):
            layer_mask = mask(cfg.layer_attention(i)) if isinstance(mask, DraftMask) else mask
            x = layer(x, ctx, rope_q, rope_c, i, cache, ctx_start, layer_mask, static)
        return self.norm(x)

    def _keys_mask(self, block_pos: torch.Tensor, ctx_pos: torch.Tensor, cache, ctx_start: int) -> DraftMask:
        """The eager path's keys: the cached context from position 0 (with a cache) or the new context,
        then the block."""
        if cache is not None:
            ctx_pos = torch.arange(ctx_start + ctx_pos.shape[1], device=block_pos.device)[None]
        key_pos = torch.cat([ctx_pos.expand(block_pos.shape[0], -1), block_pos], dim=1)
        return DraftMask(key_pos, block_pos, torch.ones_like(key_pos, dtype=torch.bool))

    def use_vocab(self, ids: torch.Tensor, head: torch.Tensor) -> None:
        """Propose only the target tokens `ids` [N]: `head` [N, H] is the target head's rows for them, which
        the block's logits are computed over (logit j is token ids[j]'s; the tree builder maps them back)."""
        self.vocab_ids, self.head = ids, head

    def block_logits(self, h: torch.Tensor, target, float32: bool = True) -> torch.Tensor:
        """The drafter's logits of its final hidden states h [..., H] (target.logits': through the target's
        head, or with a draft vocabulary through its copy of those rows), then draft_logits'."""
        return self.draft_logits(target.logits(h, float32, rows=self.head))

    def draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The target head's logits of the block made the drafter's: times output_multiplier, then
        softcapped (z-lab's compute_logits)."""
        cfg = self.config
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def write_context(self, feats: torch.Tensor, slots: torch.Tensor, cache) -> None:
        """Store the context k/v of target features feats [B, C, L*H] at cache positions slots [B, C]
        (also their RoPE positions) in every layer, with no block: a prefill hands each piece's features
        over as it computes them, so no buffer of the whole prompt's features is ever held."""
        ctx = self.hidden_norm(self.fc(feats))
        rope_c = self.rotary(slots, ctx.dtype)
        for i, layer in enumerate(self.layers):
            layer.self_attn.kv_to_cache(ctx, *rope_c, cache, i, slots)

"""A prompt's forward in pieces: each piece continues from what the pieces before it left in the cache
(the KV, and a hybrid target's recurrent and conv state), so a long prompt's activations are bounded by
one piece's while its arithmetic stays in large GEMMs."""

from __future__ import annotations

import torch

# PREFILL_PIECE: prompt tokens per forward (declared in capacity.py, which sizes the pool with it). Up
# to it a prompt is one forward (a later piece's lower-right causal attention measured slower than one
# causal pass on an H200: 32K tokens of the 8B shape in two 16K pieces 1.58 s against 1.30 s in one,
# docs/performance.md); past it, pieces bound the activations (128K tokens of the 27B hybrid shape
# peaked at 75.7 GiB in 16K pieces against 95.7 GiB in one)
from ..capacity import PREFILL_PIECE


def prefill(target, ids: torch.Tensor, cache, piece: int = PREFILL_PIECE) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [1, P] into an empty cache -> the last token's final hidden state [1, 1, H] and the drafter's
    features of every prompt position [1, P, F] (None when the target feeds no drafter)."""
    p = ids.shape[1]
    pos = torch.arange(p, device=ids.device)[None]                             # [1, P]
    feats = None
    for lo in range(0, p, piece):
        h, piece_feats = target(ids[:, lo:lo + piece], pos[:, lo:lo + piece], cache, start=lo)
        if piece_feats is None or p <= piece:
            feats = piece_feats
            continue
        if feats is None:
            feats = piece_feats.new_empty(1, p, piece_feats.shape[-1])
        feats[:, lo:lo + piece_feats.shape[1]] = piece_feats
    return h[:, -1:], feats

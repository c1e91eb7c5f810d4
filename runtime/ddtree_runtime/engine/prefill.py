"""A prompt's forward in pieces: each piece continues from what the pieces before it left in the cache
(the KV, and a hybrid target's recurrent and conv state), so a long prompt's activations are bounded by
one piece's while its arithmetic stays in large GEMMs."""

from __future__ import annotations

import torch

PREFILL_PIECE = 16384  # prompt tokens per forward: past a few thousand rows the GEMMs are at their rate


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

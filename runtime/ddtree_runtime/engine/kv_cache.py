"""Static KV cache: allocated once for the worst case, written in place, compacted by index."""

from __future__ import annotations

import torch


class KVCache:
    """k, v: [n_layers, batch, n_kv_heads, capacity, head_dim]. The engine serves one request at a
    time (batch 1); batch > 1 is for offline generation (tiny-model distillation), no tree compaction."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, capacity: int,
                 device: torch.device | str, dtype: torch.dtype, batch: int = 1) -> None:
        shape = (n_layers, batch, n_kv, capacity, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, Hkv, T, D]) at [start, start+T) and return views of the cache up to start+T."""
        end = start + k.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: need {end} slots, have {self.capacity}")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def write_at(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, Hkv, T, D]) at cache slots `slots` ([T] long, on the device) and return views
        of the first `length` entries: no host-side offsets, so a CUDA graph can replay it."""
        self.k[layer].index_copy_(2, slots, k)
        self.v[layer].index_copy_(2, slots, v)
        return self.k[layer, :, :, :length], self.v[layer, :, :, :length]

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Move entries start+keep[i] to start+i for every layer (keep ascending); the rest become free.

        Used after tree verification: the accepted path's KV entries end up contiguous after the context.
        """
        n = keep.numel()
        src = keep.to(self.k.device) + start
        # advanced indexing copies first, so overlapping source/destination ranges are safe
        self.k[:, :, :, start:start + n] = self.k[:, :, :, src]
        self.v[:, :, :, start:start + n] = self.v[:, :, :, src]

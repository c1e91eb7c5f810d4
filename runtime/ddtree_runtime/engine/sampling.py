"""Target-side token choice: argmax at temperature 0, otherwise a sample from the temperature /
top-p adjusted distribution. Tree verification samples every node at once; the walk then only reads
the samples of nodes it visits, each of which is a true draw from the target at that node."""

from __future__ import annotations

import torch


def adjusted_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """logits: [N, V] float32 -> probs [N, V] after temperature and nucleus (top-p) truncation."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        # keep a token if the mass before it is below top_p (so the top token always survives)
        drop = (sp.cumsum(dim=-1) - sp) >= top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def choose_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None) -> torch.Tensor:
    """logits: [N, V] -> tokens [N] long."""
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    probs = adjusted_probs(logits.float(), temperature, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

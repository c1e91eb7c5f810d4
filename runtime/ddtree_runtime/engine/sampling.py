"""Target-side token choice: argmax at temperature 0, otherwise a sample from the temperature / min-p /
top-k / top-p adjusted distribution, after any logit bias. Tree verification samples every node at
once; the walk then only reads the samples of nodes it visits, each of which is a true draw from the
target at that node. Every adjustment here depends on the node's logits alone, never on its position
or path, which is what keeps speculative decoding exact with them."""

from __future__ import annotations

import torch

from .types import SamplingParams


def biased_logits(logits: torch.Tensor, logit_bias: dict[int, float]) -> torch.Tensor:
    """logits: [N, V] -> [N, V] with each biased token's logit moved by its bias (a copy)."""
    if not logit_bias:
        return logits
    ids = torch.tensor(list(logit_bias), dtype=torch.long, device=logits.device)
    bias = torch.tensor(list(logit_bias.values()), dtype=torch.float32, device=logits.device)
    out = logits.float().clone()
    out[:, ids] += bias
    return out


def adjusted_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0,
                   min_p: float = 0.0) -> torch.Tensor:
    """logits: [N, V] float32 -> probs [N, V] after temperature, min-p, top-k and nucleus (top-p)
    truncation (vLLM's order)."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        sp = sp / sp.sum(dim=-1, keepdim=True)
        # keep a token if the mass before it is below top_p (so the top token always survives)
        drop = (sp.cumsum(dim=-1) - sp) >= top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
    return probs / probs.sum(dim=-1, keepdim=True)


def choose_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits: [N, V] -> tokens [N] long."""
    logits = biased_logits(logits, params.logit_bias)
    if params.temperature <= 0.0:
        return logits.argmax(dim=-1)
    probs = adjusted_probs(logits.float(), params.temperature, params.top_p, params.top_k, params.min_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

"""Target-side token choice: argmax at temperature 0 (below GREEDY_BELOW), otherwise a sample from the
temperature / min-p / top-k / top-p adjusted distribution, after any logit bias. Tree verification samples every node at
once; the walk then only reads the samples of nodes it visits, each of which is a true draw from the
target at that node. A sample is the inverse CDF at the request's own uniform draw for the output
position the node chooses (one draw per position, from its seed): the committed token at a position is
then what plain sampling with that draw gives, whatever the tree, its budget, the batch or the mode,
so a seed reproduces under batching and --round-nodes. Every adjustment but one depends on the node's logits alone, never on its
position or path, which is what keeps speculative decoding exact with them; the one, min_tokens,
depends on the node's depth only (which output token it chooses), which every node knows.

The log-probabilities returned to a client are the target's raw ones (before any of these
adjustments), taken from the same verify pass, for the nodes the walk commits."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .types import SamplingParams, TokenLogprob

# Below this temperature the choice is the argmax (vLLM's threshold): dividing by a temperature near
# zero overflows the logits to inf, and their softmax is NaN.
GREEDY_BELOW = 1e-5


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
        # keep a token if the mass before it is below top_p, and the top token whatever the rounding
        drop = (sp.cumsum(dim=-1) - sp) >= top_p
        drop[:, :1] = False
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
    return probs / probs.sum(dim=-1, keepdim=True)


def choose_tokens(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None) -> torch.Tensor:
    """logits: [N, V] -> tokens [N] long. uniforms: [N] in [0, 1), each row's draw (unused when greedy)."""
    logits = biased_logits(logits, params.logit_bias)
    if params.temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    probs = adjusted_probs(logits.float(), params.temperature, params.top_p, params.top_k, params.min_p)
    return inverse_cdf(probs, uniforms)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs: [N, V], uniforms: [N] -> tokens [N]: the first token whose cumulative probability passes
    the row's draw (a true sample from the row's distribution); never a token of probability 0, even
    where rounding puts the draw past the last cumulative sum."""
    cdf = probs.cumsum(dim=-1)
    chosen = torch.searchsorted(cdf, (uniforms[:, None] * cdf[:, -1:]).contiguous(), right=True)
    chosen = chosen.clamp(max=probs.shape[-1] - 1)
    return torch.where(probs.gather(1, chosen) > 0, chosen, probs.argmax(dim=-1, keepdim=True)).squeeze(-1)


def suppress_stops(logits: torch.Tensor, stop_ids: torch.Tensor, early: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [N, V] -> a copy with the stop tokens' logits at -inf in the rows that choose one of the
    first min_tokens output tokens. stop_ids: [S] long; early: [N] bool, those rows (None: every row)."""
    out = logits.float().clone()
    if early is None:
        out[:, stop_ids] = float("-inf")
    else:
        out[:, stop_ids] = out[:, stop_ids].masked_fill(early[:, None], float("-inf"))
    return out


class PendingLogprobs(NamedTuple):
    """Log-probabilities of chosen tokens on their way to the host: the copy is queued (asynchronous on
    CUDA) when the tokens are chosen, and read only once the walk says which nodes were committed.
    packed: [N, 1 + 2k] float32 on the host, row n: the chosen token's log-prob, the k most likely
    tokens' log-probs, then their ids (exact in float32: vocabularies are far below 2**24)."""
    packed: torch.Tensor
    top: int
    done: torch.cuda.Event | None

    def rows(self, nodes: list[int]) -> list[TokenLogprob]:
        if self.done is not None:
            self.done.synchronize()
        k, out = self.top, []
        for row in self.packed[nodes].tolist():
            out.append(TokenLogprob(row[0], [(int(t), lp) for lp, t in zip(row[1:1 + k], row[1 + k:])]))
        return out


def start_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top: int) -> PendingLogprobs:
    """logits: [N, V] the target's raw logits, chosen: [N] the token chosen at each row -> their
    log-probabilities and the `top` most likely tokens', copied to the host without waiting."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    parts = [logprobs.gather(1, chosen.view(-1, 1))]
    if top > 0:
        values, ids = logprobs.topk(top, dim=-1)
        parts += [values, ids.float()]
    packed = torch.cat(parts, dim=1)
    if not packed.is_cuda:
        return PendingLogprobs(packed, top, None)
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return PendingLogprobs(host, top, done)

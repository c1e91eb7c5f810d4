"""The chunkwise-parallel Gated DeltaNet prefill (model/gdn_chunk.py) against the token-by-token
recurrence at lengths that cross chunk boundaries, from zeros and from a carried state, and its padded
fixed-width form against the eager calls, bit for bit (the hybrid target's prefill built on it is checked
against transformers in test_hybrid_model.py)."""

from __future__ import annotations

import pytest
import torch

from ddtree_runtime.model.gdn_chunk import (CHUNK, chunk_gated_delta, conv_inputs, l2_normalised,
                                             padded_chunk_gated_delta, prompt_conv, tail_before)
from ddtree_runtime.model.gated_delta import causal_conv, tree_paths


def recurrence(q, k, v, g, beta, state, scale):
    """The gated delta rule one token at a time, in float64: [B, T, H, d] inputs, grouped key heads."""
    group = v.shape[2] // q.shape[2]
    q = (l2_normalised(q.double()) * scale).repeat_interleave(group, 2)
    k = l2_normalised(k.double()).repeat_interleave(group, 2)
    s = state.double()
    outs = []
    for t in range(q.shape[1]):
        s = s * g[:, t].double().exp()[..., None, None]
        kt = k[:, t]                                                           # [B, H, dk]
        u = beta[:, t].double()[..., None] * (v[:, t].double() - (s * kt[..., None]).sum(-2))
        s = s + kt[..., None] * u[..., None, :]
        outs.append((s * q[:, t][..., None]).sum(-2))
    return torch.stack(outs, dim=1), s


@pytest.mark.parametrize("length", [1, CHUNK - 1, CHUNK + 1, 3 * CHUNK + 17])
def test_chunkwise_form_equals_the_recurrence(length):
    gen = torch.Generator().manual_seed(length)
    b, hk, hv, dk, dv = 2, 2, 6, 16, 8
    q, k = (torch.randn(b, length, hk, dk, generator=gen) * 2 for _ in range(2))
    v = torch.randn(b, length, hv, dv, generator=gen)
    g = -torch.rand(b, length, hv, generator=gen) * 0.5
    beta = torch.rand(b, length, hv, generator=gen)
    state = torch.randn(b, hv, dk, dv, generator=gen)
    for start in (None, state):
        out, final = chunk_gated_delta(q, k, v, g, beta, start)
        ref_out, ref_final = recurrence(q, k, v, g, beta, torch.zeros_like(state) if start is None else start,
                                        dk ** -0.5)
        assert out.shape == (b, length, hv, dv) and final.dtype == torch.float32
        assert torch.allclose(out.double(), ref_out, atol=1e-5), (out - ref_out).abs().max()
        assert torch.allclose(final.double(), ref_final, atol=1e-5)


def test_split_prompt_carries_the_state_and_conv_tail():
    """Two calls (a prompt cut anywhere, even inside the conv window) give what one call gives."""
    gen = torch.Generator().manual_seed(7)
    b, t, c, kernel = 1, 150, 12, 4
    x, weight = torch.randn(b, t, c, generator=gen), torch.randn(c, kernel, generator=gen)
    whole, tail = prompt_conv(x, torch.zeros(b, kernel - 1, c), weight)
    first, mid = prompt_conv(x[:, :2], torch.zeros(b, kernel - 1, c), weight)
    second, end = prompt_conv(x[:, 2:], mid, weight)
    assert torch.allclose(torch.cat([first, second], 1), whole, atol=1e-6) and torch.allclose(end, tail)
    # the tree path's gathered conv over a chain is the same function
    chain = torch.ones(t, t, dtype=torch.bool).tril()
    window = tree_paths(chain, torch.arange(t), kernel).window
    assert torch.allclose(causal_conv(x, torch.zeros(b, kernel - 1, c), weight, window), whole, atol=1e-5)

    q, k = (torch.randn(b, t, 2, 8, generator=gen) for _ in range(2))
    v, g, beta = torch.randn(b, t, 4, 8, generator=gen), -torch.rand(b, t, 4, generator=gen), torch.rand(b, t, 4)
    out, final = chunk_gated_delta(q, k, v, g, beta)
    cut = CHUNK + 5
    out1, mid_state = chunk_gated_delta(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut])
    out2, final2 = chunk_gated_delta(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], mid_state)
    assert torch.allclose(torch.cat([out1, out2], 1), out, atol=1e-5) and torch.allclose(final2, final, atol=1e-5)


@pytest.mark.parametrize("length,width,keep", [(5, 32, None), (64, 64, None), (129, 256, None), (70, 128, 70),
                                               (33, 64, 1), (129, 256, 64), (200, 256, 130)])
def test_padded_piece_is_the_eager_one_exactly(length, width, keep):
    """At a fixed width, with the real length and the snapshot point as device tensors: the padding's
    zeroed gates and betas leave the state as it was, the tokens from `keep` on start their chunks
    where the eager second call's do, and the conv tails come from the real end: the outputs, the
    final state, the snapshot and the tails are the eager calls' to the bit."""
    gen = torch.Generator().manual_seed(length + width)
    b, hk, hv, dk, dv, c, kernel = 1, 2, 4, 8, 8, 12, 4
    q, k = (torch.randn(b, width, hk, dk, generator=gen) for _ in range(2))
    v, g = torch.randn(b, width, hv, dv, generator=gen), -torch.rand(b, width, hv, generator=gen)
    beta, state = torch.rand(b, width, hv, generator=gen), torch.randn(b, hv, dk, dv, generator=gen)
    x, conv_state = torch.randn(b, width, c, generator=gen), torch.randn(b, kernel - 1, c, generator=gen)
    n, cut = torch.tensor([length]), length if keep is None else keep
    at = None if keep is None else torch.tensor([keep])
    out, final, kept = padded_chunk_gated_delta(q, k, v, g, beta, state, n, at)
    first, mid = chunk_gated_delta(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], state)
    want, want_final = first, mid
    if cut < length:
        rest, want_final = chunk_gated_delta(*(t[:, cut:length] for t in (q, k, v, g, beta)), mid)
        want = torch.cat([first, rest], dim=1)
    assert torch.equal(out[:, :length], want) and torch.equal(final, want_final)
    assert kept is None if keep is None else torch.equal(kept, mid)
    ext = conv_inputs(x, conv_state)
    _, tail = prompt_conv(x[:, :length], conv_state, torch.ones(c, kernel))
    _, kept_tail = prompt_conv(x[:, :cut], conv_state, torch.ones(c, kernel))
    assert torch.equal(tail_before(ext, n, kernel), tail)
    assert torch.equal(tail_before(ext, torch.tensor([cut]), kernel), kept_tail)

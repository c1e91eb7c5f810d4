"""The hybrid's gated attention kernels (model/kernels.py: RMSNorm + partial RoPE, the fused KV write, the
output gate) on a CUDA GPU at the Qwen3.6-27B's heads (24 query / 4 KV heads of 256, 64 dims rotated):
CI has no GPU and skips this file, the GPU calls run it (test_triton_kernels.py checks the same kernels
through Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

import ddtree_runtime.model.kernels as K

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels run on CUDA only")

B, T, HQ, HKV, D, R, EPS = 3, 17, 24, 4, 256, 64, 1e-6


def inputs(seed: int = 0):
    """A fused projection's output split as GatedAttention splits it, bf16 on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    y = torch.randn(B, T, (2 * HQ + 2 * HKV) * D, generator=gen, device="cuda").to(torch.bfloat16)
    q_gate = y[..., :2 * HQ * D].view(B, T, HQ, 2 * D)
    k = y[..., 2 * HQ * D:(2 * HQ + HKV) * D].view(B, T, HKV, D)
    v = y[..., (2 * HQ + HKV) * D:].view(B, T, HKV, D)
    w = (torch.rand(D, generator=gen, device="cuda") + 0.5).to(torch.bfloat16)
    ang = torch.rand(B, 1, T, R, generator=gen, device="cuda") * 6
    return q_gate, k, v, w, ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)


def within_bf16(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """got within a unit in bf16's last place of the float64 RMSNorm + partial RoPE of x."""
    want = K.rotate_half_rope(K.rms_norm_torch(x.double(), w.double(), EPS).transpose(1, 2), cos.double(),
                              sin.double())
    return bool(((got.double() - want).abs() <= want.abs() * 2 ** -7 + 1e-6).all())


def test_partial_rope_matches_float64_and_a_token_has_its_bits_whatever_shares_the_call():
    q_gate, k, _, w, cos, sin = inputs()
    q = q_gate[..., :D]
    got = K.rms_norm_rope(q, w, EPS, cos, sin)
    assert within_bf16(got, q, w, cos, sin) and within_bf16(K.rms_norm_rope(k, w, EPS, cos, sin), k, w, cos, sin)
    alone = K.rms_norm_rope(q[1:2, 7:8], w, EPS, cos[1:2, :, 7:8], sin[1:2, :, 7:8])
    assert torch.equal(alone, got[1:2, :, 7:8])                                      # the AR step's q is the verify's


def test_the_fused_kv_write_stores_the_ropes_k_and_v_as_is():
    _, k, v, w, cos, sin = inputs(1)
    cache_k = torch.zeros(B, HKV, 64, D, device="cuda", dtype=torch.bfloat16)
    cache_v = torch.zeros_like(cache_k)
    slots = torch.stack([torch.randperm(64, device="cuda")[:T] for _ in range(B)])
    assert K.rms_norm_rope_to_cache(k, v, w, EPS, cos, sin, cache_k, cache_v, slots)
    rows = torch.arange(B, device="cuda")[:, None]
    assert torch.equal(cache_k.transpose(1, 2)[rows, slots], K.rms_norm_rope(k, w, EPS, cos, sin).transpose(1, 2))
    assert torch.equal(cache_v.transpose(1, 2)[rows, slots], v)


def test_the_output_gate_is_torchs_to_two_units_in_the_last_place():
    """Two: the kernel's sigmoid (Triton's exp) may round to the next bf16 value, then the product."""
    q_gate, *_ = inputs(2)
    o = torch.randn(B, T, HQ, D, device="cuda").to(torch.bfloat16).transpose(1, 2)   # decode_attention's layout
    got = K.sigmoid_gate(o, q_gate)
    want = o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(q_gate[..., D:].reshape(B, T, -1))
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -6 + 1e-6).all()

"""The runtime's Triton kernels (CUDA-only in service) run here on the CPU through Triton's interpreter
and must agree with the torch path: the split-KV decode attention against a float reference, the tree
build against the torch build and the top-K log-probs before it against log_softmax, RMSNorm+RoPE (full
and partial) and the fused KV write, the gated attention's output gate (and the hybrid's gated attention
through them), the fused SiLU-and-multiply, the block-scaled FP8 GEMM against its scales applied in
float64 (and both tiny FP8 targets through it against the torch path), and the Gated DeltaNet tree pass
with its fused conv/heads and gated-norm kernels against the same layer, the commit's state advance
against torch, and the prompt piece's conv, gates and gated-norm kernels (gdn_prompt.py) against the
torch padded path."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

from ddtree_devtools import compile_check  # noqa: E402  (after the skip: it needs triton)

PRELUDE = """
import torch
import ddtree_runtime.model.kernels as K
import ddtree_runtime.model.gdn_kernels as G
from ddtree_devtools.interpreter import allow_loop_bounds
from ddtree_devtools.compile_check import record_launches
torch.manual_seed(0)
allow_loop_bounds()
record_launches()

def ref(q, k, v, bias):  # grouped-head attention in float64: the decode attention kernel's reference
    g = q.shape[1] // k.shape[1]
    s = q.double() @ k.repeat_interleave(g, 1).double().transpose(-1, -2) * q.shape[-1] ** -0.5
    return torch.softmax(s + bias.double(), -1) @ v.repeat_interleave(g, 1).double()

def paged_pool(cache, page):  # cache [2, B, Hkv, L, D] as a paged pool: each row's pages scattered among stale ones
    _, b, hkv, length, d = cache.shape
    width = length // page
    table = (torch.randperm(b * width) + 1).view(b, width)
    pool = torch.randn(2, 1, hkv, (b * width + 1) * page, d, dtype=cache.dtype)
    for row in range(b):
        for p in range(width):
            slot = table[row, p].item() * page
            pool[:, 0, :, slot:slot + page] = cache[:, row, :, p * page:(p + 1) * page]
    return table, pool
"""


def interpret(body: str) -> str:
    """Run `body` in a fresh interpreter with TRITON_INTERPRET=1 (it must be set before triton loads),
    then compile every kernel it launched for an H200 here (compile_check.py): what the interpreter
    accepts the compiler may still refuse."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "launches.jsonl"
        done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True,
                              text=True, timeout=600,
                              env={**os.environ, "TRITON_INTERPRET": "1", compile_check.LOG_ENV: str(log)})
        assert done.returncode == 0, done.stderr[-3000:]
        assert log.exists(), "the interpreter ran no kernel"
        failures = compile_check.compile_logged(log)
    assert not failures, "\n".join(failures)
    return done.stdout


def test_decode_attention_matches_a_float_reference():
    out = interpret("""
        K._use_triton = lambda x: True
        # (query heads, KV heads, queries, head dim, keys, one bias row for all queries)
        # the last case spans several blocks of query rows (129 queries x 4 heads per KV head)
        for hq, hkv, t, d, length, shared in [(4, 2, 17, 64, 300, False), (8, 2, 1, 128, 256, False),
                                              (6, 1, 5, 256, 100, False), (4, 2, 3, 32, 200, True),
                                              (4, 1, 129, 32, 150, False)]:
            q = torch.randn(1, hq, t, d, dtype=torch.float16)
            cache = torch.randn(2, 1, hkv, length + 50, d, dtype=torch.float16)
            k, v = cache[0, :, :, :length], cache[1, :, :, :length]   # strided views, as the cache gives
            allowed = torch.rand(1 if shared else t, length) < 0.6
            allowed[:, 0] = True
            bias = torch.where(allowed, 0.0, float("-inf")).to(torch.float16)[None, None]
            assert K.decode_attention_fits(q, k)
            err = (K.decode_attention(q, k, v, bias).double() - ref(q, k, v, bias)).abs().max().item()
            print(hq, hkv, t, d, length, err)
            assert err < 2e-3, err
    """)
    assert len(out.splitlines()) == 5


def test_batched_decode_attention_gives_each_sequence_its_own_keys_and_bias():
    """A batched round: one launch for B sequences, each over its own cache row and bias (and the
    drafter's bias, one row for all queries of a sequence), equal to each sequence alone, at the
    batch rule's launch and at fixed ones (16-row blocks over several splits, 64-row blocks in one)."""
    out = interpret("""
        K._use_triton = lambda x: True
        launches = [None, K.DecodeLaunch(16, 64, 4), K.DecodeLaunch(64, 1024, 4)]
        for hq, hkv, t, d, length, shared in [(4, 2, 17, 64, 200, False), (8, 2, 3, 128, 160, False),
                                              (4, 2, 16, 32, 150, True)]:
            b = 3
            q = torch.randn(b, hq, t, d, dtype=torch.float16)
            cache = torch.randn(2, b + 1, hkv, length + 50, d, dtype=torch.float16)   # a pool: rows 0..b-1
            k, v = cache[0, :b, :, :length], cache[1, :b, :, :length]
            allowed = torch.rand(b, 1 if shared else t, length) < 0.6
            allowed[..., 0] = True
            bias = torch.where(allowed, 0.0, float("-inf")).to(torch.float16)[:, None]   # [B, 1, T or 1, L]
            assert K.decode_attention_fits(q, k)
            for launch in launches:
                fixed = launch or K.decode_launch(b, t, hq // hkv * t, length, hkv)
                batched = K.decode_attention(q, k, v, bias, launch=launch)
                for i in range(b):
                    alone = K.decode_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], bias[i:i + 1], launch=fixed)
                    assert torch.equal(batched[i:i + 1], alone), (hq, t, i, launch)
            print(hq, hkv, t)
        # a batch of single queries (AR steps) stays with SDPA, which ran them faster, unless the rule
        # says the kernel wins with per-row lengths
        one = torch.randn(3, 8, 1, 64, dtype=torch.float16)
        keys = torch.randn(3, 2, 100, 64, dtype=torch.float16)
        assert not K.decode_attention_fits(one, keys)
        assert K.decode_attention_fits(one, keys, torch.full((3,), 100)) == K.DECODE_BATCHED_ONE_QUERY
        assert K.decode_attention_fits(one[:1], keys[:1])
    """)
    assert len(out.splitlines()) == 3


def test_decode_attention_with_row_lengths_reads_only_each_rows_keys():
    """Per-row key lengths (a batched round's start + T): the same result as the bias alone when the
    bias masks the keys past them (random keys there, as a bucket's padding holds stale ones), the keys
    past them ignored even where the bias allows them (the loop really stops), rows of different lengths,
    splits entirely past a row's length, and single queries (batched AR steps)."""
    out = interpret("""
        K._use_triton = lambda x: True
        hq, hkv, d, bucket = 4, 2, 64, 256
        lengths = torch.tensor([40, 256, 131, 1])     # row 0: three of four 64-key splits past its length
        b = len(lengths)
        cache = torch.randn(2, b, hkv, bucket + 16, d, dtype=torch.float16)
        k, v = cache[0, :, :, :bucket], cache[1, :, :, :bucket]
        before = lengths[:, None] > torch.arange(bucket)                            # [B, L]
        for t in (17, 1):
            q = torch.randn(b, hq, t, d, dtype=torch.float16)
            allowed = (torch.rand(b, t, bucket) < 0.7) & before[:, None]
            allowed[..., 0] = True
            masked = torch.where(allowed, 0.0, float("-inf")).to(torch.float16)[:, None]    # [B, 1, T, L]
            open_past = torch.where(allowed | ~before[:, None], 0.0, float("-inf")).to(torch.float16)[:, None]
            for launch in (K.DecodeLaunch(16, 64, 4), K.decode_launch(b, t, hq // hkv * t, bucket, hkv)):
                cut = K.decode_attention(q, k, v, masked, lengths, launch=launch)
                assert torch.equal(cut, K.decode_attention(q, k, v, masked, launch=launch)), launch
                err = (cut.double() - ref(q, k, v, masked)).abs().max().item()
                assert err < 2e-3, (t, launch, err)
                # the bias lets each row see past its length: with lengths those keys are still ignored
                assert torch.equal(K.decode_attention(q, k, v, open_past, lengths, launch=launch), cut), launch
                assert not torch.allclose(K.decode_attention(q, k, v, open_past, launch=launch), cut, atol=1e-2)
            print(t, err)
    """)
    assert len(out.splitlines()) == 2


def test_a_shared_context_is_read_without_its_bias():
    """shared: each row's keys before lengths - T are every query's, so the kernel reads no bias over
    the whole key blocks there: the same bits as the honest bias read everywhere, even where that bias
    is made to lie about those blocks (proof it is not read); the last T keys still follow it; over a
    paged pool too, rows
    whose context ends inside, at and before a split, and T = 1 (a batched AR step)."""
    out = interpret("""
        K._use_triton = lambda x: True
        hq, hkv, d, page, bucket = 4, 2, 64, 16, 256
        lengths = torch.tensor([40, 256, 131, 17])
        b = len(lengths)
        cache = torch.randn(2, b, hkv, bucket, d, dtype=torch.float16)
        table, pool = paged_pool(cache, page)
        for t in (17, 1):
            q = torch.randn(b, hq, t, d, dtype=torch.float16)
            keys = torch.arange(bucket)
            context = keys < (lengths - t)[:, None]                                   # [B, L]
            own = (torch.rand(b, t, bucket) < 0.6) & (keys < lengths[:, None])[:, None] & ~context[:, None]
            own[torch.arange(b)[:, None], torch.arange(t), (lengths - t)[:, None] + torch.arange(t)] = True  # its own key
            honest = torch.where(context[:, None] | own, 0.0, float("-inf")).to(torch.float16)[:, None]
            whole = keys < ((lengths - t) // 64 * 64)[:, None]     # the context's whole 64-key blocks
            lying = honest.masked_fill(whole[:, None, None] & (torch.rand(b, 1, t, bucket) < 0.5), float("-inf"))
            for launch in (K.DecodeLaunch(16, 64, 4), K.DecodeLaunch(64, 1024, 4)):
                want = K.decode_attention(q, cache[0], cache[1], honest, lengths, launch=launch)
                assert torch.equal(K.decode_attention(q, cache[0], cache[1], lying, lengths, launch=launch,
                                                      shared=True), want), (t, launch)
                assert not torch.equal(K.decode_attention(q, cache[0], cache[1], lying, lengths, launch=launch), want)
                got = K.decode_attention(q, pool[0], pool[1], lying, lengths, launch=launch, table=table,
                                         page_size=page, length=bucket, shared=True)
                assert torch.equal(got, want), (t, launch)
            err = (want.double() - ref(q, cache[0], cache[1], honest)).abs().max().item()
            assert err < 2e-3, err
            print(t, err)
    """)
    assert len(out.splitlines()) == 2


def test_a_batch_over_a_shared_context_takes_its_split_from_its_rows_lengths():
    """With the fitted split on (the default), the rule's launch for a batch of trees over a shared context: the split is
    fitted to the rows' lengths (kernels.fitted_attention: one wave of programs, 8 off CUDA), with the
    same result as a fixed launch up to rounding; equal rows cut into as many spans as the wave holds,
    one long row among short ones cut the more, a paged pool read to the same bits; rows over half the
    wave (which would leave a long row uncut: over two waves, DDTREE_FIT_WAVES=2, they fit), tiles of
    fewer than 8 warps, and the switch off (DDTREE_FIT_SPLIT=0), keep the bucket's split."""
    out = interpret("""
        K._use_triton = lambda x: True
        assert K.DECODE_FIT_SPLIT   # the default
        fitted = []
        def keep(*args):
            fitted.append(run(*args))
            return fitted[-1]
        run, K.fitted_attention = K.fitted_attention, keep
        # 68 query rows a KV head: the 128-row tile of 8 warps, which the fit takes
        hq, hkv, d, page, bucket, t = 4, 1, 64, 16, 1024, 17
        # 8 programs, a work item a (row, span): the longest row in as many spans as the other rows leave room for
        for lengths, split, first in [([1000, 1000], 256, [0, 4]), ([1000, 1000, 1000, 1000], 512, [0, 2, 4, 6]),
                                      ([1000, 50, 50], 192, [0, 6, 7])]:
            lengths = torch.tensor(lengths)
            b = len(lengths)
            cache = torch.randn(2, b, hkv, bucket, d, dtype=torch.float16)
            table, pool = paged_pool(cache, page)
            q = torch.randn(b, hq, t, d, dtype=torch.float16)
            keys = torch.arange(bucket)
            context = keys < (lengths - t)[:, None]
            own = (torch.rand(b, t, bucket) < 0.6) & (keys < lengths[:, None])[:, None] & ~context[:, None]
            own[torch.arange(b)[:, None], torch.arange(t), (lengths - t)[:, None] + torch.arange(t)] = True
            bias = torch.where(context[:, None] | own, 0.0, float("-inf")).to(torch.float16)[:, None]
            got = K.decode_attention(q, cache[0], cache[1], bias, lengths, shared=True)
            meta = fitted[-1]
            assert meta[0].item() == split and meta[1:].tolist() == first, (lengths, meta)
            fixed = K.decode_attention(q, cache[0], cache[1], bias, lengths, K.DecodeLaunch(16, 64, 4), shared=True)
            assert (got.double() - fixed.double()).abs().max().item() < 2e-3
            err = (got.double() - ref(q, cache[0], cache[1], bias)).abs().max().item()
            assert err < 2e-3, err
            paged = K.decode_attention(q, pool[0], pool[1], bias, lengths, table=table, page_size=page,
                                       length=bucket, shared=True)
            assert torch.equal(paged, got)
            # the plan a model's tree pass makes once for its layers: read, not made again, to the same bits
            plan = K.tree_attention_plan(lengths, bucket, t, hq, hkv, d)
            made = len(fitted)
            assert torch.equal(K.decode_attention(q, cache[0], cache[1], bias, lengths, shared=True, plan=plan), got)
            assert fitted[made].data_ptr() == plan.meta.data_ptr()
            print(b, split, err)
        count = len(fitted)
        # eight rows of one KV head and row block: over half the wave of 8, so one long row would stay whole
        many = torch.tensor([1000] + [50] * 7)
        more_q = torch.randn(8, hq, t, d, dtype=torch.float16)
        more_cache = torch.randn(2, 8, hkv, bucket, d, dtype=torch.float16)
        more_bias = torch.where(torch.arange(bucket) < many[:, None], 0.0, float("-inf")).to(torch.float16)
        more_bias = more_bias[:, None, None].expand(8, 1, t, bucket)
        got = K.decode_attention(more_q, more_cache[0], more_cache[1], more_bias, many, shared=True)
        assert len(fitted) == count and K.tree_attention_plan(many, bucket, t, hq, hkv, d) is None
        want = ref(more_q, more_cache[0], more_cache[1], more_bias)
        assert (got.double() - want).abs().max().item() < 2e-3
        # over two waves (DDTREE_FIT_WAVES=2) they fit: the long row in 8 spans of 128 keys, 15 items in two
        # waves of 8 (2 x (128 + 512) keys' worth, against 1 x (1024 + 512) with the long row whole and
        # 2 x (256 + 512) in 4 spans)
        K.FIT_WAVES = 2
        two = K.decode_attention(more_q, more_cache[0], more_cache[1], more_bias, many, shared=True)
        assert fitted[-1][0].item() == 128 and fitted[-1][1:].tolist() == [0, *range(8, 15)], fitted[-1]
        assert (two.double() - want).abs().max().item() < 2e-3
        K.FIT_WAVES = 1
        count = len(fitted)
        K.decode_attention(q[:, :2], cache[0], cache[1], bias, lengths, shared=True)  # 34 rows: a tile of 4 warps
        assert K.tree_attention_plan(lengths, bucket, t, 2, hkv, d) is None
        K.DECODE_FIT_SPLIT = False   # (DDTREE_FIT_SPLIT=0)
        K.decode_attention(q, cache[0], cache[1], bias, lengths, shared=True)
        assert len(fitted) == count and K.tree_attention_plan(lengths, bucket, t, hq, hkv, d) is None
    """)
    assert len(out.splitlines()) == 3


def test_rope_and_the_kv_write_match_torch():
    interpret("""
        K._use_triton = lambda x: True
        t, hq, hkv, d, eps = 5, 4, 2, 32, 1e-6
        y = torch.randn(1, t, (hq + 2 * hkv) * d, dtype=torch.float16)    # a fused q|k|v output
        q = y[..., :hq * d].view(1, t, hq, d)
        k = y[..., hq * d:(hq + hkv) * d].view(1, t, hkv, d)
        v = y[..., (hq + hkv) * d:].view(1, t, hkv, d)
        w = torch.rand(d, dtype=torch.float16) + 0.5
        ang = torch.rand(1, 1, t, d) * 6
        cos, sin = ang.cos().half(), ang.sin().half()

        def ref_rope(x):
            return K.rotate_half_rope(K.rms_norm_torch(x.double(), w.double(), eps).transpose(1, 2),
                                      cos.double(), sin.double())
        assert (K.rms_norm_rope(q, w, eps, cos, sin).double() - ref_rope(q)).abs().max() < 3e-3
        slots = torch.tensor([7, 3, 9, 0, 12])
        cache_k = torch.randn(1, hkv, 16, d, dtype=torch.float16)
        cache_v = torch.randn(1, hkv, 16, d, dtype=torch.float16)
        want_k, want_v = cache_k.double(), cache_v.clone()
        want_k[0][:, slots] = ref_rope(k)[0]
        want_v[0][:, slots] = v.transpose(1, 2)[0]
        assert K.rms_norm_rope_to_cache(k, v, w, eps, cos, sin, cache_k, cache_v, slots)
        assert (cache_k.double() - want_k).abs().max() < 3e-3      # written slots, and the others kept
        assert torch.equal(cache_v, want_v)
        assert not K.rms_norm_rope_to_cache(k.float(), v.float(), w, eps, cos, sin, cache_k, cache_v, slots)

        # a batched pass: row b's k/v go to cache row b at its own slots, through a view of the pool's
        # first rows (the last row and every other slot stay as they were), equal to RoPE + scatter
        b = 3
        y = torch.randn(b, t, (hq + 2 * hkv) * d, dtype=torch.float16)
        k = y[..., hq * d:(hq + hkv) * d].view(b, t, hkv, d)
        v = y[..., (hq + hkv) * d:].view(b, t, hkv, d)
        ang = torch.rand(b, 1, t, d) * 6
        cos, sin = ang.cos().half(), ang.sin().half()
        slots = torch.tensor([[7, 3, 9, 0, 12], [0, 1, 2, 3, 4], [11, 12, 13, 14, 15]])
        pool_k = torch.randn(2, b + 1, hkv, 16, d, dtype=torch.float16)     # [layers, pool rows, Hkv, capacity, D]
        pool_v = torch.randn(2, b + 1, hkv, 16, d, dtype=torch.float16)

        def check_batched_write(k, v, slots, pool_k, pool_v):
            # the write into layer 1 of the pool's first b rows equals RoPE + scatter; all else is kept
            want_k, want_v = pool_k.double(), pool_v.clone()
            rows, heads = torch.arange(b)[:, None, None], torch.arange(k.shape[2])[None, :, None]
            want_k[1, rows, heads, slots[:, None, :]] = ref_rope(k)
            want_v[1, rows, heads, slots[:, None, :]] = v.transpose(1, 2)
            assert K.rms_norm_rope_to_cache(k, v, w, eps, cos, sin, pool_k[1, :b], pool_v[1, :b], slots)
            assert (pool_k.double() - want_k).abs().max() < 3e-3
            assert torch.equal(pool_v, want_v)
            return want_v

        want_v = check_batched_write(k, v, slots, pool_k, pool_v)
        # all rows at the same slots ([T]), as index_copy_ writes them
        same = torch.tensor([2, 5, 6, 8, 1])
        want_v[1, :b][:, :, same] = v.transpose(1, 2)
        assert K.rms_norm_rope_to_cache(k, v, w, eps, cos, sin, pool_k[1, :b], pool_v[1, :b], same)
        assert torch.equal(pool_v, want_v)
        assert not K.rms_norm_rope_to_cache(k, v, w, eps, cos, sin, pool_k[1], pool_v[1], slots)  # 4 rows for 3

        # a batched AR step: one token a sequence, where torch's stride of the size-1 token dim is not the
        # batch's step; q's RoPE and the KV write still read each sequence's own token
        y = torch.randn(b, 1, (hq + 2 * hkv) * d, dtype=torch.float16)
        q = y[..., :hq * d].view(b, 1, hq, d)
        k = y[..., hq * d:(hq + hkv) * d].view(b, 1, hkv, d)
        v = y[..., (hq + hkv) * d:].view(b, 1, hkv, d)
        assert k.stride(1) != k.stride(0) and K._rows(k)
        ang = torch.rand(b, 1, 1, d) * 6
        cos, sin = ang.cos().half(), ang.sin().half()
        assert (K.rms_norm_rope(q, w, eps, cos, sin).double() - ref_rope(q)).abs().max() < 3e-3
        check_batched_write(k, v, torch.tensor([[4], [9], [0]]), pool_k, pool_v)

        # head counts that are no power of two (a program takes all of a token's heads, padded to 8)
        hq, hkv = 6, 3
        y = torch.randn(b, t, (hq + 2 * hkv) * d, dtype=torch.float16)
        q = y[..., :hq * d].view(b, t, hq, d)
        k = y[..., hq * d:(hq + hkv) * d].view(b, t, hkv, d)
        v = y[..., (hq + hkv) * d:].view(b, t, hkv, d)
        ang = torch.rand(b, 1, t, d) * 6
        cos, sin = ang.cos().half(), ang.sin().half()
        assert (K.rms_norm_rope(q, w, eps, cos, sin).double() - ref_rope(q)).abs().max() < 3e-3
        check_batched_write(k, v, slots, torch.randn(2, b + 1, hkv, 16, d, dtype=torch.float16),
                            torch.randn(2, b + 1, hkv, 16, d, dtype=torch.float16))
    """)


def test_silu_mul_matches_torch():
    interpret("""
        K._use_triton = lambda x: True
        x = torch.randn(3, 5, 2 * 1500) * 4           # n = 1500 spans two blocks of 1024, the second partial
        gate, up = x.double().chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
        out = K.silu_mul(x)
        assert out.shape == (3, 5, 1500)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6
    """)


def test_fp8_gemm_matches_its_blocks_and_scales_in_float64():
    """The kernel quantizes its activation tiles itself: in float32 it must give torch's codes exactly
    (the float64 sum of the same codes times their scales, to float32 rounding: a code off by one
    would show at about 1e-3), in float16 one rounding of the output. Both scale layouts (a
    checkpoint's 128-row blocks, and per-row scales after fusing rows not a multiple of 128), partial
    K blocks, near-zero activations (subnormal codes), the bias and the residual written in place."""
    interpret("""
        import ddtree_runtime.model.fp8 as F8
        F8._use_kernel = lambda x: True
        F8._device_limits = lambda device: (132, 232448)

        def ref(x, w, bias, residual):  # float64
            q, s = F8.quantize_groups(x)
            out = (q.double() * s.double().repeat_interleave(128, 1)[:, :x.shape[1]]) @ F8.dequantize(w).double().t()
            return out + (0 if bias is None else bias.double()) + (0 if residual is None else residual.double())

        for m, n, k, dtype, rows in [(1, 96, 200, torch.float16, 128), (5, 256, 384, torch.float32, 128),
                                     (40, 80, 128, torch.float16, 1), (3, 64, 64, torch.float32, 1)]:
            x = torch.randn(m, k).to(dtype) * 3
            x[0, :7] = 0.001
            q, s = F8.quantize_blocks(torch.randn(n, k) * 0.05)
            w = F8.BlockFP8(q, s if rows == 128 else s.repeat_interleave(128, 0)[:n], rows)
            bias, residual = torch.randn(n).to(dtype), torch.randn(m, n).to(dtype)
            for b, r in [(None, None), (bias, None), (None, residual)]:
                into = None if r is None else r.clone()
                out = F8.fp8_linear(x, w, b, into)
                want = ref(x, w, b, r)
                assert into is None or out.data_ptr() == into.data_ptr()
                err = ((out.double() - want).abs().max() / want.abs().max()).item()
                assert err < (1e-6 if dtype == torch.float32 else 1e-3), (m, n, k, dtype, rows, err)
    """)


def test_fp8_gemm_sums_k_in_fixed_groups_split_or_not_to_the_same_bits():
    """K summed in groups (fp8.k_group: from the weight's shape, never the row count): the same bits
    whether the groups run in one program or in programs of their own (a split launch, then
    _sum_parts_kernel), at either tile; within float32 rounding of the float64 reference."""
    interpret("""
        import ddtree_runtime.model.fp8 as F8
        from ddtree_devtools.interpreter import exact_dots
        exact_dots()   # numpy's matmul sums in an order that depends on the tile's shape and the CPU
        F8._device_limits = lambda device: (132, 232448)
        for m, n, k, rows, dtype in [(3, 80, 640, 128, torch.float32), (17, 96, 520, 1, torch.float16)]:
            x = torch.randn(m, k).to(dtype)
            q, s = F8.quantize_blocks(torch.randn(n, k) * 0.05)
            w = F8.BlockFP8(q, s if rows == 128 else s.repeat_interleave(128, 0)[:n], rows)
            bias, res = torch.randn(n).to(dtype), torch.randn(m, n).to(dtype)
            want = F8.fp8_linear_torch(x, w, bias, res).double()
            for group in (2, 5):
                outs = [F8.block_gemm(x, w, tile, bias, res.clone(), residual=True, group=group, split=split)
                        for tile in (F8.GemmTile(16, 32, 4, 2), F8.GemmTile(32, 64, 4, 2)) for split in (False, True)]
                assert all(torch.equal(o, outs[0]) for o in outs), (m, n, k, group)
                err = ((outs[0].double() - want).abs().max() / want.abs().max()).item()
                assert err < (1e-6 if dtype == torch.float32 else 1e-3), (m, n, k, group, err)
    """)


def test_fp8_weight_major_gemm_sums_as_the_row_major_kernel():
    """The weight-major variant (GemmTile.weights_left: out^T = W x^T, the W tile as the dot's left operand)
    keeps the kernel's arithmetic: the row-major kernel's bits, split or not, with the bias and the
    residual, both scale layouts and a partial last K block, as does a W tile wider than a block of
    scales (one scale product per output, not per token) and a launch reading its operands by tensor
    descriptors; within float32 rounding of the torch reference."""
    interpret("""
        import ddtree_runtime.model.fp8 as F8
        from ddtree_devtools.interpreter import exact_dots
        exact_dots()
        F8._device_limits = lambda device: (132, 232448)
        for m, n, k, rows, dtype, tile, residual in [
                (3, 80, 640, 128, torch.float32, F8.GemmTile(16, 64, 4, 2, True), False),
                (17, 96, 520, 1, torch.float16, F8.GemmTile(32, 128, 8, 2, True), True)]:
            x = torch.randn(m, k).to(dtype)
            q, s = F8.quantize_blocks(torch.randn(n, k) * 0.05)
            w = F8.BlockFP8(q, s if rows == 128 else s.repeat_interleave(128, 0)[:n], rows)
            bias, res = torch.randn(n).to(dtype), torch.randn(m, n).to(dtype) if residual else None
            def gemm(tile, split):
                return F8.block_gemm(x, w, tile, bias, res if res is None else res.clone(), residual, group=2,
                                     split=split)
            row_major = gemm(F8.GemmTile(16, 32, 4, 2), True)
            for split in (False, True):
                assert torch.equal(gemm(tile, split), row_major), (m, n, k, split)
            # a 256-row W tile spans two blocks of scales: each output's scale product, the same bits
            assert torch.equal(gemm(F8.GemmTile(16, 256, 4, 2), False), row_major), (m, n, k)
            if k % 16 == 0:   # operands by tensor descriptors (zeros past the matrices), either layout
                for by_tma in (tile._replace(tma=True), F8.GemmTile(64, 64, 4, 2, tma=True)):
                    assert torch.equal(gemm(by_tma, False), row_major), (m, n, k, by_tma)
            want = F8.fp8_linear_torch(x, w, bias, res).double()
            err = ((row_major.double() - want).abs().max() / want.abs().max()).item()
            assert err < (1e-6 if dtype == torch.float32 else 1e-3), (m, n, k, err)
    """)


def test_tail_and_padded_launches_keep_the_plain_launchs_bits():
    """GemmTile.tail: a row-major launch whose last tile of rows holds TAIL_ROWS or fewer runs that tile
    weight-major (TAIL_ROWS tokens): the plain launch's bits at 272 rows' worth of a tail (4 + 16 rows over
    64-row tiles), at 5 rows (the only tile is the tail), with the bias and the residual, by pointers and
    by tensor descriptors; a last tile of more than TAIL_ROWS rows, and a split launch, keep the plain tile.
    GemmTile.padded (x's codes padded to whole tiles of rows, zeros past M) gives the plain launch's bits,
    alone and with a tail, K in groups or in one."""
    interpret("""
        import ddtree_runtime.model.fp8 as F8
        from ddtree_devtools.interpreter import exact_dots
        exact_dots()
        F8._device_limits = lambda device: (4, 232448)
        w = F8.BlockFP8(*F8.quantize_blocks(torch.randn(96, 640) * 0.05), 128)
        bias = torch.randn(96, dtype=torch.float16)
        for m in (5, 80, 81, 100):
            x = torch.randn(m, 640, dtype=torch.float16)
            res = torch.randn(m, 96, dtype=torch.float16)
            for tile in (F8.GemmTile(64, 64, 4, 2), F8.GemmTile(64, 64, 4, 2, tma=True)):
                plain = F8.block_gemm(x, w, tile, bias, res.clone(), residual=True, group=2, split=False)
                for other in (tile._replace(tail=True), tile._replace(tail=True, padded=True)):
                    tailed = F8.block_gemm(x, w, other, bias, res.clone(), residual=True, group=2, split=False)
                    assert torch.equal(tailed, plain), (m, other)
        # padded alone, K in groups or in one, by pointers (where it changes nothing) and by tensor descriptors
        x = torch.randn(200, 640, dtype=torch.float16)
        for group in (2, 5):
            for tile in (F8.GemmTile(64, 32, 4, 2), F8.GemmTile(64, 32, 4, 2, tma=True)):
                plain = F8.block_gemm(x, w, tile, bias, group=group, split=False)
                assert torch.equal(F8.block_gemm(x, w, tile._replace(padded=True), bias, group=group, split=False),
                                   plain), (group, tile)
        # where it applies: the last tile's rows, the row-major form, no split
        launched = []
        class Spy:   # the kernel's launch: records whether it ran with TAIL
            def __getitem__(self, grid):
                return lambda *args, **kwargs: launched.append(kwargs["TAIL"])
        F8._block_gemm_kernel = Spy()
        x = torch.randn(100, 640, dtype=torch.float16)
        for m, tile, split, want in [(80, F8.GemmTile(64, 64, 4, 2, tail=True), False, True),
                                     (100, F8.GemmTile(64, 64, 4, 2, tail=True), False, False),
                                     (64, F8.GemmTile(64, 64, 4, 2, tail=True), False, False),
                                     (80, F8.GemmTile(64, 64, 4, 2, tail=True), True, False),
                                     (80, F8.GemmTile(64, 64, 4, 2), False, False)]:
            F8.block_gemm(x[:m], w, tile, group=2, split=split)
            assert launched[-1] is want, (m, tile, split)
    """)


def test_a_row_of_the_weight_major_gemm_has_its_bits_at_every_row_count_and_token_tile():
    """A row's result is the same alone and among 2, 17 or 40 rows, at token tiles (BLOCK_T) of 16, 32 and
    64 and weight tiles of 64 and 128, and through the Hopper tiles fp8_linear takes by row count. Through the interpreter this checks the indexing and the order of
    the sums; whether Hopper's wgmma also gives a token the same bits at every BLOCK_T is measured on the
    GPU by fp8_gemm_bench.py (--weight-major-only)."""
    interpret("""
        import ddtree_runtime.model.fp8 as F8
        from ddtree_devtools.interpreter import exact_dots
        exact_dots()
        F8._device_limits = lambda device: (132, 232448)
        x = torch.randn(40, 640, dtype=torch.float16)
        w = F8.BlockFP8(*F8.quantize_blocks(torch.randn(96, 640) * 0.05), 128)
        tiles = [F8.GemmTile(tokens, cols, 4, 2, True) for tokens, cols in ((16, 64), (32, 128), (64, 64))]
        full = F8.block_gemm(x, w, tiles[-1], group=2)
        for m in (1, 2, 17, 40):
            for tile in tiles:
                assert torch.equal(F8.block_gemm(x[:m], w, tile, group=2), full[:m]), (m, tile)
        # what --fp8-gemm triton runs on Hopper (hopper_tile: weight-major up to 32 rows, then row-major
        # 64x128, operands by tensor descriptors): the same bits across its changes of tile
        x = torch.randn(70, 640, dtype=torch.bfloat16)
        full = F8.wgmma_gemm(x, w)
        for m in (1, 17, 33, 70):
            assert torch.equal(F8.wgmma_gemm(x[:m], w), full[:m]), m
    """)


def test_fp8_models_through_the_gemm_kernel_match_the_torch_path(tiny_models, tiny_hybrid_models, tmp_path):
    """Both tiny FP8 targets, fused as the engine runs them (q/k/v with per-row scales, gate/up, the
    residual written in place by o_proj and down_proj), with every projection in the Triton kernel: at
    TILES' tiles, and with --fp8-gemm triton's Hopper tiles for the weights of whole blocks."""
    interpret(f"""
        import ddtree_runtime.model.fp8 as F8
        from ddtree_devtools.fp8_checkpoint import write_fp8_checkpoint
        from ddtree_runtime.model import load_target
        from ddtree_runtime.model.layers import fuse_projections
        F8._device_limits = lambda device: (132, 232448)
        for name, pair in (("qwen3", {str(tiny_models)!r}), ("hybrid", {str(tiny_hybrid_models)!r})):
            model = load_target(write_fp8_checkpoint(pair + "/target", {str(tmp_path)!r} + "/" + name))
            fuse_projections(model)
            ids = torch.tensor([[5, 17, 99, 300, 42, 7]])
            pos = torch.arange(6)[None]
            # --fp8-gemm triton: the weights of whole 128x128 blocks through Hopper's wgmma tiles (fp8_linear
            # by hopper_tile), the others through TILES
            hopper = set((0, *w.qweight.shape, w.scale_rows) for w in F8.fp8_weights(model)
                         if w.scale_rows == F8.BLOCK and w.qweight.shape[1] % F8.BLOCK == 0)
            assert hopper, name
            with torch.inference_mode():
                ref = model.logits(model(ids, pos)[0])
                F8._use_kernel = lambda x: True
                out = model.logits(model(ids, pos)[0])
                F8.WGMMA_SHAPES.update(hopper)
                by_wgmma = model.logits(model(ids, pos)[0])
                F8.WGMMA_SHAPES.clear()
                F8._use_kernel = lambda x: False
            for got in (out, by_wgmma):
                assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5, name
    """)


def test_tree_build_kernel_builds_the_torch_tree():
    interpret("""
        from ddtree_runtime.engine.tree import build_tree, build_tree_on_gpu
        g = torch.Generator().manual_seed(0)
        # (budget, depth, vocab): the engine's shape, a budget that is no power of two, a vocab too small
        # to fill the budget, a budget of one
        for budget, depth, vocab in [(16, 15, 300), (33, 7, 3), (7, 3, 2), (1, 15, 20)]:
            for _ in range(2):
                x = torch.randn(depth, vocab, generator=g) * 3
                assert torch.equal(build_tree_on_gpu(x, budget).nodes, build_tree(x, budget).nodes), budget
        x = torch.zeros(15, 4)
        x[:, 0] = 200.0                 # log-prob exactly 0: every path ties with its extensions
        assert build_tree_on_gpu(x, 5).nodes.tolist() == [[0] * 5, [0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]
    """)



def test_batched_tree_build_kernel_gives_each_draft_its_torch_tree():
    """A batched round's drafts of one budget: one launch, a program per draft, each over its own
    logits (different per draft, so a program reading another's rows would build the wrong tree)."""
    interpret("""
        from ddtree_runtime.engine.tree import build_tree, build_trees, scored_trees, scored_trees_on_gpu
        g = torch.Generator().manual_seed(1)
        # (drafts, budget, depth, vocab): the engine's shape, a budget that is no power of two, a vocab too
        # small to fill the budget, a budget of one, a vocab over several top-K tiles
        for rows, budget, depth, vocab in [(3, 16, 15, 300), (3, 33, 7, 3), (4, 7, 3, 2), (3, 1, 15, 20),
                                           (2, 24, 9, 1187)]:
            x = torch.randn(rows, depth, vocab, generator=g) * 3
            nodes, scores = scored_trees_on_gpu(x, budget)
            want_nodes, want_scores = scored_trees(x, budget)
            assert torch.equal(nodes, want_nodes), (rows, budget)
            # the levels' scores the forecast reads: as torch's, the -inf of short levels included
            assert torch.allclose(scores, want_scores, atol=1e-5), (rows, budget)
            for row in range(rows):
                assert torch.equal(nodes[row], build_tree(x[row], budget).nodes), (rows, budget, row)
        x = torch.randn(3, 15, 4, generator=g) * 3
        x[1] = 0.0
        x[1, :, 0] = 200.0              # log-prob exactly 0: every path ties with its extensions
        nodes = scored_trees_on_gpu(x, 5)[0]
        assert nodes[1].tolist() == [[0] * 5, [0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]
        assert torch.equal(nodes, build_trees(x, 5))
    """)


def test_top_log_probs_kernel_is_the_log_softmax_top_k():
    """tree.top_tokens' CUDA form (the tile pass, then a tournament per row): a vocabulary not a multiple
    of the tile, one smaller than a tile, K = 1, 16, 33 and K = V, one draft [D, V] and a batched round's
    [R, D, V] (different data per row: a program reading another row's logits would fail), logits at
    50x (a plain exp overflows), depth capped by the budget (rows strided in the drafts' tensor)."""
    interpret("""
        from ddtree_runtime.engine.tree import top_tokens, tree_size
        g = torch.Generator().manual_seed(2)
        # (leading dims, depth, vocab, budget, scale)
        for lead, depth, vocab, budget, scale in [((), 15, 300, 16, 3), ((2,), 15, 4999, 33, 3),
                                                  ((3,), 15, 2500, 1, 3), ((2,), 5, 12, 16, 3),
                                                  ((2,), 15, 2100, 16, 50), ((2,), 15, 97, 8, 3)]:
            x = torch.randn(*lead, depth, vocab, generator=g) * scale
            lp, ids, n = top_tokens(x, budget, chunked=True)
            want_lp, want_ids, want_n = top_tokens(x, budget, chunked=False)
            k = min(budget, vocab)
            assert lp.shape == ids.shape == (*lead, min(depth, budget), k), (vocab, lp.shape)
            assert lp.dtype == torch.float32 and ids.dtype == torch.int64
            assert (lp - want_lp).abs().max() < 1e-5, (vocab, budget, (lp - want_lp).abs().max())
            assert torch.equal(ids, want_ids), (vocab, budget)
            assert n == want_n == tree_size(budget, min(depth, budget), vocab) - 1
            print(vocab, budget)
    """)


def test_top_log_probs_kernel_breaks_ties_by_the_lower_token():
    """Equal logits (bf16 logits tie often): the same values as torch's top-K, each id's log-prob, and
    among equal values the lower token first; a constant row gives tokens 0..K-1."""
    interpret("""
        from ddtree_runtime.engine.tree import top_tokens
        g = torch.Generator().manual_seed(3)
        x = (torch.randn(2, 6, 3000, generator=g) * 3).bfloat16()
        x[1, 2] = 1.5
        lp, ids, _ = top_tokens(x, 16, chunked=True)
        exact = torch.log_softmax(x.float(), dim=-1)
        assert (lp - exact.topk(16, dim=-1).values).abs().max() < 1e-5
        assert (exact.gather(-1, ids) - lp).abs().max() < 1e-5
        same = lp[..., 1:] == lp[..., :-1]
        assert same.any() and (ids[..., 1:] > ids[..., :-1])[same].all()
        assert ids[1, 2].tolist() == list(range(16))
    """)


def test_batched_tree_build_over_the_kernels_top_k_is_the_torch_build():
    """build_trees with the Triton top-K (as on CUDA) builds the same trees as with torch's."""
    interpret("""
        from ddtree_runtime.engine.tree import build_trees
        g = torch.Generator().manual_seed(4)
        for rows, budget, depth, vocab in [(2, 16, 15, 300), (3, 7, 3, 2)]:
            x = torch.randn(rows, depth, vocab, generator=g) * 3
            assert torch.equal(build_trees(x, budget, chunked=True), build_trees(x, budget)), budget
    """)


def test_fused_gated_deltanet_tree_pass_matches_torch():
    interpret("""
        from ddtree_runtime.engine.kv_cache import target_cache
        from ddtree_runtime.engine.tree import ancestor_mask
        from ddtree_runtime.model import Qwen35Config
        from ddtree_runtime.model.layers import TreeInputs, fuse_projections
        from ddtree_runtime.model.qwen3_5 import Qwen35ForCausalLM

        cfg = Qwen35Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
                           linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=4)
        model = Qwen35ForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.uniform_(-1, 1)
        fuse_projections(model)  # the in-projections' output is then a strided view, as in service
        parents = [0, 0, 0, 1, 1, 2, 3, 3, 6, 8, 5, 9]
        depths = [0]
        for p in parents[1:]:
            depths.append(depths[p] + 1)
        layer = model.model.layers[1].linear_attn
        x = torch.randn(1, 12, 32)

        def tree_pass(fused):
            G._use_triton = lambda t: fused
            cache = target_cache(cfg, 64, "cpu", torch.float32, nodes=17)
            g = torch.Generator().manual_seed(5)
            cache.conv.copy_(torch.randn(cache.conv.shape, generator=g))
            cache.state.copy_(torch.randn(cache.state.shape, generator=g))
            mask = ancestor_mask(torch.tensor(parents), 6)
            inputs = model.prepare(TreeInputs(torch.arange(12) + 10, None, 64, mask),
                                   torch.tensor([depths]) + 10)
            with torch.no_grad():
                return layer(x, cache, 10, inputs), cache

        (a, ca), (b, cb) = tree_pass(False), tree_pass(True)
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
        for name in ("k", "u", "g"):
            assert torch.allclose(getattr(ca.step, name), getattr(cb.step, name), atol=1e-5), name
        assert torch.equal(ca.inputs, cb.inputs)   # the kernels' own writes into the scratch
    """)


def test_fused_gated_deltanet_batched_tree_pass_matches_torch():
    """A batched round's linear layer: three sequences, each its own tree, conv tail and state."""
    interpret("""
        from ddtree_runtime.engine.kv_cache import target_cache
        from ddtree_runtime.engine.tree import ancestor_mask
        from ddtree_runtime.model import Qwen35Config
        from ddtree_runtime.model.layers import TreeInputs, fuse_projections
        from ddtree_runtime.model.qwen3_5 import Qwen35ForCausalLM

        cfg = Qwen35Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
                           linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=4)
        model = Qwen35ForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.uniform_(-1, 1)
        fuse_projections(model)
        trees = [[0, 0, 0, 1, 1, 2, 3, 3, 6, 8, 5, 9], list(range(-1, 11)), [0] * 12]   # a tree, a chain, a star
        trees[1][0] = 0
        parents = torch.tensor(trees)
        depths = torch.zeros(3, 12, dtype=torch.long)
        for i in range(1, 12):
            depths[:, i] = depths.gather(1, parents[:, i:i + 1])[:, 0] + 1
        starts = torch.tensor([10, 20, 5])
        layer = model.model.layers[1].linear_attn
        x = torch.randn(3, 12, 32)

        def tree_pass(fused):
            G._use_triton = lambda t: fused
            cache = target_cache(cfg, 64, "cpu", torch.float32, batch=3, nodes=17)
            g = torch.Generator().manual_seed(5)
            cache.conv.copy_(torch.randn(cache.conv.shape, generator=g))
            cache.state.copy_(torch.randn(cache.state.shape, generator=g))
            mask = ancestor_mask(parents, 11)
            slots = starts[:, None] + torch.arange(12)
            inputs = model.prepare(TreeInputs(slots, None, 64, mask), starts[:, None] + depths)
            with torch.no_grad():
                return layer(x, cache, 0, inputs), cache

        (a, ca), (b, cb) = tree_pass(False), tree_pass(True)
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
        for name in ("k", "u", "g"):
            assert torch.allclose(getattr(ca.step, name), getattr(cb.step, name), atol=1e-5), name
        assert torch.equal(ca.inputs, cb.inputs)   # the kernels' own writes into the scratch
    """)


def test_conv_heads_launches_match_torch_and_each_other():
    """gdn_kernels.conv_heads at every launch form (a program per key head or per value head, one node or
    a block of them, the last block past the tree, other warps) against the torch conv, split and
    normalisation, and bit for bit against each other: one tree for all rows ([T, K] windows) or one a
    row ([B, T, K]), a 16-bit projection's strided columns as mixed, groups of 2 and 3 value heads a key
    head; and as the layer calls it, k and the inputs written into a scratch (rows and heads strided)
    whose nodes past T stay untouched."""
    out = interpret("""
        from ddtree_runtime.engine.tree import ancestor_mask
        from ddtree_runtime.model.gated_delta import causal_conv, tree_paths

        launches = [G.ConvHeadsLaunch(), G.ConvHeadsLaunch(per_key=False), G.ConvHeadsLaunch(nodes=2),
                    G.ConvHeadsLaunch(nodes=4, warps=2), G.ConvHeadsLaunch(per_key=False, nodes=3, warps=8)]
        for n_k, n_v, dk, dv, t, shared in [(2, 6, 16, 32, 7, True), (2, 4, 32, 16, 5, False)]:
            b, kernel = 3, 4
            c = 2 * n_k * dk + n_v * dv
            gen = torch.Generator().manual_seed(t)
            parents = torch.randint(0, t, (b, t), generator=gen) % (torch.arange(t) + 1)   # each before its node
            parents[:, 0] = 0
            depth = torch.zeros(b, t, dtype=torch.long)
            for i in range(1, t):
                depth[:, i] = depth.gather(1, parents[:, i:i + 1])[:, 0] + 1
            mask = ancestor_mask(parents, t)
            window = tree_paths(mask[0], depth[0], kernel).window if shared else tree_paths(mask, depth, kernel).window
            projected = torch.randn(b, t, c + 40, generator=gen).bfloat16()
            mixed = projected[..., 8:8 + c]                                # rows and nodes strided
            state = torch.randn(b, kernel - 1, c, generator=gen).bfloat16()
            weight = (torch.randn(c, kernel, generator=gen) * 0.5).bfloat16()

            conv = causal_conv(mixed.float(), state.float(), weight.float(), window)
            qc, kc, vc = conv.split([n_k * dk, n_k * dk, n_v * dv], dim=-1)
            heads = lambda x, n, d: x.reshape(b, t, n, d).transpose(1, 2).repeat_interleave(n_v // n, 1)
            norm = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
            want = (norm(heads(qc, n_k, dk)) * dk ** -0.5, norm(heads(kc, n_k, dk)), heads(vc, n_v, dv))

            first = G.conv_heads(mixed, state, weight, window, n_k, n_v, dk, dv, launch=launches[0])
            for got, ref, name in zip(first, want, "qkv"):
                assert got.shape == ref.shape and got.is_contiguous(), name
                err = (got - ref).abs().max().item()
                assert err < 1e-5, (name, err)
            for launch in launches[1:]:
                for got, ref, name in zip(G.conv_heads(mixed, state, weight, window, n_k, n_v, dk, dv, launch=launch),
                                          first, "qkv"):
                    assert torch.equal(got, ref), (launch, name)
                # as the layer calls it: k into the scratch's [B, Hv, nodes, dk] (17 nodes), mixed copied
                k_scratch = torch.full((2, b + 1, n_v, 17, dk), 7.0)[1, :b]
                inputs = torch.full((b + 1, 17, c), 7.0).bfloat16()[:b]
                q, k, v = G.conv_heads(mixed, state, weight, window, n_k, n_v, dk, dv, k=k_scratch[:, :, :t],
                                       keep=inputs[:, :t], launch=launch)
                assert torch.equal(q, first[0]) and torch.equal(v, first[2]), launch
                assert torch.equal(k_scratch[:, :, :t], first[1]) and torch.equal(inputs[:, :t], mixed), launch
                assert (k_scratch[:, :, t:] == 7).all() and (inputs[:, t:] == 7).all(), launch
            print(n_k, n_v, t)
    """)
    assert len(out.splitlines()) == 2


def test_tree_delta_kernel_matches_the_torch_gated_delta():
    """The one-launch tree verify against gated_delta in torch, float32: random trees (one shared, or
    one per sequence: a tree, a chain, a star among them) of 1, 5, 17 and 33 nodes, several sequences,
    strided inputs as the layer gives them (beta, g: transposed views; the state: rows of a pool), with
    and without a start state, dv split over several programs, and near-equal keys with beta near 1
    (the solve's far terms, a whole chain long, then count), by substitution and by squaring; the gates
    made in the kernel from 16-bit in-projection columns, u and G written into the cache's scratch."""
    interpret("""
        from ddtree_runtime.engine.tree import ancestor_mask
        from ddtree_runtime.model.gated_delta import Paths, Step, gated_delta, gated_delta_torch

        def random_parents(b, t, gen):
            parents = torch.zeros(b, t, dtype=torch.long)
            for i in range(1, t):
                parents[:, i] = torch.randint(0, i, (b,), generator=gen)
            if b > 2 and t > 2:
                parents[1] = torch.arange(-1, t - 1).clamp(min=0)   # a chain
                parents[2] = 0                                        # a star
            return parents

        def case(b, h, t, dk, dv, shared, with_state, launch, aligned=False):
            gen = torch.Generator().manual_seed(b * 100 + t)
            parents = random_parents(1 if shared else b, t, gen)
            mask = ancestor_mask(parents, t)
            paths = Paths(mask[0] if shared else mask[:, None], torch.zeros(0))
            q = torch.nn.functional.normalize(torch.randn(b, h, t, dk, generator=gen), dim=-1) * dk ** -0.5
            k = torch.randn(b, h, t, dk, generator=gen) * (0.05 if aligned else 1.0)
            k = torch.nn.functional.normalize(k + (1.0 if aligned else 0.0), dim=-1)
            v = torch.randn(b, h, t, dv, generator=gen)
            g = -torch.rand(b, t, h, generator=gen).transpose(1, 2) * (0.01 if aligned else 0.5)  # strided views
            beta = (torch.rand(b, t, h, generator=gen) * 0.5 + (0.5 if aligned else 0.0)).transpose(1, 2)
            pool = torch.randn(b + 2, h, dk, dv, generator=gen)
            state = pool[1:b + 1] if with_state else None
            # the reference in float64; the kernel within a few times torch's own float32 error
            exact = Paths(paths.mask, paths.window)
            exact.summing = exact.summing.double()
            want, step = gated_delta_torch(*(x.double() for x in (q, k, v, g, beta)),
                                           None if state is None else state.double(), exact)
            torch32 = gated_delta_torch(q, k, v, g, beta, state, paths)[0]
            out, u, pathsum = G.tree_delta(q, k, v, g, beta, state, paths.mask, launch)
            scale = want.abs().max()
            err, err32 = (((x - want).abs().max() / scale).item() for x in (out, torch32))
            assert err < max(1e-5, 4 * err32), (b, t, err, err32)
            assert ((u - step.u).abs().max() / step.u.abs().max()).item() < max(1e-5, 4 * err32)
            assert torch.allclose(pathsum.double(), step.g, atol=1e-6)
            assert not out.isnan().any()
            print(b, t, err, err32)

        # dk and dv in two blocks each, by substitution (16: a dot's smallest side the compiler takes)
        small = G.TreeDeltaLaunch(16, 16, 1, squaring=False)
        for b, t, shared in [(1, 1, True), (2, 5, False), (3, 17, False), (1, 17, True), (3, 33, False)]:
            case(b, 4, t, 32, 32, shared, True, small)
        case(3, 2, 17, 16, 32, False, False, G.TreeDeltaLaunch(64, 64, 4, squaring=False))  # no start state, one dv block
        case(2, 2, 5, 32, 16, False, True, G.TreeDeltaLaunch(16, 16, 4))
        case(3, 2, 17, 32, 32, False, True, small, aligned=True)
        # the squaring solve: the same within its wider error where keys align
        case(3, 4, 17, 32, 32, False, True, small._replace(squaring=True))
        case(3, 2, 33, 16, 16, False, True, G.TreeDeltaLaunch())          # the default: squaring, blocks wider than dk
        # the root taken apart (17 nodes in blocks of 16, 33 in 32): trees, a chain, a star, no start
        # state, one shared tree, both solves, aligned keys by substitution (as above: the squaring's
        # error grows there); 5 nodes gain nothing and keep the blocks
        for squaring in (False, True):
            peeled = small._replace(squaring=squaring, peel=True)
            case(3, 2, 17, 32, 32, False, True, peeled)
            case(3, 2, 33, 16, 16, False, True, peeled)
            case(1, 2, 17, 32, 16, True, False, peeled)
        case(3, 2, 17, 32, 32, False, True, small._replace(peel=True), aligned=True)
        case(2, 2, 5, 32, 16, False, True, small._replace(peel=True))
        for rows in (1, G.TREE_DELTA_MANY_ROWS):   # the served launches
            case(3, 2, 17, 32, 32, False, True, G.tree_delta_launch(rows))
        # the output's products at another precision than u's (the interpreter computes both in float32)
        case(2, 2, 17, 32, 32, False, True, small._replace(squaring=True, output_precision="tf32"))

        # the gates made in the kernel from the in-projection's 16-bit columns, as the layer makes them in
        # torch (float16 here: the interpreter truncates casts to bfloat16 where the GPU rounds, like
        # torch), and u / G written into strided views of a larger scratch (the rest untouched): a 5-node
        # tree, and 17 nodes through each served launch
        def gates_case(parents, launch=None):
            (b, t), h, d = parents.shape, 4, 16
            gen = torch.Generator().manual_seed(7)
            projected = (torch.randn(b, t, 3 * h, generator=gen) * 3).half()   # [.. | b | a] columns
            b_in, a_in = projected[..., h:2 * h], projected[..., 2 * h:]
            a_log, dt_bias = torch.rand(h, generator=gen).half(), torch.randn(h, generator=gen).half()
            beta = torch.sigmoid(b_in).float().transpose(1, 2)
            g = (-a_log.float().exp() * torch.nn.functional.softplus(a_in.float() + dt_bias.float())).transpose(1, 2)
            q, k = (torch.nn.functional.normalize(torch.randn(b, h, t, d, generator=gen), dim=-1) for _ in range(2))
            v, state = torch.randn(b, h, t, d, generator=gen), torch.randn(b, h, d, d, generator=gen)
            paths = Paths(ancestor_mask(parents, t)[:, None], torch.zeros(0))
            want, step = gated_delta_torch(q, k, v, g, beta, state, paths)
            scratch_u, scratch_g = torch.zeros(b, h, t + 4, d), torch.zeros(b, h, t + 4)
            out, u, pathsum = G.tree_delta(q, k, v, None, None, state, paths.mask, launch,
                                           gates=G.Gates(b_in, a_in, a_log, dt_bias),
                                           u=scratch_u[:, :, :t], pathsum=scratch_g[:, :, :t])
            assert torch.allclose(out, want, atol=1e-5) and torch.allclose(scratch_u[:, :, :t], step.u, atol=1e-5)
            assert torch.allclose(scratch_g[:, :, :t], step.g, rtol=1e-5)
            assert not scratch_u[:, :, t:].any() and not scratch_g[:, :, t:].any()

        gates_case(torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 2, 3]]))
        for rows in (1, G.TREE_DELTA_MANY_ROWS):   # 17 nodes: the served launches take the root apart
            gates_case(random_parents(2, 17, torch.Generator().manual_seed(rows)), G.tree_delta_launch(rows))

        # gated_delta dispatches to the kernel where it fits, with the same Step
        G._use_triton = lambda x: True
        q, k = (torch.nn.functional.normalize(torch.randn(2, 2, 5, 16), dim=-1) for _ in range(2))
        v, g, beta = torch.randn(2, 2, 5, 16), -torch.rand(2, 2, 5), torch.rand(2, 2, 5)
        paths = Paths(ancestor_mask(torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 2, 3]]), 5)[:, None], torch.zeros(0))
        state = torch.randn(2, 2, 16, 16)
        assert G.tree_delta_fits(q, v)
        (a, sa), (c, sc) = gated_delta(q, k, v, g, beta, state, paths), gated_delta_torch(q, k, v, g, beta, state, paths)
        assert torch.allclose(a, c, atol=1e-5) and torch.allclose(sa.u, sc.u, atol=1e-5) and sa.k is k
        assert not G.tree_delta_fits(torch.randn(1, 2, 65, 16), v)      # past the kernel's largest tree
    """)


def test_batched_tree_pass_through_the_kernels_matches_torch():
    """A batched round of a Qwen3 target end to end with every kernel (the fused KV write into each row's
    cache row, the split-KV attention with per-row lengths) against the torch path: the same logits and
    the same cache, other pool rows untouched."""
    interpret("""
        from ddtree_runtime.engine.runner import TargetRunner
        from ddtree_runtime.engine.kv_cache import KVCache
        from ddtree_runtime.engine.tree import Tree
        from ddtree_runtime.model import Qwen3Config, Qwen3ForCausalLM
        from ddtree_runtime.model.layers import fuse_projections

        cfg = Qwen3Config(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        model = Qwen3ForCausalLM(cfg).eval().half()
        fuse_projections(model)
        trees = [Tree(torch.tensor([[5, 6, 7, 8], [0, 1, 1, 0], [1, 2, 2, 1]])), None,
                 Tree(torch.tensor([[9, 10], [0, 1], [1, 2]]))]
        # k, v: [layers, pool rows, Hkv, capacity, D]; three requests run as a batch of 4 (row 3 a pad row)
        start = torch.randn(2, 2, 6, 2, 1024, 32).half()

        def batched_round(fused):
            K._use_triton = lambda x: fused
            cache = KVCache(2, 2, 32, 1024, "cpu", torch.float16, batch=6)
            cache.k.copy_(start[0])
            cache.v.copy_(start[1])
            runner = TargetRunner(model, cache, torch.device("cpu"), max_depth=4)
            with torch.no_grad():
                out = runner.run([3, 4, 1], [40, 7, 300], trees)
            return out.logits.clone(), cache

        (a, ca), (b, cb) = batched_round(False), batched_round(True)
        assert (a - b).abs().max() < 2e-2, (a - b).abs().max()
        assert (ca.k.float() - cb.k.float()).abs().max() < 1e-2
        assert torch.equal(ca.v[0], cb.v[0])       # layer 0's v is copied as is (later layers' inputs differ)
        assert (ca.v.float() - cb.v.float()).abs().max() < 1e-2
        assert torch.equal(cb.k[:, 4:], start[0, :, 4:]) and torch.equal(cb.v[:, 4:], start[1, :, 4:])
    """)


def test_state_advance_kernel_matches_torch_advance_along():
    """The commit's one-pass state advance against the torch advance_along: rows of every length (1: an
    AR step, the full P, in between), tree paths out of node order with garbage past each length,
    several layers, per-row data (a cross-row read shows), a state that is the first rows of a pool
    (the rows past the batch untouched), the path's nodes and lengths as strided views of the walk's
    result, and the single-stream form (one path for every row, expanded)."""
    interpret("""
        from ddtree_runtime.model.gated_delta import Step, advance_along, advance_along_torch, state_at

        def case(n, b, pool, h, t, dk, dv, paths, launch=G.AdvanceLaunch()):
            gen = torch.Generator().manual_seed(n * 100 + b)
            k = torch.randn(n, pool, h, t, dk, generator=gen)
            u = torch.randn(n, pool, h, t, dv, generator=gen)
            g = -torch.rand(n, pool, h, t, generator=gen).cumsum(-1) * 0.3
            state = torch.randn(n, pool, h, dk, dv, generator=gen)
            p = max(len(path) for path in paths)
            # the walk's result: [B, 2 + P] (length, bonus, nodes...), garbage nodes past each length
            result = torch.randint(0, t, (b, 2 + p), generator=gen)
            for row, path in enumerate(paths):
                result[row, 0] = len(path)
                result[row, 2:2 + len(path)] = torch.tensor(path)
            nodes, length = result[:, 2:], result[:, 0]
            step = Step(k[:, :b], u[:, :b], g[:, :b])
            expected = state.clone()
            advance_along_torch(step, expected[:, :b], nodes, length)
            got = state.clone()
            G.advance_state(step.k, step.u, step.g, got[:, :b], nodes, length, launch)
            err = ((got - expected).abs().max() / expected.abs().max()).item()   # float32 rounding only
            assert err < 1e-6, (n, b, paths, err)
            assert torch.equal(got[:, b:], state[:, b:])
            for row, path in enumerate(paths):  # and torch agrees with each row's state_at
                alone = Step(k[:, row], u[:, row], g[:, row])
                assert torch.allclose(got[:, row], state_at(alone, state[:, row], torch.tensor(path)), atol=1e-5)
            print(n, b, err)

        case(1, 1, 1, 2, 5, 16, 16, [[0]])                                       # an AR step alone
        case(2, 3, 5, 2, 9, 16, 32, [[0, 2, 5], [0], [0, 1, 3, 4, 8]])         # tree paths, pool rows 3, 4 kept
        case(3, 4, 4, 3, 8, 32, 16, [[0, 3, 7, 6], [0, 1], [0], [0, 5, 2, 4]])  # out of order, 3 layers
        # tiles smaller than the head (several programs per head) and dims that are not powers of two
        case(2, 2, 3, 2, 6, 24, 20, [[0, 1, 4], [0, 2]], G.AdvanceLaunch(8, 16, 1))

        # the single-stream commit: one path for every row, expanded (stride-0 rows), via advance_along
        G._use_triton = lambda x: True
        n, b, h, t, dk, dv = 2, 2, 2, 6, 16, 16
        step = Step(torch.randn(n, b, h, t, dk), torch.randn(n, b, h, t, dv), -torch.rand(n, b, h, t).cumsum(-1))
        state = torch.randn(n, b, h, dk, dv)
        path = torch.tensor([0, 2, 3])
        expected = state.clone()
        advance_along_torch(step, expected, path.expand(b, -1), torch.full((b,), 3))
        advance_along(step, state, path.expand(b, -1), torch.full((b,), 3))
        assert torch.allclose(state, expected, rtol=1e-5, atol=1e-6)
    """)


def test_conv_tail_kernel_matches_the_torch_commit():
    """The commit's conv tail in one launch against the torch path, bit for bit (it only moves values):
    paths shorter than the tail (1, 2: part of the old tail stays, shifted), as long and longer, several
    layers, the first rows of a pool (the rows past the batch untouched), the tree pass's inputs a strided
    scratch, the nodes and lengths strided views of the walk's result, channels over one program's block
    and not a power of two; and conv_tail_along taking it."""
    interpret("""
        from ddtree_runtime.model.gated_delta import conv_tail_along, conv_tail_torch

        def case(n, b, pool, k1, t, c, paths):
            gen = torch.Generator().manual_seed(n * 10 + b)
            conv = torch.randn(n, pool, k1, c, generator=gen).bfloat16()
            scratch = torch.randn(n, pool, t + 2, c + 8, generator=gen).bfloat16()
            inputs = scratch[:, :b, :t, 4:4 + c]                          # rows, nodes and channels strided
            p = max(len(path) for path in paths)
            result = torch.randint(0, t, (b, 2 + p), generator=gen)       # garbage past each length
            for row, path in enumerate(paths):
                result[row, 0] = len(path)
                result[row, 2:2 + len(path)] = torch.tensor(path)
            nodes, length = result[:, 2:], result[:, 0]
            expected, got = conv.clone(), conv.clone()
            conv_tail_torch(expected[:, :b], inputs, nodes, length)
            G.conv_tail(got[:, :b], inputs, nodes, length)
            assert torch.equal(got, expected), (n, b, paths)
            for row, path in enumerate(paths):                            # the tail is [old | path]'s last k1
                whole = torch.cat([conv[:, row], inputs[:, row, torch.tensor(path)]], dim=1)
                assert torch.equal(got[:, row], whole[:, -k1:])
            print(n, b, k1, c, "ok")

        case(1, 1, 1, 3, 4, 40, [[0]])                                       # an AR step: one shift
        case(2, 3, 5, 3, 9, 1100, [[0, 4], [0, 2, 5], [0, 1, 3, 4, 8]])      # 2, 3 and 5 long; two blocks
        case(3, 2, 2, 2, 6, 24, [[0, 5, 1], [0]])                            # a kernel of 3: a tail of 2
        G._use_triton = lambda x: True
        conv = torch.randn(2, 2, 3, 16)
        inputs = torch.randn(2, 2, 5, 16)
        nodes, length = torch.tensor([[0, 3, 4], [0, 1, 2]]), torch.tensor([3, 1])
        expected = conv.clone()
        conv_tail_torch(expected, inputs, nodes, length)
        conv_tail_along(conv, inputs, nodes, length)
        assert torch.equal(conv, expected)
    """)


def test_paged_decode_attention_reads_keys_through_the_block_table():
    """The split-KV kernel over a paged pool: each sequence's keys scattered over shuffled pages (page 0
    the scratch page, holding garbage), read through its block table, equal to the same kernel over
    the same keys laid out contiguously, for tree queries and single queries with per-row lengths,
    over several splits and in one."""
    out = interpret("""
        K._use_triton = lambda x: True
        hq, hkv, d, page, bucket, b = 4, 2, 32, 16, 96, 3
        width = bucket // page
        contiguous = torch.randn(2, b, hkv, bucket, d, dtype=torch.float16)
        order = torch.randperm(b * width) + 1                      # physical pages 1.., shuffled
        table = order.view(b, width)
        pool = torch.randn(2, 1, hkv, (b * width + 1) * page, d, dtype=torch.float16)   # page 0: garbage
        for row in range(b):
            for p in range(width):
                slot = table[row, p].item() * page
                pool[:, 0, :, slot:slot + page] = contiguous[:, row, :, p * page:(p + 1) * page]
        lengths = torch.tensor([40, 96, 17])
        for t in (17, 1):
            q = torch.randn(b, hq, t, d, dtype=torch.float16)
            allowed = (torch.rand(b, t, bucket) < 0.7) & (lengths[:, None, None] > torch.arange(bucket))
            allowed[..., 0] = True
            bias = torch.where(allowed, 0.0, float("-inf")).to(torch.float16)[:, None]
            assert K.decode_attention_fits(q, pool[0], lengths)
            for launch in (K.DecodeLaunch(16, 32, 4), K.DecodeLaunch(64, 1024, 4)):
                want = K.decode_attention(q, contiguous[0], contiguous[1], bias, lengths, launch=launch)
                got = K.decode_attention(q, pool[0], pool[1], bias, lengths, launch=launch, table=table,
                                         page_size=page, length=bucket)
                assert torch.equal(got, want), (t, launch)
            print(t)
    """)
    assert len(out.splitlines()) == 2


def test_eager_decode_launch_serves_a_prefill_groups_rows_of_any_width():
    """The fixed launch of passes not graphed (a prefill group: rows of different prompt lengths padded
    to the widest, causal within each row, keys to a bucket of 64 over a paged pool): equal to grouped
    attention in float64 for group widths that are not powers of two, one query included."""
    out = interpret("""
        K._use_triton = lambda x: True
        hq, hkv, d, page, b = 4, 2, 32, 16, 3
        for width, starts in ((5, [0, 3, 40]), (1, [7, 0, 20]), (23, [0, 0, 30])):
            bucket = -(-(max(starts) + width) // 64) * 64
            table = (torch.randperm(b * bucket // page) + 1).view(b, -1)
            pool = torch.randn(2, 1, hkv, (b * bucket // page + 1) * page, d, dtype=torch.float16)
            pos = torch.tensor(starts)[:, None] + torch.arange(width)                     # [b, W]
            causal = torch.arange(bucket)[None, None, :] <= pos[..., None]               # [b, W, L]
            bias = torch.where(causal, 0.0, float("-inf")).to(torch.float16)[:, None]
            q = torch.randn(b, hq, width, d, dtype=torch.float16)
            slots = (table[:, :, None] * page + torch.arange(page)).view(b, -1)          # [b, L] physical
            keys, values = pool[0, 0][:, slots].transpose(0, 1), pool[1, 0][:, slots].transpose(0, 1)
            got = K.decode_attention(q, pool[0], pool[1], bias, launch=K.DECODE_EAGER, table=table,
                                     page_size=page, length=bucket)
            torch.testing.assert_close(got.double(), ref(q, keys, values, bias), rtol=2e-3, atol=2e-3)
            print(width)
    """)
    assert len(out.splitlines()) == 3


def test_batched_tree_pass_over_a_paged_pool_through_the_kernels_matches_torch():
    """A batched round of a Qwen3 target over a paged pool (rows of shuffled pages, one row a pad row
    on the scratch page only) with every kernel (the fused RoPE + KV write at physical slots, the paged
    split-KV attention) against the torch path over the same pool and against a contiguous cache: the
    same logits, and each row's positions hold the same KV."""
    interpret("""
        from ddtree_runtime.engine.runner import TargetRunner
        from ddtree_runtime.engine.block_manager import BlockManager, PageTable
        from ddtree_runtime.engine.kv_cache import KVCache
        from ddtree_runtime.engine.tree import Tree
        from ddtree_runtime.model import Qwen3Config, Qwen3ForCausalLM
        from ddtree_runtime.model.layers import fuse_projections

        cfg = Qwen3Config(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        model = Qwen3ForCausalLM(cfg).eval().half()
        fuse_projections(model)
        trees = [Tree(torch.tensor([[5, 6, 7, 8], [0, 1, 1, 0], [1, 2, 2, 1]])), None,
                 Tree(torch.tensor([[9, 10], [0, 1], [1, 2]]))]
        starts, page, capacity = [40, 7, 300], 16, 1024
        context = torch.randn(2, 2, 4, 2, capacity, 32).half()     # k/v, layers, rows, Hkv, positions, D

        def paged_round(fused):
            K._use_triton = lambda x: fused
            manager = BlockManager(80, page)
            table = PageTable(manager, 4, capacity // page, torch.device("cpu"))
            manager.free = type(manager.free)(torch.randperm(80).add(1).tolist())  # scattered pages
            for row, start in enumerate(starts):
                assert table.grow(row, start + 8)
            cache = KVCache(2, 2, 32, 0, "cpu", torch.float16, table=table)
            for layer in range(2):
                for row, start in enumerate(starts):
                    view = cache.rows(row, row + 1)
                    pos = torch.arange(start)
                    k, v = (context[i, layer, row:row + 1, :, :start] for i in (0, 1))
                    view.put_at(layer, pos, k, v)
            runner = TargetRunner(model, cache, torch.device("cpu"), max_depth=4)
            with torch.no_grad():
                out = runner.run([3, 4, 1], starts, trees)
            return out.logits.clone(), [cache.held(row, start + 4) for row, start in enumerate(starts)]

        def contiguous_round():
            K._use_triton = lambda x: False
            cache = KVCache(2, 2, 32, capacity, "cpu", torch.float16, batch=4)
            cache.k.copy_(context[0])
            cache.v.copy_(context[1])
            runner = TargetRunner(model, cache, torch.device("cpu"), max_depth=4)
            with torch.no_grad():
                out = runner.run([3, 4, 1], starts, trees)
            return out.logits.clone(), [cache.held(row, start + 4) for row, start in enumerate(starts)]

        (a, ka), (b, kb), (c, kc) = paged_round(False), paged_round(True), contiguous_round()
        a, b, c = a[:3], b[:3], c[:3]                               # row 3: a pad row
        assert torch.equal(a, c), (a - c).abs().max()               # the torch path: paging changes nothing
        assert (a - b).abs().max() < 2e-2, (a - b).abs().max()
        for row, start in enumerate(starts):
            n = start + (1 if trees[row] is None else trees[row].size)
            for x, y, z in zip(ka[row], kb[row], kc[row]):
                assert torch.equal(x[..., :n, :], z[..., :n, :])
                assert (x[..., :n, :].float() - y[..., :n, :].float()).abs().max() < 1e-2
    """)


def test_prompt_key_gather_copies_each_rows_pages_up_to_its_length():
    """A prompt piece's keys out of a paged pool (prompt_attention.gather_pages): each row's pages,
    shuffled over the pool, land in order up to its length rounded up to a page; nothing past it is
    written (the kernel skips those pages, so a graph keeps one shape and pays for the real keys)."""
    out = interpret("""
        import ddtree_runtime.model.prompt_attention as P
        hkv, d, page, bucket, b = 2, 32, 16, 80, 3
        width = bucket // page
        table = (torch.randperm(b * width) + 1).view(b, width)
        pool = torch.randn(hkv, (b * width + 1) * page, d, dtype=torch.float16)
        lengths = torch.tensor([33, 80, 1])
        got = P.gather_pages(pool, table, page, lengths, bucket)
        assert got.shape == (b, hkv, bucket, d)
        for row in range(b):
            pages = -(-lengths[row].item() // page)
            for p in range(pages):
                slot = table[row, p].item() * page
                assert torch.equal(got[row, :, p * page:(p + 1) * page], pool[:, slot:slot + page]), (row, p)
            print(row, pages)
    """)
    assert len(out.splitlines()) == 3


def test_prompt_attention_parts_merge_into_the_softmax_over_all_keys():
    """A long prefix's attention in parts (prompt_attention.merge_parts): each part's normalised output
    and log-sum-exp, merged, equal attention over all the keys at once; a part with no keys (a row
    whose prefix is shorter than the split) counts for nothing, whatever its output holds."""
    out = interpret("""
        import ddtree_runtime.model.prompt_attention as P
        heads, d, width, splits = 2, 32, 4, 3
        prefixes = [10, 2]                                   # row 1: its third part is empty
        used = torch.tensor([[min(max(p - j * -(-p // splits), 0), -(-p // splits)) for p in prefixes]
                             for j in range(splits)], dtype=torch.int32)
        rows = len(prefixes)
        q = torch.randn(rows * width, heads, d, dtype=torch.float64)
        parts = torch.full((splits, rows * width, heads, d), float("nan"), dtype=torch.float16)
        part_lse = torch.full((heads, splits, rows * width), float("inf"), dtype=torch.float32)
        own = torch.empty(rows * width, heads, d, dtype=torch.float16)
        own_lse = torch.empty(heads, rows * width, dtype=torch.float32)
        want = torch.empty(rows * width, heads, d, dtype=torch.float64)

        def attend(qs, keys, values, allowed):               # [Tq, H, D] over [Tk, H, D] -> out, lse
            s = torch.einsum("qhd,khd->hqk", qs, keys) * d ** -0.5
            s = s.masked_fill(~allowed, float("-inf"))
            return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), values), torch.logsumexp(s, -1)

        for row, prefix in enumerate(prefixes):
            k, v = torch.randn(2, prefix + width, heads, d, dtype=torch.float64)
            t = slice(row * width, (row + 1) * width)
            causal = torch.arange(prefix + width)[None] <= prefix + torch.arange(width)[:, None]
            want[t] = attend(q[t], k, v, causal)[0]
            o, lse = attend(q[t], k[prefix:], v[prefix:], torch.ones(width, width, dtype=torch.bool).tril())
            own[t], own_lse[:, t] = o.half(), lse.float()
            for j in range(splits):
                n = used[j, row].item()
                if n:
                    lo = j * -(-prefix // splits)
                    o, lse = attend(q[t], k[lo:lo + n], v[lo:lo + n], torch.ones(width, n, dtype=torch.bool))
                    parts[j, t], part_lse[:, j, t] = o.half(), lse.float()
        got = P.merge_parts(parts, part_lse, used, own, own_lse, width)
        err = (got.double() - want).abs().max().item()
        print(err)
        assert got.dtype == torch.float16 and err < 3e-3, err
    """)
    assert float(out) < 3e-3


# (width, real tokens, keep, resume) for the prompt-piece kernels (gdn_prompt.py): a full piece; the state
# kept at the first token, at the piece's end, at the width; tails reaching back into the row's old tail
# (a piece or a keep shorter than the conv); a prompt's start (resume False) with and without keep
PROMPT_PIECES = [(40, 40, None, True), (40, 17, 1, True), (40, 17, 17, False), (8, 2, 1, True),
                 (40, 40, 40, True), (64, 33, 30, False), (40, 5, None, False)]


def test_prompt_conv_kernel_is_the_torch_conv_split_moved_and_tails():
    """gdn_prompt.prompt_conv_heads against the torch padded path: q, k (then L2-normalised, as fla's
    l2norm does), v as the conv + SiLU + split give them, the moved copies of padded_chunk_gated_delta's
    second call (its tokens past the width: zeros), the tails at length and keep written into the row,
    no other row touched."""
    interpret(f"""
        import ddtree_runtime.model.gdn_prompt as P
        from ddtree_runtime.model.gdn_chunk import PaddedPrompt, conv_inputs, conv_silu, l2_normalised, tail_before
        hk, hv, dk, dv, K = 2, 4, 16, 16, 4
        nk, c = hk * dk, 2 * hk * dk + hv * dv
        for width, length, keep, resume in {PROMPT_PIECES}:
            mixed = torch.randn(1, width, c + 8, dtype=torch.float16)[..., :c]   # strided, as the projection's
            conv, snap = torch.randn(2, 3, K - 1, c, dtype=torch.float16)
            weight = torch.randn(c, K, dtype=torch.float16) * 0.5
            prompt = PaddedPrompt(torch.tensor([1]), torch.tensor([resume]), torch.tensor([length]),
                                  None if keep is None else torch.tensor([keep]))
            ext = conv_inputs(mixed, conv[1:2].where(prompt.resume, 0))
            q, k, v = conv_silu(ext, weight).split([nk, nk, hv * dv], -1)
            want = (l2_normalised(q.float().view(1, width, hk, dk)), l2_normalised(k.float().view(1, width, hk, dk)),
                    v.float().view(1, width, hv, dv))
            new_conv, new_snap = conv.clone(), snap.clone()
            first, moved = P.prompt_conv_heads(mixed, new_conv, new_snap if keep else None, weight, prompt,
                                               hk, hv, dk, dv)
            for got, ref in zip(first[:3], want):
                assert got.is_contiguous() and (got.float() - ref).abs().max() < 1e-3
            assert torch.equal(new_conv[1], tail_before(ext, prompt.length, K)[0])
            assert torch.equal(new_conv[::2], conv[::2])
            if keep is None:
                assert moved is None and torch.equal(new_snap, snap)
                continue
            assert torch.equal(new_snap[1], tail_before(ext, prompt.keep, K)[0])
            assert torch.equal(new_snap[::2], snap[::2])
            for got, ref in zip(moved[:3], want):
                assert got.is_contiguous() and torch.allclose(got[:, :width - keep].float(), ref[:, keep:], atol=1e-3)
                assert (got[:, width - keep:] == 0).all()
            print(width, length, keep, resume)
    """)


def test_prompt_gates_kernel_is_the_torch_gates_masks_and_initial_state():
    """gdn_prompt.prompt_gates against GatedDeltaNet._gates and padded_chunk_gated_delta's masks: beta and
    g zero past the first call's end (keep, or the piece's length) and, for the second call, at the tokens
    moved to the front from keep on, live while before the length; the row's state or zeros."""
    interpret(f"""
        import torch.nn.functional as F
        import ddtree_runtime.model.gdn_prompt as P
        from ddtree_runtime.model.gdn_chunk import PaddedPrompt
        hv, dk, dv = 4, 32, 16
        for width, length, keep, resume in {PROMPT_PIECES}:
            proj = torch.randn(1, width, 2 * hv + 8, dtype=torch.float16) * 4
            b, a = proj[..., :hv], proj[..., hv:2 * hv]
            a[0, 0, 0], a[0, 1, 0] = 30.0, -20.0                  # softplus past its threshold, and tiny
            a_log, dt_bias = torch.rand(hv, dtype=torch.float16) * 2 - 1, torch.randn(hv, dtype=torch.float16)
            state = torch.randn(3, hv, dk, dv)
            prompt = PaddedPrompt(torch.tensor([2]), torch.tensor([resume]), torch.tensor([length]),
                                  None if keep is None else torch.tensor([keep]))
            beta = torch.sigmoid(b).float()                        # GatedDeltaNet._gates
            g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
            offsets = torch.arange(width)
            live = (offsets < (length if keep is None else keep))[None, :, None]
            none = P.Heads(None, None, None)
            first, moved, init = P.prompt_gates(b, a, a_log, dt_bias, state, prompt, none, none if keep else None)
            torch.testing.assert_close(first.g, g.where(live, 0.0), atol=1e-6, rtol=1e-5)
            assert first.beta.dtype == torch.float16 and torch.equal(first.beta.float(), beta.where(live, 0.0))
            assert torch.equal(init[0], state[2] if resume else torch.zeros_like(state[2]))
            if keep is None:
                assert moved is None
                continue
            src = (offsets + keep).clamp(max=width - 1)
            live = (offsets + keep < length)[None, :, None]
            torch.testing.assert_close(moved.g, g[:, src].where(live, 0.0), atol=1e-6, rtol=1e-5)
            assert torch.equal(moved.beta.float(), beta[:, src].where(live, 0.0))
            print(width, length, keep, resume)
    """)


def test_prompt_gated_norm_reads_each_token_from_its_call():
    """gdn_prompt.prompt_gated_norm against the torch path: token t from the first call's output before
    keep, else the second's at t - keep (padded_chunk_gated_delta's gather and where), then RMSNorm rounded
    as kernels.rms_norm rounds it, times SiLU(z)."""
    interpret('''
        import torch.nn.functional as F
        import ddtree_runtime.model.gdn_prompt as P
        width, hv, dv = 12, 3, 16
        for keep in (None, 1, 5, 12):
            out, rest = torch.randn(2, 1, width, hv, dv, dtype=torch.float16)
            z = torch.randn(1, width, hv * dv + 5, dtype=torch.float16)[..., :hv * dv]
            w = torch.rand(dv, dtype=torch.float16) + 0.5
            core = out
            if keep is not None:
                offsets = torch.arange(width)
                back = rest.index_select(1, (offsets - keep).clamp(min=0))
                core = torch.where((offsets < keep)[None, :, None, None], out, back)
            x = core.float()
            n = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).half()
            want = (n.float() * F.silu(z.float().view(1, width, hv, dv))).half().reshape(1, width, -1)
            got = P.prompt_gated_norm(out, None if keep is None else rest,
                                      None if keep is None else torch.tensor([keep]), z, w, 1e-6)
            assert (got.float() - want.float()).abs().max() < 2e-3, keep
    ''')


def test_fused_prompt_piece_is_the_torch_padded_piece():
    """A linear layer's padded prompt piece through gdn_prompt's kernels (fla's calls stood in for by the
    torch chunked form, as fla cannot run here) gives the torch padded path's output, conv tails (the
    same bits), state and snapshot, in float16."""
    interpret('''
        import ddtree_runtime.model.gdn_prompt as P
        from ddtree_runtime.engine.kv_cache import HybridCache
        from ddtree_runtime.model import Qwen35Config
        from ddtree_runtime.model.gdn_chunk import PaddedPrompt, chunk_gated_delta_torch
        from ddtree_runtime.model.layers import TreeInputs, fuse_projections
        from ddtree_runtime.model.qwen3_5 import Qwen35ForCausalLM

        def fla(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
            assert not use_qk_l2norm_in_kernel and all(t.is_contiguous() for t in (q, k, v, g, beta))
            out, final = chunk_gated_delta_torch(q, k, v, g, beta, initial_state, scale)
            return out.to(v.dtype).contiguous(), final

        P._fla_chunk = lambda: fla
        cfg = Qwen35Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                           linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=4)
        model = Qwen35ForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.uniform_(-1, 1)
                if "norm" in name:
                    p.normal_(1, 0.3)
        model.half()
        fuse_projections(model)  # the in-projection's parts are strided views, as in service
        layer = model.model.layers[0].linear_attn
        # (start, real tokens, width, keep): past one chunk; keep = length = 1; keep inside the conv's reach
        for start, length, width, keep in [(0, 5, 32, None), (0, 70, 128, 70), (9, 1, 32, 1), (40, 33, 64, 2),
                                           (9, 64, 64, None)]:
            x = torch.randn(1, width, 32).half()
            runs = []
            for fused in (False, True):
                P._use_triton = lambda t: fused
                cache = HybridCache(cfg, 8, "cpu", torch.float16, batch=3, snapshots=True)
                gen = torch.Generator().manual_seed(1)
                for t in cache._states():
                    t.copy_(torch.randn(t.shape, generator=gen))
                prompt = PaddedPrompt(torch.tensor([2]), torch.tensor([start > 0]), torch.tensor([length]),
                                      None if keep is None else torch.tensor([keep]))
                with torch.inference_mode():
                    runs.append((layer(x, cache, start, TreeInputs(None, None, 0, None, prompt=prompt)), cache))
            (want, torch_cache), (got, fused_cache) = runs
            assert (got[:, :length].float() - want[:, :length].float()).abs().max() < 3e-3
            conv, state, snap_conv, snap_state = (torch.equal(a, b) or (a.float() - b.float()).abs().max().item()
                                                  for a, b in zip(fused_cache._states(), torch_cache._states()))
            assert conv is True and snap_conv is True and state < 2e-4 and (snap_state is True or snap_state < 2e-4)
            print(start, length, width, keep)
    ''')


def test_compile_check_reports_a_kernel_the_interpreter_runs_but_the_compiler_refuses(tmp_path, monkeypatch):
    """compile_check's own check: a kernel whose `if` changes a variable's type runs in the interpreter
    (it is Python) but fails to compile for the GPU, and interpret() reports it; the same kernel written
    right compiles."""
    (tmp_path / "kernels_under_check.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def retyped(x_ptr, n, BLOCK: tl.constexpr):
            i = 3
            if n > 0:
                i = tl.arange(0, BLOCK)
            tl.store(x_ptr + i, 1.0)

        @triton.jit
        def steady(x_ptr, n, BLOCK: tl.constexpr):
            i = tl.arange(0, BLOCK)
            if n > 0:
                i = i + 0
            tl.store(x_ptr + i, 1.0)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    body = """
        import kernels_under_check as C
        C.{}[(1,)](torch.zeros(16), 1, BLOCK=16)
    """
    interpret(body.format("steady"))
    with pytest.raises(AssertionError, match="retyped.*BLOCK"):
        interpret(body.format("retyped"))


def test_partial_rope_kernel_matches_rope_of_rms_norm_and_reads_q_from_query_gate_heads():
    """The hybrid's partial RoPE (R of D dims rotated, the rest normalised and weighted only) against
    rotate_half_rope of the torch RMSNorm in float64: q read in place from [query | gate] heads (head
    stride 2D) and from a contiguous copy to the same bits, a token alone to the same bits as among
    others (a verify's q/k are the AR step's), a batched AR step, and rotated widths the kernel leaves
    to torch."""
    out = interpret("""
        K._use_triton = lambda x: True
        b, t, hq, hkv, eps = 3, 5, 6, 2, 1e-6               # 6 heads: padded to 8 in the program
        for dtype, d, r, tol in [(torch.float16, 64, 16, 3e-3), (torch.float32, 64, 16, 1e-5),
                                 (torch.float16, 256, 64, 3e-3), (torch.float32, 32, 8, 1e-5)]:
            y = torch.randn(b, t, (2 * hq + 2 * hkv) * d, dtype=dtype)   # a fused [query | gate] | k | v output
            q_gate = y[..., :2 * hq * d].view(b, t, hq, 2 * d)
            q = q_gate[..., :d]
            k = y[..., 2 * hq * d:(2 * hq + hkv) * d].view(b, t, hkv, d)
            w = torch.rand(d, dtype=dtype) + 0.5
            ang = torch.rand(b, 1, t, r) * 6
            cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)

            def ref_rope(x):
                return K.rotate_half_rope(K.rms_norm_torch(x.double(), w.double(), eps).transpose(1, 2),
                                          cos.double(), sin.double())
            assert q.stride(2) == 2 * d and K._rows(q)          # read in place, no copy
            got = K.rms_norm_rope(q, w, eps, cos, sin)
            assert got.shape == (b, hq, t, d)
            err = (got.double() - ref_rope(q)).abs().max().item()
            assert err < tol, (dtype, d, r, err)
            assert (K.rms_norm_rope(k, w, eps, cos, sin).double() - ref_rope(k)).abs().max() < tol
            assert torch.equal(K.rms_norm_rope(q.contiguous(), w, eps, cos, sin), got)
            alone = K.rms_norm_rope(q[1:2, 2:3], w, eps, cos[1:2, :, 2:3], sin[1:2, :, 2:3])
            assert torch.equal(alone, got[1:2, :, 2:3])
            # a batched AR step: one token a sequence, the size-1 token dim's stride not the batch's step
            one = q_gate[:, 3:4, :, :d]
            step = K.rms_norm_rope(one, w, eps, cos[:, :, 3:4], sin[:, :, 3:4])
            assert torch.equal(step, got[:, :, 3:4])
            print(dtype, d, r, err)
        # rotated widths the kernel does not take (R/2 no power of two, R past D): the torch path
        x = torch.randn(1, 2, 2, 32)
        for r in (24, 64):
            ang = torch.rand(1, 1, 2, r)
            assert not K._rope_fits(x, torch.ones(32), ang)
        assert K._rope_fits(x, torch.ones(32), torch.rand(1, 1, 2, 2))
    """)
    assert len(out.splitlines()) == 4


def test_partial_rope_kv_write_stores_rms_norm_ropes_bits_in_a_paged_pool():
    """The fused KV write with partial RoPE through a paged cache's kernel_target (physical slots in one
    pool, rows over shuffled pages): k the same bits as rms_norm_rope's (the prompt's k, stored by
    cache.write), v as is, in every row's own positions; nothing else in the pool changes."""
    interpret("""
        from ddtree_runtime.engine.block_manager import BlockManager, PageTable
        from ddtree_runtime.engine.kv_cache import KVCache

        K._use_triton = lambda x: True
        b, t, hq, hkv, d, r, page, eps = 3, 5, 4, 2, 64, 16, 4, 1e-6
        manager = BlockManager(20, page)
        table = PageTable(manager, b, 32 // page, torch.device("cpu"))
        manager.free = type(manager.free)(torch.randperm(20).add(1).tolist())
        starts = [3, 11, 0]
        for row, start in enumerate(starts):
            assert table.grow(row, start + t)
        cache = KVCache(2, hkv, d, 0, "cpu", torch.float16, table=table)
        cache.k.normal_()
        cache.v.normal_()
        before_k, before_v = cache.k.clone(), cache.v.clone()
        y = torch.randn(b, t, (2 * hq + 2 * hkv) * d, dtype=torch.float16)
        k = y[..., 2 * hq * d:(2 * hq + hkv) * d].view(b, t, hkv, d)
        v = y[..., (2 * hq + hkv) * d:].view(b, t, hkv, d)
        w = torch.rand(d, dtype=torch.float16) + 0.5
        ang = torch.rand(b, 1, t, r) * 6
        cos, sin = ang.cos().half(), ang.sin().half()
        slots = torch.tensor(starts)[:, None] + torch.arange(t)                      # [B, T] positions
        assert K.rms_norm_rope_to_cache(k, v, w, eps, cos, sin, *cache.kernel_target(1, slots))
        want_k = K.rms_norm_rope(k, w, eps, cos, sin)                                # [B, Hkv, T, D]
        for row, start in enumerate(starts):
            held_k, held_v = cache.held(row, start + t)
            assert torch.equal(held_k[1, :, start:], want_k[row])
            assert torch.equal(held_v[1, :, start:], v[row].transpose(0, 1))
        written = cache._physical(slots).reshape(-1)
        kept = torch.ones(cache.k.shape[2], dtype=torch.bool)
        kept[written] = False
        assert torch.equal(cache.k[0], before_k[0]) and torch.equal(cache.v[0], before_v[0])
        assert torch.equal(cache.k[1][:, kept], before_k[1][:, kept])
        assert torch.equal(cache.v[1][:, kept], before_v[1][:, kept])
    """)


def test_sigmoid_gate_kernel_matches_torch():
    """The gated attention's output gate: o (as SDPA and as the decode kernel lay it out) times the
    sigmoid of the gate half of [query | gate] heads read in place, rounded as torch rounds (the sigmoid
    to the model dtype, then the product): torch's bits but for a last-bit difference in the sigmoid's
    float32 value now and then; a batched AR step too."""
    out = interpret("""
        K._use_triton = lambda x: True
        for dtype, b, t, h, d in [(torch.float16, 2, 5, 3, 64), (torch.bfloat16, 3, 1, 4, 32),
                                  (torch.bfloat16, 1, 7, 2, 256)]:
            y = torch.randn(b, t, (2 * h + 4) * d, dtype=dtype) * 3
            q_gate = y[..., :2 * h * d].view(b, t, h, 2 * d)
            want = None
            for o in (torch.randn(b, h, t, d, dtype=dtype), torch.randn(b, t, h, d, dtype=dtype).transpose(1, 2)):
                want = o.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(q_gate[..., d:].reshape(b, t, -1))
                got = K.sigmoid_gate(o, q_gate)
                assert got.shape == (b, t, h * d) and got.dtype == dtype
                # bfloat16 within two of its ulps: Triton's interpreter truncates float32 to bfloat16 (the
                # GPU rounds to nearest, as torch does), so only float16 can show torch's bits here
                ulp = want.float().abs().clamp_min(1e-3) * (2 ** -6 if dtype == torch.bfloat16 else 2 ** -10)
                assert ((got.float() - want.float()).abs() <= ulp).all()
                same = (got == want).float().mean().item()
                assert same > 0.99 or dtype == torch.bfloat16, same
            print(dtype, same)
    """)
    assert len(out.splitlines()) == 3


def test_hybrid_gated_attention_through_the_kernels_matches_torch():
    """The hybrid's gated full attention (partial RoPE, [query | gate] heads) through the kernels: a prompt
    prefill (q and k through the RMSNorm + RoPE kernel, cache.write, the gate kernel) and then a batched
    round over a paged pool (rows of shuffled pages, one a pad row; k and v stored by the fused write at
    physical slots, the paged split-KV attention) against the torch path: the same hidden states and
    logits to float16 rounding, and each row's positions hold the same KV; the torch run launches no
    kernel, the other the RMSNorm + RoPE kernel (plain and with the KV write) and the gate kernel."""
    interpret("""
        from ddtree_runtime.engine.block_manager import BlockManager, PageTable
        from ddtree_runtime.engine.kv_cache import HybridCache
        from ddtree_runtime.engine.runner import TargetRunner
        from ddtree_runtime.engine.tree import Tree
        from ddtree_runtime.model import Qwen35Config
        from ddtree_runtime.model.layers import fuse_projections
        from ddtree_runtime.model.qwen3_5 import Qwen35ForCausalLM

        cfg = Qwen35Config(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                           linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=4)
        assert cfg.rotary_dim == 8                                   # partial RoPE: 8 of 32 dims
        model = Qwen35ForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(1, 0.3)
        model.half()
        fuse_projections(model)   # q|gate, k and v are then strided views of one output, as in service
        trees = [Tree(torch.tensor([[5, 6, 7, 8], [0, 1, 1, 0], [1, 2, 2, 1]])), None,
                 Tree(torch.tensor([[9, 10], [0, 1], [1, 2]]))]
        starts, page, capacity = [40, 7, 300], 16, 1024
        context = torch.randn(2, 4, 2, capacity, 32).half()          # k/v, rows, Hkv, positions, D
        prompt = torch.randint(0, 50, (1, starts[0]))

        def paged_round(fused):
            K._use_triton = lambda x: fused
            manager = BlockManager(80, page)
            table = PageTable(manager, 4, capacity // page, torch.device("cpu"))
            manager.free = type(manager.free)(torch.randperm(80, generator=torch.Generator().manual_seed(1))
                                              .add(1).tolist())
            for row, start in enumerate(starts):
                assert table.grow(row, start + 8)
            cache = HybridCache(cfg, 0, "cpu", torch.float16, nodes=8, table=table)
            gen = torch.Generator().manual_seed(2)
            for t in cache._states():
                t.copy_(torch.randn(t.shape, generator=gen))
            for row, start in enumerate(starts[1:], 1):
                k, v = (context[i, row:row + 1, :, :start] for i in (0, 1))
                cache.rows(row, row + 1).put_at(0, torch.arange(start), k, v)
            with torch.no_grad():
                # row 0's context: a prompt prefill through the model (k stored by cache.write)
                hidden, _ = model(prompt, torch.arange(starts[0])[None], cache.rows(0, 1), start=0)
                out = TargetRunner(model, cache, torch.device("cpu"), max_depth=4).run([3, 4, 1], starts, trees)
            return hidden, out.logits[:3].clone(), [cache.held(row, start + 4) for row, start in enumerate(starts)]

        launched = []

        class Counted:  # records which of the two kernels ran, and how (the fused write has slots)
            def __init__(self, name, kernel):
                self.name, self.kernel = name, kernel

            def __getitem__(self, grid):
                def launch(*args, **meta):
                    launched.append((self.name, meta.get("HAS_SLOTS"), meta.get("HALF")))
                    return self.kernel[grid](*args, **meta)
                return launch

        K._rms_norm_rope_kernel = Counted("rope", K._rms_norm_rope_kernel)
        K._sigmoid_gate_kernel = Counted("gate", K._sigmoid_gate_kernel)
        (ha, a, ka) = paged_round(False)
        assert not launched
        (hb, b, kb) = paged_round(True)
        assert set(launched) == {("rope", False, 4), ("rope", True, 4), ("gate", None, None)}, set(launched)
        assert (ha - hb).abs().max() < 2e-2, (ha - hb).abs().max()
        assert (a - b).abs().max() < 2e-2, (a - b).abs().max()
        for row, start in enumerate(starts):
            n = start + (1 if trees[row] is None else trees[row].size)
            for x, y in zip(ka[row], kb[row]):
                assert (x[..., :n, :].float() - y[..., :n, :].float()).abs().max() < 1e-2
    """)

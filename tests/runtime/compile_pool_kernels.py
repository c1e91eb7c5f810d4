"""Kernels for test_compile_pool.py, in a module a spawned worker can import by name: one reading a
constexpr global of its own module, one calling a helper that reads a plain global of another module
(a value a worker cannot be given), and one autotuned over four configs (the CUDA test)."""

import triton
import triton.language as tl

from tests.runtime import compile_pool_helpers as helpers

SCALE = tl.constexpr(2.0)


@triton.jit
def scaled_copy(src, dst, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    tl.store(dst + offsets, tl.load(src + offsets, mask=keep) * SCALE, mask=keep)


@triton.jit
def shifted_copy(src, dst, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    tl.store(dst + offsets, helpers.shift(tl.load(src + offsets, mask=keep)), mask=keep)


@triton.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=w) for b in (64, 128) for w in (2, 4)], key=["n"])
@triton.jit
def tuned_copy(src, dst, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    tl.store(dst + offsets, tl.load(src + offsets, mask=keep) * SCALE, mask=keep)

"""A kernel whose module misbehaves when a compile worker imports it (test_compile_pool.py): with
DDTREE_TEST_COMPILE_FAULT=exit the worker process dies, with =hang it stalls. Only in a worker (the
one process that sees no GPU by CUDA_VISIBLE_DEVICES=""), never in the test's own process."""

import os
import time

import triton
import triton.language as tl

if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
    fault = os.environ.get("DDTREE_TEST_COMPILE_FAULT")
    if fault == "exit":
        os._exit(3)
    if fault == "hang":
        time.sleep(60)


@triton.jit
def plain_copy(src, dst, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    tl.store(dst + offsets, tl.load(src + offsets, mask=keep), mask=keep)

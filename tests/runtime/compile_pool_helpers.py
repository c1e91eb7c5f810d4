"""A Triton helper reading a constexpr global of its own module (test_compile_pool.py changes it in the
test process: a worker must take this process's value to build the same kernel)."""

import triton
import triton.language as tl

ADD_ONE = tl.constexpr(False)


@triton.jit
def shift(x):
    if ADD_ONE:
        x = x + 1.0
    return x

"""Running the runtime's Triton kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set
before Triton loads): the tests and the benchmarks' --tiny modes."""

from __future__ import annotations


def allow_loop_bounds() -> None:
    """The interpreter holds a scalar as a one-element array, which numpy 2 no longer turns into an int: a
    loop bound that is a kernel argument, computed from program ids or loaded (decode attention's per-row
    key lengths, the tree verify's node count) needs it to."""
    import triton.runtime.interpreter as interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_index(tensor, *scope):  # Triton 3.6 passes the patch's scope (3.5 does not)
        patch_tensor(tensor, *scope)
        tensor.__index__ = lambda self: int(self.handle.data.item())

    interpreter._patch_lang_tensor = patch_tensor_with_index


def exact_dots() -> None:
    """Make the interpreter's tl.dot round once: it calls numpy's float32 matmul, whose order of summing
    depends on the tile's shape and on the CPU's BLAS kernels, so two tilings of the same K group can
    differ in the last bit on one machine and not on another. Summed in float64 and rounded to the
    accumulator's type, a dot's result no longer depends on either (what a bit-equality test needs)."""
    import numpy as np
    import triton.runtime.interpreter as interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if any(x.dtype.primitive_bitwidth == 8 and x.dtype.is_floating() for x in (a, b)):
            a_data = interpreter._convert_float(a_data, a.dtype, interpreter.tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, interpreter.tl.float16, None).view(np.float16)
        product = np.matmul(a_data.astype(np.float64), b_data.astype(np.float64)).astype(d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot

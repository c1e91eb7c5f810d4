"""Running the runtime's Triton kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set
before Triton loads): the tests and the benchmarks' --tiny modes."""

from __future__ import annotations


def allow_loop_bounds() -> None:
    """The interpreter holds a scalar as a one-element array, which numpy 2 no longer turns into an int: a
    loop bound that is a kernel argument, computed from program ids or loaded (decode attention's per-row
    key lengths, the tree verify's node count) needs it to."""
    import triton.runtime.interpreter as interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_index(tensor):
        patch_tensor(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.item())

    interpreter._patch_lang_tensor = patch_tensor_with_index

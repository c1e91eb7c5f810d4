"""Compiling the kernels the interpreter ran for a real GPU, on a machine without one.

Triton's interpreter (TRITON_INTERPRET=1) runs a kernel's Python with numpy: it checks the arithmetic
but not what the compiler refuses (a variable whose type an `if` changes, a shape a layout cannot take).
Those errors surfaced only in GPU calls, costing device time. So each launch the interpreter makes is
recorded (kernel, argument types, constexpr values, launch options), and the recorded kernels are then
compiled for Hopper (sm_90) in a process where Triton is not interpreting: front end, optimisation,
LLVM and ptxas all run on the CPU; only loading the binary needs a GPU."""

from __future__ import annotations

import atexit
import importlib
import inspect
import json
import os
from pathlib import Path

LOG_ENV = "DDTREE_KERNEL_LOG"  # where an interpreter process appends the launches it made
OPTIONS = ("num_warps", "num_stages")
POINTER_TYPES = {"torch.bfloat16": "*bf16", "torch.float16": "*fp16", "torch.float32": "*fp32",
                 "torch.float64": "*fp64", "torch.int64": "*i64", "torch.int32": "*i32", "torch.int16": "*i16",
                 "torch.int8": "*i8", "torch.uint8": "*u8", "torch.bool": "*i1", "torch.float8_e4m3fn": "*fp8e4nv"}


def record_launches() -> None:
    """In an interpreter process: when LOG_ENV names a file, append every kernel launch's description to
    it at exit (one JSON line each, duplicates dropped)."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    from triton.runtime import interpreter

    seen: dict[str, None] = {}
    launch = interpreter.InterpretedFunction.__getitem__

    def recording(self, grid):
        executor = launch(self, grid)

        def run(*args, **kwargs):
            seen[json.dumps(_describe(self.fn, args, kwargs), sort_keys=True)] = None
            return executor(*args, **kwargs)
        return run

    interpreter.InterpretedFunction.__getitem__ = recording
    atexit.register(lambda: Path(path).open("a").writelines(line + "\n" for line in seen))


def _describe(fn, args: tuple, kwargs: dict) -> dict:
    """A launch as triton.compile needs it: each parameter's type or constexpr value."""
    params = inspect.signature(fn).parameters
    values = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
    signature, constants = {}, {}
    for name, param in params.items():
        value = values.get(name, param.default)
        if "constexpr" in str(param.annotation) or value is None:
            constants[name] = value
        else:
            signature[name] = _type_of(value)
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constants": constants,
            "options": {k: kwargs[k] for k in OPTIONS if k in kwargs}}


def _type_of(value) -> str:
    if hasattr(value, "dtype") and hasattr(value, "data_ptr"):
        return POINTER_TYPES[str(value.dtype)]
    if hasattr(value, "block_shape") and hasattr(value, "base"):   # a host tensor descriptor (TMA)
        return f"tensordesc<{POINTER_TYPES[str(value.base.dtype)][1:]}{list(value.block_shape)}>"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"a kernel argument of type {type(value).__name__}")


def compile_logged(path: str | Path, arch: int = 90) -> list[str]:
    """Compile every launch in the log for sm_<arch> (Triton not interpreting in this process). Returns
    one line per kernel that failed: its name, constexprs and the compiler's last error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = []
    for line in sorted(set(Path(path).read_text().splitlines())):
        launch = json.loads(line)
        kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
        names = kernel.arg_names
        signature = {name: launch["signature"].get(name, "constexpr") for name in names}
        constants = {(names.index(k),): v for k, v in launch["constants"].items()}
        try:
            triton.compile(ASTSource(kernel, signature, constexprs=constants), target=GPUTarget("cuda", arch, 32),
                           options=launch["options"])
        except Exception as error:  # the compiler's own error is the report
            while error.__cause__ is not None or error.__context__ is not None:
                error = error.__cause__ or error.__context__
            failures.append(f"{launch['name']} {launch['constants']}: {type(error).__name__}: {str(error)[-600:]}")
    return failures

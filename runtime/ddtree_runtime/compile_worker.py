"""A process that compiles Triton kernels for the serving process (model/compile_pool.py).

It sees no GPU: compiling for a known target needs none, and a CUDA context here would take device
memory the server sized its KV pool against. It compiles a kernel only when it can show the result is
the one the server would have built itself: it takes the server's values of the plain globals of the
modules the kernel can reach, and then must find the same cache key (the source of the kernel and of
the functions it calls, and every constexpr global they read). Imports here are the
standard library's only, so the GPU is hidden before torch or Triton can load CUDA."""

from __future__ import annotations

import importlib
import os
import warnings

COMPILED = "compiled"


def start() -> None:
    """The pool's initializer: no GPU for this process, then the compiler loaded once. Libraries that
    warn at import about finding no GPU (fla-core) are silenced: this process never runs a kernel."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    warnings.simplefilter("ignore")
    import triton  # noqa: F401


def compile_job(job: dict) -> str:
    """Compile one kernel specialisation into the shared Triton cache: COMPILED, or why not.

    job: module and name (the module attribute the kernel is reached by, decorators unwrapped), the
    server's cache_key, modules (the server's plain globals of every module the kernel can reach, set
    here first), and Triton's compile inputs: signature, constants, attrs, target, options."""
    try:
        import triton
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction

        for name, values in job["modules"].items():  # before any cache key is first computed here
            vars(importlib.import_module(name)).update(values)
        kernel = getattr(importlib.import_module(job["module"]), job["name"])
        while not isinstance(kernel, JITFunction):
            kernel = kernel.fn                       # an autotuner's or heuristics' wrapped function
        if kernel.cache_key != job["cache_key"]:
            return "not the server's kernel (its source or constexpr globals differ here)"
        triton.compile(ASTSource(kernel, job["signature"], job["constants"], job["attrs"]), target=job["target"],
                       options=job["options"])
    except Exception as error:  # the server compiles it itself, as it would have without the pool
        return f"{type(error).__name__}: {str(error)[-300:]}"
    return COMPILED

"""A process that compiles Triton kernels for the serving process (model/compile_pool.py starts it as
`python -m ddtree_runtime.compile_worker`, so none of the server's own script runs again here).

It sees no GPU (the pool starts it with CUDA_VISIBLE_DEVICES=""): compiling for a known target needs
none, and a CUDA context here would take device memory the server sized its KV pool against. It
compiles a kernel only when it can show the result is the one the server would have built itself: it
takes the server's values of the plain globals of the modules the kernel can reach, and then must find
the same cache key (the source of the kernel and of the functions it calls, and every constexpr global
they read).

Protocol on stdin / a copy of stdout: the server's sys.path and the modules to import before the first
job (answered by READY and this process's seconds so far), then a job at a time, each answered by its
outcome and the seconds it took; every message a pickle after its 8-byte length. Anything the compiler
prints goes to stderr."""

from __future__ import annotations

import importlib
import os
import pickle
import struct
import sys
import time
import warnings
from typing import Any, BinaryIO

COMPILED = "compiled"
READY = "ready"
CPUS_ENV = "DDTREE_COMPILE_CPUS"   # the cores this worker keeps to (the pool gives each worker its share)
_STARTED = time.perf_counter()
_LENGTH = struct.Struct("<Q")


def send(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def receive(stream: BinaryIO) -> Any:
    """The next message; EOFError when the other side has gone."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError
    size = _LENGTH.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def jit_function(kernel):
    """The Triton function under an autotuner's or heuristics' wrapping."""
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


def compile_job(job: dict) -> str:
    """Compile one kernel specialisation into the shared Triton cache: COMPILED, or why not.

    job: module and name (the module attribute the kernel is reached by, decorators unwrapped), the
    server's cache_key, modules (the server's plain globals of every module the kernel can reach, set
    here first), and Triton's compile inputs: signature, constants, attrs, target, options."""
    try:
        import triton
        from triton.compiler import ASTSource

        for name, values in job["modules"].items():  # before any cache key is first computed here
            vars(importlib.import_module(name)).update(values)
        kernel = jit_function(getattr(importlib.import_module(job["module"]), job["name"]))
        if kernel.cache_key != job["cache_key"]:
            return "not the server's kernel (its source or constexpr globals differ here)"
        triton.compile(ASTSource(kernel, job["signature"], job["constants"], job["attrs"]), target=job["target"],
                       options=job["options"])
    except Exception as error:  # the server compiles it itself, as it would have without the pool
        return f"{type(error).__name__}: {str(error)[-300:]}"
    return COMPILED


def main() -> None:
    cpus = os.environ.get(CPUS_ENV)
    if cpus and hasattr(os, "sched_setaffinity"):   # before the compiler sizes its thread pools
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())   # prints from the compiler stay off the protocol
    warnings.simplefilter("ignore")                     # fla-core warns at import that it found no GPU
    jobs = sys.stdin.buffer
    try:
        sys.path[:], preload = receive(jobs)
        for name in ("triton.compiler", *preload):   # imported while the server still works towards its first batch
            try:
                importlib.import_module(name)
            except Exception:  # a job that needs it reports why
                pass
        send(replies, (READY, time.perf_counter() - _STARTED))
        while True:
            job = receive(jobs)
            started = time.perf_counter()
            outcome = compile_job(job)
            send(replies, (outcome, time.perf_counter() - started))
    except (EOFError, BrokenPipeError):   # the server has gone (it stopped, or failed to start): quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), replies.fileno())   # what its pipe refused goes nowhere at exit


if __name__ == "__main__":
    main()

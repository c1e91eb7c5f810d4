"""Where a warm-up's seconds go: Triton compiles, autotuning, CUDA graph captures, the rest.

Used by burst_bench.py around `Engine.warm_up()`. It wraps, for the duration of a `with` block, the
functions that do each kind of work and charges wall time to the innermost one running (a compile
inside an autotuner's timing run counts as compile, an autotune inside a capture's eager run counts
as autotune), so the parts add up to the block's time. A wrapped function that this Triton version
lacks is left out and named in `missing`. Benchmark tooling, not runtime code."""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Iterator

# (category, module, attribute path): where each kind of warm-up work enters
HOOKS = (
    ("triton_compile", "triton.runtime.jit", "JITFunction._do_compile"),
    ("autotune", "triton.runtime.autotuner", "Autotuner._bench"),
    # the warm-up waiting on worker processes compiling an autotuner's candidates (model/compile_pool.py);
    # the candidates' intercepted compiles in this process count as triton_compile calls of ~0 s
    ("compile_pool", "ddtree_runtime.model.compile_pool", "CompilePool.compile"),
    ("graph_capture", "ddtree_runtime.engine.graphs", "capture"),
    ("graph_capture", "ddtree_runtime.engine.tree", "capture"),
)


class WarmUpProfile:
    """Exclusive seconds per category over one `with profile.active():` block."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.by_kernel: dict[str, dict[str, list]] = {}  # category -> kernel -> [exclusive seconds, calls]
        self.autotuners: dict[int, object] = {}  # the Autotuners that benchmarked configs, for their choices
        self.missing: list[str] = []
        self.total = 0.0
        self._stack: list[list] = []  # [category, started, child seconds]

    def _timed(self, category: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            if category == "autotune" and args:
                self.autotuners[id(args[0])] = args[0]
            frame = [category, time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.perf_counter() - frame[1]
                self.seconds[category] = self.seconds.get(category, 0.0) + spent - frame[2]
                self.calls[category] = self.calls.get(category, 0) + 1
                kernel = self.by_kernel.setdefault(category, {}).setdefault(kernel_name(args), [0.0, 0])
                kernel[0] += spent - frame[2]
                kernel[1] += 1
                if self._stack:
                    self._stack[-1][2] += spent
        return wrapper

    @contextlib.contextmanager
    def active(self) -> Iterator["WarmUpProfile"]:
        undo = []
        for category, module_name, path in HOOKS:
            try:
                owner = importlib.import_module(module_name)
                *parents, name = path.split(".")
                for parent in parents:
                    owner = getattr(owner, parent)
                original = getattr(owner, name)
            except (ImportError, AttributeError):
                self.missing.append(f"{module_name}.{path}")
                continue
            setattr(owner, name, self._timed(category, original))
            undo.append((owner, name, original))
        started = time.perf_counter()
        try:
            yield self
        finally:
            self.total += time.perf_counter() - started
            for owner, name, original in reversed(undo):
                setattr(owner, name, original)

    def report(self) -> dict:
        parts = {k: round(v, 2) for k, v in sorted(self.seconds.items())}
        parts["rest"] = round(self.total - sum(self.seconds.values()), 2)
        kernels = {category: {name: [round(sec, 2), n] for name, (sec, n) in
                              sorted(rows.items(), key=lambda kv: -kv[1][0])}
                   for category, rows in self.by_kernel.items()}
        # what a start could pin instead of autotuning: per kernel, each autotune key (Triton's: the key
        # arguments' values, then the tensors' dtypes, as fla-core's FLA_CONFIG_DIR files key them too)
        # and the config chosen for it (its kwargs, warps, stages, ...)
        chosen: dict[str, list[dict]] = {}
        for tuner in self.autotuners.values():
            for key, config in getattr(tuner, "cache", {}).items():
                settings = config.all_kwargs() if hasattr(config, "all_kwargs") else {"config": str(config)}
                chosen.setdefault(kernel_name((tuner,)), []).append(
                    {"key": [v if isinstance(v, (int, float, bool)) else str(v) for v in key], "config": settings})
        return {"seconds": round(self.total, 2), "exclusive_s": parts, "calls": dict(sorted(self.calls.items())),
                "by_kernel": kernels, "autotuned": chosen, "missing": self.missing}


def kernel_name(args: tuple) -> str:
    """The Triton kernel a hooked method ran for (its `self`: a JITFunction or an Autotuner), or the
    function's own name for the captures."""
    owner = args[0] if args else None
    fn = getattr(owner, "base_fn", None) or getattr(owner, "fn", None)
    return getattr(fn, "__name__", None) or type(owner).__name__

"""Shared fixtures for the runtime tests: the tiny target/drafter pair, built once and cached."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

TINY_SEED = 0


def _cache_root() -> Path:
    return Path(os.environ.get("DDOPS_CACHE") or Path.home() / ".cache" / "ddops")


def _tiny(name: str, arch: str) -> Path:
    """Path holding target/ and draft/, built by ddtree-tiny on first use and reused while OUT/.complete
    exists. A file lock keeps parallel sessions from building twice."""
    out = _cache_root() / f"{name}-seed{TINY_SEED}"
    if not (out / ".complete").exists():
        out.mkdir(parents=True, exist_ok=True)
        with open(out.parent / f".{out.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / ".complete").exists():
                from ddtree_runtime.tiny import build

                build(out, TINY_SEED, arch=arch)
    # the tiny models are all per-op overhead: one intra-op thread is faster than two and keeps test
    # times stable when the CPUs are shared (the build above keeps torch's default, for determinism)
    import torch

    torch.set_num_threads(1)
    return out


@pytest.fixture(scope="session")
def tiny_models() -> Path:
    """The tiny Qwen3 target + DFlash drafter."""
    return _tiny("tiny-models", "qwen3")


@pytest.fixture(scope="session")
def tiny_hybrid_models() -> Path:
    """The tiny hybrid (Gated DeltaNet + full attention, Qwen3.5-style) target + DFlash drafter."""
    return _tiny("tiny-hybrid", "qwen3_5")

"""`ddops demo`: the whole story on the local lab, from a fresh machine.

lab up -> status -> the lab pivot -> status -> rollback -> status -> a short summary. The tiny models
are built once (cached in $DDOPS_CACHE/tiny-models-seed0, shared with the runtime tests) and the drafter is seeded on eval-a6000, where the lab
profile syncs it from.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from .errors import DdopsError, StepFailed
from .executor import Executor
from .inventory import Inventory
from .steps.sync import cache_dir, rsync, rsync_argv

LAB_PROFILE = "lab-ddtree16"
DRAFT_HOST, DRAFT_PATH = "eval-a6000", "/root/models/tiny-draft"


TINY_SEED = 0


def tiny_dir() -> Path:
    """The tiny models, shared with the runtime tests' `tiny_models` fixture (same seed, same recipe)."""
    return cache_dir() / f"tiny-models-seed{TINY_SEED}"


def ensure_tiny_models(progress: Callable[[str], None]) -> Path:
    """Build the tiny target + drafter with `ddtree-tiny` unless a complete build is cached."""
    out = tiny_dir()
    if (out / ".complete").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent test session may be building the same models
        if (out / ".complete").is_file():
            return out
        progress(f"building the tiny models into {out} (once; a few minutes on CPU)")
        exe = shutil.which("ddtree-tiny")
        argv = [exe] if exe else [sys.executable, "-m", "ddtree_runtime.tiny"]
        done = subprocess.run([*argv, str(out), "--seed", str(TINY_SEED)], timeout=3600)
    if done.returncode != 0 or not (out / ".complete").is_file():
        raise StepFailed("ddtree-tiny failed", fix="is the runtime installed? `pip install ./runtime`")
    return out


def seed_drafter(inventory: Inventory, executor: Executor, progress: Callable[[str], None]) -> None:
    """Put the tiny drafter where the lab profile syncs it from (eval-a6000:/root/models/tiny-draft)."""
    host = inventory.host(DRAFT_HOST)
    executor.run(host, ["mkdir", "-p", DRAFT_PATH]).check("mkdir on the eval host")
    rsync(rsync_argv(inventory, str(tiny_dir() / "draft"), DRAFT_PATH, dst_host=host), progress,
          f"seed drafter on {DRAFT_HOST}")


def run_demo(obj, *, keep: bool, progress: Callable[[str], None]) -> int:
    from .cli import _print_lab  # noqa: PLC0415 - the CLI's table
    from .lab import lab_up

    started = time.monotonic()
    figures: dict[str, object] = {}
    ensure_tiny_models(progress)
    progress("booting the lab")
    _print_lab(lab_up(obj.inventory_path, extra=0, progress=progress))
    inventory = obj.inventory()
    with obj.executor(inventory) as executor:
        seed_drafter(inventory, executor, progress)
    me = [sys.executable, "-m", "ddops", "-i", str(obj.inventory_path)]

    def step(title: str, argv: list[str]) -> int:
        progress(title)
        t0 = time.monotonic()
        code = subprocess.run(me + argv).returncode
        figures[title] = f"exit {code} in {time.monotonic() - t0:.1f}s"
        return code

    step("status before", ["status"])
    pivot = step("pivot: ct200 from training to serving", ["pivot", "--kill-training", "--deploy", LAB_PROFILE, "--yes"])
    step("status after the pivot", ["status"])
    again = step("pivot again (nothing to change)", ["pivot", "--kill-training", "--deploy", LAB_PROFILE, "--yes"])
    back = step("rollback", ["rollback", "--host", "ct200"])
    step("status after the rollback", ["status"])
    step("history", ["history", "--host", "ct200"])
    progress("summary")
    for title, figure in figures.items():
        print(f"  {title:<40} {figure}")
    print(f"  demo wall time {time.monotonic() - started:.0f}s")
    return 0 if pivot == 0 and again == 0 and back == 0 else 2

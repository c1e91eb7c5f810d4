"""`ddops demo`: the whole story on the local lab, from a fresh machine.

The tiny models (committed fixtures) -> lab up (which puts the drafter on eval-a6000) -> status -> the
lab pivot as a dry run -> the pivot -> status -> the pivot again (nothing to change) -> the unit's
journal -> rollback -> status -> history -> a summary. The lab is left as the demo found it: shut
down again if the demo booted it, unless --keep.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from .executor import Executor
from .inventory import Inventory
from .lab.tiny import DRAFT_DIR, DRAFT_HOST, QWEN3, install
from .paths import cache_root
from .transfer import rsync, rsync_argv
from .views import lab_table, stdout_console

LAB_PROFILE = "lab-ddtree16"
SERVING_HOST = "ct200"
DRAFT_PATH = f"/root/models/{DRAFT_DIR}"


def tiny_dir() -> Path:
    """Where the lab profile and the runtime tests find the tiny Qwen3 pair."""
    return cache_root() / QWEN3


def ensure_tiny_models(progress: Callable[[str], None]) -> Path:
    """The tiny Qwen3 pair, installed from its fixture (see ddops.lab.tiny)."""
    return install(QWEN3, progress)


def seed_drafter(inventory: Inventory, executor: Executor, progress: Callable[[str], None]) -> None:
    """Put the tiny drafter back where the lab profile syncs it from, for tests that changed it."""
    host = inventory.host(DRAFT_HOST)
    executor.run(host, ["mkdir", "-p", DRAFT_PATH]).check("mkdir on the eval host")
    rsync(rsync_argv(inventory, str(tiny_dir() / "draft"), DRAFT_PATH, dst_host=host), progress,
          f"seed drafter on {DRAFT_HOST}")


def run_demo(inventory_path: Path, *, keep: bool, progress: Callable[[str], None]) -> int:
    from .lab import lab_down, lab_status, lab_up

    started = time.monotonic()
    figures: dict[str, str] = {}
    failed: list[str] = []

    def timed(title: str, action: Callable[[], object]) -> object:
        progress(title)
        t0 = time.monotonic()
        value = action()
        figures[title] = f"done in {time.monotonic() - t0:.1f}s"
        return value

    was_running = any(s.running for s in lab_status())
    timed("the tiny models (fixtures)", lambda: ensure_tiny_models(progress))
    stdout_console().print(lab_table(timed("lab up", lambda: lab_up(inventory_path, extra=0, progress=progress))))
    me = [sys.executable, "-m", "ddops", "-i", str(inventory_path)]

    def step(title: str, argv: list[str]) -> None:
        progress(f"{title}: ddops {' '.join(argv)}")
        t0 = time.monotonic()
        code = subprocess.run(me + argv).returncode
        figures[title] = f"exit {code} in {time.monotonic() - t0:.1f}s"
        if code != 0:
            failed.append(title)

    pivot = ["pivot", "--deploy", LAB_PROFILE]
    step("status before", ["status"])
    step("the plan (dry run)", [*pivot, "--dry-run"])
    step("pivot: ct200 from training to serving", [*pivot, "--kill-training", "--yes"])
    step("status after the pivot", ["status"])
    step("pivot again (changes only what differs)", [*pivot, "--kill-training", "--yes"])
    step("the runtime's journal", ["logs", "--host", SERVING_HOST, "-n", "8"])
    step("rollback", ["rollback", "--host", SERVING_HOST, "--yes"])
    step("status after the rollback", ["status"])
    step("history", ["history", "--host", SERVING_HOST])
    if keep or was_running:
        lab_note = ("the lab is still running" + (" (it was before the demo)" if was_running and not keep else "")
                    + ": try `ddops status` or the README's commands; `ddops lab down` stops it")
    else:
        timed("lab down", lambda: lab_down(progress=progress))
        lab_note = "the lab is shut down again (`ddops demo --keep` leaves it running; `ddops lab up` boots it)"
    progress("summary")
    for title, figure in figures.items():
        print(f"  {title:<40} {figure}")
    print(f"  demo wall time {time.monotonic() - started:.0f}s; "
          + (f"FAILED: {', '.join(failed)}" if failed else "every step passed"))
    print(f"  {lab_note}")
    return 2 if failed else 0

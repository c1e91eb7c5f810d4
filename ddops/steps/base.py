"""What every pivot step shares: the run context, the change list a step plans, and remote helpers.

A step plans before it acts: `plan(run)` reads facts and returns the changes it would make (an
empty list means "nothing to do", and nothing is touched or restarted); `apply(run, changes)` makes
them and returns a one-line summary. `--dry-run` calls only `plan`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import DdopsError, StepFailed
from ..executor import Executor
from ..inventory import Host, Inventory
from ..probes import probe_source
from ..profile import Profile

STATE_DIR = "/var/lib/ddops"
LOCK_PATH = f"{STATE_DIR}/pivot.lock"
HISTORY_PATH = f"{STATE_DIR}/history.jsonl"
BACKUP_ROOT = f"{STATE_DIR}/backups"
UNIT_DIR = "/etc/systemd/system"


class Interrupted(StepFailed):
    """The operator pressed Ctrl-C (or sent SIGTERM); the pivot stops at the next safe point."""


def backup_root(unit: str) -> str:
    return f"{BACKUP_ROOT}/{unit}"


def unit_path(unit: str) -> str:
    return f"{UNIT_DIR}/{unit}"


@dataclass
class Change:
    """One thing a step would do, in words, with optional detail (a diff, a file list)."""

    what: str
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class PivotRun:
    """Everything a pivot's steps read and write while it runs."""

    profile: Profile
    inventory: Inventory
    executor: Executor
    kill_training: bool = False
    dry_run: bool = False
    progress: Callable[[str], None] = lambda message: None
    secrets: dict[str, str] = field(default_factory=dict)      # unit env var -> value (never printed)
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)   # host -> facts probe
    inspect: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> inspect probe
    # what the run changed, so later steps know whether to restart and rollback what to undo
    changed: dict[str, bool] = field(default_factory=dict)
    backup_id: str | None = None
    stopped_units: list[str] = field(default_factory=list)
    training: dict[str, Any] | None = None
    release: str | None = None
    lock_token: str | None = None
    gates: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    interrupted: str | None = None    # set by Ctrl-C: the pivot stops at the next safe point

    def check_interrupt(self) -> None:
        """Called at safe points (between steps, between health polls): stop here if asked to."""
        if self.interrupted:
            raise Interrupted(f"interrupted by {self.interrupted}: stopped at a safe point",
                              fix="what the pivot had changed is rolled back")

    @property
    def host(self) -> Host:
        return self.inventory.host(self.profile.host)

    def target(self) -> Host:
        return self.host


def run_probe(executor: Executor, host: Host, name: str, args: Any = None, *, stdin: Any = None,
              timeout: float | None = None, python: str = "python3") -> dict[str, Any]:
    """Run probe `name` on host (args as argv JSON, or stdin JSON for secrets); return its JSON."""
    argv = [python, "-c", probe_source(name)]
    if args is not None:
        argv.append(json.dumps(args))
    result = executor.run(host, argv, timeout=timeout,
                          stdin=json.dumps(stdin) if stdin is not None else None)
    if not result.ok:
        detail = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise StepFailed(f"probe {name} failed on {host.name} (exit {result.exit_code}): {detail}")
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        raise StepFailed(f"probe {name} on {host.name} printed something that is not JSON: "
                         f"{result.stdout[:120]!r}", fix="check the login shell prints nothing") from None


def check(result, what: str) -> None:
    """Raise StepFailed naming the host and the command's last lines when it failed."""
    if not result.ok:
        detail = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-3:]
        raise StepFailed(f"{what} failed on {result.host} (exit {result.exit_code}): {' | '.join(detail)}")


def journal_argv(unit: str, lines: int = 30) -> list[str]:
    return ["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "short-iso"]


def unit_installed(executor: Executor, host: Host, unit: str) -> bool:
    """Whether systemd on host has a unit file for `unit` (a journal outlives its unit)."""
    result = executor.run(host, ["systemctl", "show", unit, "--property=LoadState", "--value"], timeout=30)
    return result.stdout.strip() not in ("not-found", "")


def journal_tail(executor: Executor, host: Host, unit: str, lines: int = 30) -> str:
    try:
        result = executor.run(host, journal_argv(unit, lines), timeout=30)
    except DdopsError as exc:
        return f"(journal unavailable: {exc.line()})"
    return result.stdout.strip()

"""Rollback: put a backed-up unit (or its absence) back, restart what the pivot stopped, health-check.

Used by `ddops rollback` (recorded in the host's history), and by a pivot that failed after it changed
something: `undo` replays what its journal recorded.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from tenacity import Retrying

from . import history
from .errors import DdopsError, StepFailed, UsageError
from .executor import Executor
from .gates.health import wait_healthy
from .inventory import Host, Inventory
from .plan import Operation
from .paths import backup_root, env_path, unit_path
from .remote import run_probe


def list_backups(executor: Executor, host: Host, unit: str) -> list[dict[str, Any]]:
    return run_probe(executor, host, "unitfile", stdin={"action": "list", "backup_root": backup_root(unit)})


def restore_spec(unit: str, backup_id: str) -> dict[str, Any]:
    return {"action": "restore", "unit": unit, "unit_path": unit_path(unit), "env_path": env_path(unit),
            "backup_root": backup_root(unit), "backup_id": backup_id}


def restore(executor: Executor, inventory: Inventory, host: Host, unit: str, backup_id: str | None = None,
            *, progress: Callable[[str], None] = lambda m: None, deadline_s: float = 300.0) -> dict[str, Any]:
    """Restore backup `backup_id` (default: newest) of unit on host; returns a report (raises on failure)."""
    backups = list_backups(executor, host, unit)
    if not backups:
        raise UsageError(f"no backups of {unit} on {host.name}", fix="nothing to roll back to")
    if backup_id is None:
        chosen = backups[-1]
    else:
        chosen = next((b for b in backups if b["id"] == backup_id), None)
        if chosen is None:
            raise UsageError(f"no backup {backup_id!r} of {unit} on {host.name}",
                             fix=f"known: {', '.join(b['id'] for b in backups)}")
    meta = chosen["meta"]
    started = time.monotonic()
    report: dict[str, Any] = {"host": host.name, "unit": unit, "backup_id": chosen["id"], "meta": meta,
                              "restarted": [], "health": None}
    progress(f"restoring {unit} from backup {chosen['id']}")
    # Stop the current unit first: the restored one may be absent, or use the same port.
    executor.run(host, ["systemctl", "stop", unit], timeout=120)
    out = run_probe(executor, host, "unitfile", stdin=restore_spec(unit, chosen["id"]))
    report["files"] = {"before": out["before"], "after": out["after"]}
    if out["daemon_reload"]["rc"] != 0:
        raise StepFailed(f"daemon-reload failed on {host.name}: {out['daemon_reload']['stderr']}")
    if meta.get("unit_existed"):
        executor.run(host, ["systemctl", "reset-failed", unit], timeout=60)
        result = executor.run(host, ["systemctl", "restart", unit], timeout=120)
        if not result.ok:
            raise StepFailed(f"restarting the restored {unit} failed on {host.name}: {result.stderr.strip()[-200:]}")
        report["restarted"].append(unit)
        service = next((s for s in host.services if s.unit == unit), None)
        if service and service.port:
            report["health"] = wait_healthy(executor, host, unit, service.port, service.health or "/health",
                                            deadline_s, progress=progress)
    else:
        executor.run(host, ["systemctl", "disable", unit], timeout=60)
        executor.run(host, ["systemctl", "reset-failed", unit], timeout=60)
        report["removed"] = True
    for other in meta.get("restart_after_rollback") or []:
        progress(f"starting {other} again")
        result = executor.run(host, ["systemctl", "start", other], timeout=120)
        if not result.ok:
            raise StepFailed(f"starting {other} again failed on {host.name}: {result.stderr.strip()[-200:]}")
        report["restarted"].append(other)
    for other in meta.get("restart_after_rollback") or []:
        service = next((s for s in host.services if s.unit == other), None)
        if service and service.port:
            report.setdefault("others", {})[other] = wait_healthy(executor, host, other, service.port,
                                                                  service.health or "/health", 60, progress=progress)
        else:
            state = _settle(executor, host, other)
            if state != "active":
                raise StepFailed(f"{other} is {state} on {host.name} after the rollback")
    report["seconds"] = round(time.monotonic() - started, 2)
    return report


def rollback_command(executor: Executor, inventory: Inventory, host: Host, unit: str, backup_id: str | None,
                     progress: Callable[[str], None]) -> dict[str, Any]:
    """`ddops rollback`: restore, and record the attempt in the host's history, failed ones too."""
    t0 = time.monotonic()
    try:
        report = restore(executor, inventory, host, unit, backup_id, progress=progress)
    except UsageError:
        raise  # nothing was attempted (no such backup): nothing to record
    except DdopsError as exc:
        history.append(executor, host, {"kind": "rollback", "unit": unit, "outcome": "failed",
                                        "backup_id": backup_id, "error": exc.line(),
                                        "wall_s": round(time.monotonic() - t0, 2)})
        raise
    history.append(executor, host, {"kind": "rollback", "unit": unit, "outcome": "ok",
                                    "backup_id": report["backup_id"], "restarted": report["restarted"],
                                    "removed": report.get("removed", False), "wall_s": report["seconds"]})
    return report


def undo(executor: Executor, inventory: Inventory, host: Host, operations: list[Operation], *,
         retrying: Retrying, progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Replay a pivot's undo operations, newest first. A restore puts back the unit and restarts what its
    backup names (`restarts`), so a later start of one of those is not repeated; each undo is retried
    while the host is briefly unreachable. Returns the restore's report, or the units started again."""
    covered = {u for op in operations if "restore" in op.data for u in op.data.get("restarts", ())}
    report: dict[str, Any] = {"restarted": []}
    for op in reversed(operations):
        if "restore" in op.data:
            restored = retrying(restore, executor, inventory, host, op.data["unit"], op.data["restore"],
                                progress=progress)
            report = {**restored, "restarted": restored["restarted"] + report["restarted"]}
        elif "start" in op.data and op.data["start"] not in covered:
            unit = op.data["start"]
            progress(f"starting {unit} again")
            retrying(lambda u=unit: executor.run(host, ["systemctl", "start", u], timeout=120).check(f"starting {u}"))
            report["restarted"].append(unit)
    return report


def _settle(executor: Executor, host: Host, unit: str, wait_s: float = 3.0) -> str:
    """The unit's state after it had a moment to crash (a unit that dies at once is not 'active')."""
    time.sleep(wait_s)
    result = executor.run(host, ["systemctl", "is-active", unit], timeout=30)
    return result.stdout.strip() or "unknown"

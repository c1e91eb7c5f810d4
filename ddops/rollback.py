"""Rollback: put a backed-up unit (or its absence) back, restart what the pivot stopped, health-check.

Used automatically by a pivot whose gate failed, and by `ddops rollback`.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from .errors import StepFailed, UsageError
from .executor import Executor
from .inventory import Host, Inventory
from .steps.base import backup_root, run_probe, unit_path
from .steps.health import wait_healthy


def env_path(unit: str) -> str:
    return f"/etc/ddops/{unit.removesuffix('.service')}.env"


def list_backups(executor: Executor, host: Host, unit: str) -> list[dict[str, Any]]:
    return run_probe(executor, host, "unitfile", stdin={"action": "list", "backup_root": backup_root(unit)})


def restore_spec(unit: str, backup_id: str) -> dict[str, Any]:
    return {"action": "restore", "unit": unit, "unit_path": unit_path(unit), "env_path": env_path(unit),
            "backup_root": backup_root(unit), "backup_id": backup_id}


class _Ctx:
    """The little of a PivotRun that the health gate needs."""

    def __init__(self, executor: Executor, progress: Callable[[str], None]) -> None:
        self.executor, self.progress = executor, progress


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
    ctx = _Ctx(executor, progress)
    if meta.get("unit_existed"):
        executor.run(host, ["systemctl", "reset-failed", unit], timeout=60)
        result = executor.run(host, ["systemctl", "restart", unit], timeout=120)
        if not result.ok:
            raise StepFailed(f"restarting the restored {unit} failed on {host.name}: {result.stderr.strip()[-200:]}")
        report["restarted"].append(unit)
        service = next((s for s in host.services if s.unit == unit), None)
        if service and service.port:
            report["health"] = wait_healthy(ctx, host, unit, service.port, service.health or "/health", deadline_s)
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
            report.setdefault("others", {})[other] = wait_healthy(ctx, host, other, service.port,
                                                                  service.health or "/health", 60)
        else:
            state = _settle(executor, host, other)
            if state != "active":
                raise StepFailed(f"{other} is {state} on {host.name} after the rollback")
    report["seconds"] = round(time.monotonic() - started, 2)
    return report


def _settle(executor: Executor, host: Host, unit: str, wait_s: float = 3.0) -> str:
    """The unit's state after it had a moment to crash (a unit that dies at once is not 'active')."""
    time.sleep(wait_s)
    result = executor.run(host, ["systemctl", "is-active", unit], timeout=30)
    return result.stdout.strip() or "unknown"

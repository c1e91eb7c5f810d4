"""Rollback: put a backed-up unit (or its absence) back, restart what the pivot stopped, health-check.

Used by `ddops rollback` (recorded in the host's history), and by a pivot that failed after it changed
something: `undo` replays what its journal recorded. A template unit's backup holds its replicas'
files and the balancer's config too; its replicas are restarted one at a time, each drained in HAProxy
first and readmitted once healthy, so the service stays up while it goes back.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from tenacity import Retrying

from . import balancer, history
from .errors import DdopsError, StepFailed, UsageError
from .executor import Executor
from .gates.health import wait_healthy
from .inventory import Host, Inventory
from .plan import Operation
from .paths import backup_root, env_path, replicas_manifest, unit_path
from .remote import run_probe, write_file_argv


def list_backups(executor: Executor, host: Host, unit: str) -> list[dict[str, Any]]:
    return run_probe(executor, host, "unitfile", stdin={"action": "list", "backup_root": backup_root(unit)})


def restore_spec(unit: str, backup_id: str) -> dict[str, Any]:
    return {"action": "restore", "unit": unit, "unit_path": unit_path(unit), "env_path": env_path(unit),
            "backup_root": backup_root(unit), "backup_id": backup_id}


def choose_backup(executor: Executor, host: Host, unit: str, backup_id: str | None) -> dict[str, Any]:
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
    return chosen


def restore(executor: Executor, inventory: Inventory, host: Host, unit: str, backup_id: str | None = None,
            *, progress: Callable[[str], None] = lambda m: None, deadline_s: float = 300.0,
            only: list[str] | None = None) -> dict[str, Any]:
    """Restore backup `backup_id` (default: newest) of unit on host; returns a report (raises on failure).
    For a template unit, `only` names the replicas to restart (None: every one that ran before)."""
    if "@." in unit:
        return restore_replicas(executor, host, unit, backup_id, only=only, progress=progress, deadline_s=deadline_s)
    chosen = choose_backup(executor, host, unit, backup_id)
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
    restart_others(executor, host, meta, report, progress)
    report["seconds"] = round(time.monotonic() - started, 2)
    return report


def restart_others(executor: Executor, host: Host, meta: dict[str, Any], report: dict[str, Any],
                   progress: Callable[[str], None]) -> None:
    """Start again what the pivot stopped (its backup names them) and check they serve."""
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


# -- replicas (a template unit behind HAProxy) ---------------------------------------------------------

def read_manifest(executor: Executor, host: Host, template: str) -> dict[str, Any] | None:
    """The replicas manifest the last install left on the host, or None."""
    result = executor.run(host, ["cat", replicas_manifest(template)], timeout=30)
    if not result.ok:
        return None
    try:
        return json.loads(result.stdout)
    except ValueError:
        return None


def is_active(executor: Executor, host: Host, unit: str) -> bool:
    return executor.run(host, ["systemctl", "is-active", unit], timeout=30).stdout.strip() in ("active", "activating",
                                                                                              "reloading")


def replace_replica(executor: Executor, host: Host, replica: dict[str, Any], manifest: dict[str, Any],
                    deadline_s: float, progress: Callable[[str], None]) -> dict[str, Any]:
    """Restart one replica without the service going away: drained first when the balancer runs,
    readmitted once healthy (and UP in HAProxy)."""
    bal = manifest["balancer"]
    in_balancer = is_active(executor, host, bal["unit"])
    out: dict[str, Any] = {"unit": replica["unit"]}
    if in_balancer:
        progress(f"draining {replica['unit']}")
        out["drain_s"] = balancer.call(executor, host, bal, "drain", [replica["server"]],
                                       timeout_s=bal.get("drain_timeout_s", 120))["waited_s"]
    executor.run(host, ["systemctl", "reset-failed", replica["unit"]], timeout=60)
    result = executor.run(host, ["systemctl", "restart", replica["unit"]], timeout=120)
    if not result.ok:
        raise StepFailed(f"restarting {replica['unit']} failed on {host.name}: {result.stderr.strip()[-200:]}")
    out["health"] = wait_healthy(executor, host, replica["unit"], replica["port"], manifest.get("health_path", "/health"),
                                 deadline_s, progress=progress)
    if in_balancer:
        ready = balancer.call(executor, host, bal, "ready", [replica["server"]], timeout_s=bal.get("ready_timeout_s", 60))
        if not ready["ok"]:
            raise StepFailed(f"HAProxy on {host.name} does not see {replica['unit']} UP after the rollback: "
                             f"{ready['states']}")
        out["readmit_s"] = ready["waited_s"]
    return out


def restore_replicas(executor: Executor, host: Host, template: str, backup_id: str | None, *,
                     only: list[str] | None, progress: Callable[[str], None], deadline_s: float) -> dict[str, Any]:
    """Put a template unit's files back (its replicas' env files, the balancer's config, the manifest),
    reload HAProxy if its config changed, stop replicas the backup did not run, and restart the ones it
    did (those in `only`, when given) one at a time."""
    chosen = choose_backup(executor, host, template, backup_id)
    meta = chosen["meta"]
    started = time.monotonic()
    report: dict[str, Any] = {"host": host.name, "unit": template, "backup_id": chosen["id"], "meta": meta,
                              "restarted": [], "health": None}
    progress(f"restoring {template} and its replicas from backup {chosen['id']}")
    current = read_manifest(executor, host, template)
    out = run_probe(executor, host, "unitfile", stdin=restore_spec(template, chosen["id"]))
    report["files"] = {"before": out["before"], "after": out["after"], "changed": out.get("changed", [])}
    if out["daemon_reload"]["rc"] != 0:
        raise StepFailed(f"daemon-reload failed on {host.name}: {out['daemon_reload']['stderr']}")
    restored = read_manifest(executor, host, template) if meta.get("unit_existed") else None
    was_running = set(meta.get("replicas_before") or [])
    keep = [r for r in (restored or {}).get("replicas", []) if r["unit"] in was_running]
    kept = {r["unit"] for r in keep}
    others = {r["unit"]: r for r in (current or {}).get("replicas", []) + (restored or {}).get("replicas", [])}
    for replica in others.values():
        if replica["unit"] not in kept and is_active(executor, host, replica["unit"]):
            progress(f"stopping {replica['unit']} (not running before)")
            executor.run(host, ["systemctl", "disable", "--now", replica["unit"]], timeout=120)
            report.setdefault("stopped", []).append(replica["unit"])
    bal = (restored or current or {}).get("balancer")
    if bal and bal["config"] in report["files"]["changed"] and is_active(executor, host, bal["unit"]):
        result = executor.run(host, ["systemctl", "reload", bal["unit"]], timeout=120)
        if not result.ok:
            raise StepFailed(f"reloading {bal['unit']} with the restored config failed on {host.name}: "
                             f"{result.stderr.strip()[-200:]}")
        report["balancer_reloaded"] = True
    if restored is None:
        report["removed"] = True
    report["replicas"] = {}
    for replica in keep:
        if only is not None and replica["unit"] not in only:
            continue
        report["replicas"][replica["unit"]] = replace_replica(executor, host, replica, restored, deadline_s, progress)
        report["restarted"].append(replica["unit"])
    if report["replicas"]:
        report["health"] = {"replicas": {u: r["health"] for u, r in report["replicas"].items()}}
    restart_others(executor, host, meta, report, progress)
    report["seconds"] = round(time.monotonic() - started, 2)
    return report


def reroll(executor: Executor, host: Host, template: str, units: list[str], *, progress: Callable[[str], None],
           deadline_s: float = 300.0) -> dict[str, Any]:
    """Restart replicas on the files in place (a rolling restart that changed no file, e.g. a new runtime
    release alone, has no backup to restore): one at a time, drained and readmitted."""
    manifest = read_manifest(executor, host, template)
    if manifest is None:
        raise StepFailed(f"no replicas manifest for {template} on {host.name}: cannot restart its replicas")
    report: dict[str, Any] = {"restarted": [], "replicas": {}}
    for replica in manifest["replicas"]:
        if replica["unit"] in units:
            report["replicas"][replica["unit"]] = replace_replica(executor, host, replica, manifest, deadline_s, progress)
            report["restarted"].append(replica["unit"])
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
    # Replicas a rolling restart replaced: a restore of their template restarts them (and only them) on
    # the restored files; without one, they are restarted on the files in place.
    rolled = {op.data["template"]: [] for op in operations if "roll_back" in op.data}
    for op in operations:
        if "roll_back" in op.data:
            rolled[op.data["template"]] += op.data["roll_back"]
    restored_templates = {op.data["unit"] for op in operations if "restore" in op.data}
    report: dict[str, Any] = {"restarted": []}
    # The runtime release first: every unit restarted below must start on the code it ran before.
    reinstalled = [op.data["reinstall"] for op in reversed(operations) if "reinstall" in op.data]
    for previous in reinstalled:
        retrying(reinstall, executor, host, previous, progress=progress)
    for op in reversed(operations):
        if "restore" in op.data:
            only = rolled.get(op.data["unit"], []) if "@." in op.data["unit"] else None
            restored = retrying(restore, executor, inventory, host, op.data["unit"], op.data["restore"],
                                progress=progress, only=only)
            report = {**restored, "restarted": restored["restarted"] + report["restarted"]}
        elif "roll_back" in op.data and op.data["template"] not in restored_templates:
            again = retrying(reroll, executor, host, op.data["template"], op.data["roll_back"], progress=progress)
            report = {**report, "replicas": {**report.get("replicas", {}), **again["replicas"]},
                      "restarted": again["restarted"] + report["restarted"]}
        elif "start" in op.data and op.data["start"] not in covered:
            unit = op.data["start"]
            progress(f"starting {unit} again")
            retrying(lambda u=unit: executor.run(host, ["systemctl", "start", u], timeout=120).check(f"starting {u}"))
            report["restarted"].append(unit)
    if reinstalled:
        report["reinstalled"] = reinstalled[-1]["release"]
    return report


def reinstall(executor: Executor, host: Host, previous: dict[str, str],
              progress: Callable[[str], None] = lambda m: None) -> None:
    """Put the runtime release that a pivot replaced back into the venv, and its record as it was."""
    progress(f"reinstalling ddtree-runtime {previous['release']} (the release before the pivot)")
    executor.run(host, [previous["python"], "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
                        "--force-reinstall", "-q", previous["wheel"]], timeout=600).check(
        f"reinstalling ddtree-runtime {previous['release']} from {previous['wheel']}")
    executor.run(host, write_file_argv(previous["record"]), stdin=previous["record_text"]).check(
        "restoring the runtime release record")


def _settle(executor: Executor, host: Host, unit: str, wait_s: float = 3.0) -> str:
    """The unit's state after it had a moment to crash (a unit that dies at once is not 'active')."""
    time.sleep(wait_s)
    result = executor.run(host, ["systemctl", "is-active", unit], timeout=30)
    return result.stdout.strip() or "unknown"

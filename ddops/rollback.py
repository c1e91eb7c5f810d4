"""Rollback: the pivot run backwards. Put back what the pivot changed, bring back what it stopped or
restarted, and hold what is restored to the same gates as a deploy.

`undo` applies a journal's undos (ddops.undo: typed, one `apply` each) newest first, without knowing
their kinds. Each puts back what it can at once and asks the `UndoContext` to bring back what must run
again; once every undo has applied, the rollback restarts the restored units and cycles the replicas
(ddops.cycle: drain, restart, gate, readmit, as the rolling redeploy does), gating each with health and
then smoke, then starts again what the pivot stopped. The gates hold a restored unit to the checks of
the profile that installed it (the history record of that pivot, found by the unit file's checksum);
a unit no pivot recorded gets its health check alone, and the report says so. `--skip-smoke` may skip
the smoke test, never the health check.

Used by a pivot that failed after it changed something, and by `ddops rollback` (one restore, recorded
in the host's history).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tenacity import Retrying, stop_after_attempt

from . import history, hostlock
from .backups import choose_backup, is_active, read_manifest
from .cycle import Balanced, cycle
from .errors import DdopsError, StepFailed, UsageError
from .executor import Executor
from .gates import GateFailed, GateResult
from .gates.health import HealthGate
from .gates.smoke import SmokeGate
from .inventory import Host, Inventory
from .paths import HISTORY_PATH, unit_path
from .plan import Checks, Undo
from .profile import Replica
from .remote import check
from .undo import RestoreBackup, RollBackReplicas, from_record

HISTORY_SCAN = 500          # the history lines searched for the pivot that installed a restored unit
OTHERS_DEADLINE_S = 60.0    # how long a unit started again (not restored) may take to answer /health


def unit_sha256(executor: Executor, host: Host, unit: str) -> str | None:
    out = executor.run(host, ["sha256sum", "--", unit_path(unit)], timeout=30).stdout.split()
    return out[0] if out and len(out[0]) == 64 else None


def recorded_checks(executor: Executor, host: Host, unit: str, sha256: str | None) -> Checks | None:
    """The checks of the newest successful pivot that installed `unit` with exactly this file."""
    if sha256 is None:
        return None
    lines = executor.run(host, ["tail", "-n", str(HISTORY_SCAN), "--", HISTORY_PATH], timeout=30).stdout.splitlines()
    for line in reversed(lines):
        try:
            record = json.loads(line)
            if (record.get("kind"), record.get("outcome"), record.get("unit"), record.get("unit_sha256")) == (
                    "pivot", "ok", unit, sha256) and record.get("checks"):
                return Checks.from_record(record["checks"])
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return None


@dataclass
class Restored:
    """The gates' view of what a rollback brought back: these units, held to these checks."""

    executor: Executor
    host: Host
    checks: Checks
    secrets: dict[str, str]
    progress: Callable[[str], None]
    only: tuple[Replica, ...]

    def serving(self) -> tuple[Replica, ...]:
        return self.only

    def check_interrupt(self) -> None:
        """A rollback is not stopped half-way by a Ctrl-C (the flow already stopped for it)."""


@dataclass
class UndoContext:
    """What an undo applies with: the host, the report it adds to, and what it asks to bring back once
    every undo has applied: restored units and replicas (restarted and gated), units to start again."""

    executor: Executor
    inventory: Inventory
    host: Host
    retrying: Retrying
    progress: Callable[[str], None] = lambda message: None
    secrets: dict[str, str] = field(default_factory=dict)
    skip_smoke: bool = False
    report: dict[str, Any] = field(default_factory=lambda: {"restarted": []})
    restored: dict[str, str | None] = field(default_factory=dict)   # unit -> sha256 of its restored file
    known: dict[str, Checks] = field(default_factory=dict)          # unit -> the checks found for it
    restarts: list[tuple[str, str]] = field(default_factory=list)   # (unit or template, unit), in order
    starts: dict[str, bool] = field(default_factory=dict)           # unit -> check that it serves once started

    def restart(self, unit: str) -> None:
        """Restart a restored unit on its restored files, then gate it."""
        if (unit, unit) not in self.restarts:
            self.restarts.append((unit, unit))

    def cycle(self, template: str, unit: str) -> None:
        """Return one replica of `template` through the replica cycle, gated on the way."""
        if (template, unit) not in self.restarts:
            self.restarts.append((template, unit))

    def start_again(self, unit: str, checked: bool = False) -> None:
        """Start a unit the pivot stopped; `checked`: then see that it serves (or at least stays up)."""
        self.starts[unit] = self.starts.get(unit, False) or checked

    # -- bringing back ---------------------------------------------------------------------------

    def bring_back(self) -> None:
        for template, unit in self.restarts:
            if template == unit:
                self.retrying(self.restart_unit, unit)
            else:
                self.retrying(self.cycle_replica, template, unit)
        for unit in self.starts:
            if self.retrying(is_active, self.executor, self.host, unit):
                self.report.setdefault("running", []).append(unit)   # never stopped, or already started again
                continue
            self.progress(f"starting {unit} again")
            self.retrying(lambda u=unit: check(self.executor.run(self.host, ["systemctl", "start", u], timeout=120),
                                               f"starting {u} again"))
            self.report["restarted"].append(unit)
        for unit, checked in self.starts.items():
            if checked:
                self.retrying(self.check_started, unit)

    def restart_unit(self, unit: str) -> None:
        self.progress(f"restarting the restored {unit}")
        self.executor.run(self.host, ["systemctl", "reset-failed", unit], timeout=60)
        check(self.executor.run(self.host, ["systemctl", "restart", unit], timeout=120), f"restarting the restored {unit}")
        self.report["restarted"].append(unit)
        service = next((s for s in self.host.services if s.unit == unit), None)
        checks = self.checks_for(unit, lambda: Checks.health_only(service and service.port,
                                                                   (service and service.health) or "/health", 300.0))
        if checks.port is None:
            self.settled(unit)
            return
        self.gate([Replica(0, unit, checks.port, ())], checks, self.report,
                  lambda name, title: self.progress(f"{title.lower()} on {unit}"))

    def cycle_replica(self, template: str, unit: str) -> None:
        manifest = read_manifest(self.executor, self.host, template)
        member = next((r for r in (manifest or {}).get("replicas", []) if r["unit"] == unit), None)
        if member is None:
            raise StepFailed(f"{unit} is not in the replicas manifest of {template} on {self.host.name}: "
                             "cannot restart it")
        replica = Replica(member["index"], unit, member["port"], tuple(member.get("gpus", ())))
        checks = self.checks_for(template, lambda: Checks.health_only(None, manifest.get("health_path", "/health"), 300.0))
        bal = manifest["balancer"]
        balanced = Balanced.of(bal) if is_active(self.executor, self.host, bal["unit"]) else None
        out: dict[str, Any] = {"unit": unit}
        self.report.setdefault("replicas", {})[unit] = out
        cycle(self.executor, self.host, [replica], balanced=balanced, record=out, progress=self.progress,
              label=f"{unit}: ", gate=lambda batch, at: self.gate(batch, checks, out, at))
        self.report["restarted"].append(unit)
        self.report["health"] = {"replicas": {u: r["health"] for u, r in self.report["replicas"].items()
                                              if "health" in r}}

    def check_started(self, unit: str) -> None:
        service = next((s for s in self.host.services if s.unit == unit), None)
        if service is None or not service.port:
            self.settled(unit)
            return
        checks = Checks.health_only(service.port, service.health or "/health", OTHERS_DEADLINE_S)
        self.report.setdefault("others", {})[unit] = HealthGate().check(
            Restored(self.executor, self.host, checks, self.secrets, self.progress,
                     (Replica(0, unit, service.port, ()),))).data

    def settled(self, unit: str) -> None:
        state = _settle(self.executor, self.host, unit)
        if state != "active":
            raise StepFailed(f"{unit} is {state} on {self.host.name} after the rollback")

    # -- the gates on the way back ---------------------------------------------------------------

    def checks_for(self, unit: str, unrecorded: Callable[[], Checks]) -> Checks:
        """The checks of the profile that installed `unit` as it is now (looked up once per rollback)."""
        if unit not in self.known:
            sha256 = self.restored.get(unit) or unit_sha256(self.executor, self.host, unit)
            self.known[unit] = recorded_checks(self.executor, self.host, unit, sha256) or unrecorded()
        return self.known[unit]

    def gate(self, batch: Sequence[Replica], checks: Checks, into: dict[str, Any],
             at: Callable[[str, str], None]) -> None:
        """Health, then smoke where the restored profile has one (and --skip-smoke was not given). What
        each measured goes `into` the report (a failed gate's too: `health`, `smoke`), and `checked`
        says, per unit, what passed, failed or was not run."""
        view = Restored(self.executor, self.host, checks, self.secrets, self.progress, tuple(batch))
        checked = self.report.setdefault("checked", {})
        units = [r.unit for r in batch]
        for unit in units:
            checked[unit] = {"profile": checks.profile}
        gates: list[tuple[Any, str | None]] = [(HealthGate(), None), (SmokeGate(), self.smoke_skipped(checks))]
        for gate, skipped in gates:
            if skipped is not None:
                for unit in units:
                    checked[unit][gate.name] = f"not run: {skipped}"
                continue
            at(gate.name, gate.title)
            try:
                result: GateResult = gate.check(view)
            except DdopsError as exc:
                if isinstance(exc, GateFailed):
                    into[gate.name] = exc.data
                for unit in units:
                    checked[unit][gate.name] = "failed"
                raise
            # a replica's health is its own wait's figures (what the plain unit's gate returns)
            into[gate.name] = result.data["replicas"][units[0]] if gate.name == "health" and checks.replicated \
                else result.data
            for unit in units:
                checked[unit][gate.name] = "passed"

    def smoke_skipped(self, checks: Checks) -> str | None:
        if self.skip_smoke:
            return "--skip-smoke"
        if checks.smoke is None:
            return "no pivot recorded the restored unit's profile (its smoke test is unknown)"
        return None


def undo(executor: Executor, inventory: Inventory, host: Host, undos: list[Undo], *, retrying: Retrying,
         progress: Callable[[str], None] = lambda m: None, secrets: dict[str, str] | None = None,
         skip_smoke: bool = False, report: dict[str, Any] | None = None,
         lease: hostlock.LeaseKeeper | None = None) -> dict[str, Any]:
    """Apply a pivot's undos newest first (those marked `first` before the rest), then bring back and
    gate what they asked for. Each is retried while the host is briefly unreachable. Returns the report
    (`report`, when given, is filled as it goes: a rollback that fails still says what it did)."""
    report = {} if report is None else report
    report.setdefault("restarted", [])
    ctx = UndoContext(executor, inventory, host, retrying, progress, secrets or {}, skip_smoke, report)
    newest_first = list(reversed(undos))
    for step in [u for u in newest_first if u.first] + [u for u in newest_first if not u.first]:
        if lease is not None:
            lease.check()   # a run whose lock was broken changes nothing more
        retrying(step.apply, ctx)
    ctx.bring_back()
    return report


def rollback_command(executor: Executor, inventory: Inventory, host: Host, unit: str, backup_id: str | None,
                     progress: Callable[[str], None], *, skip_smoke: bool = False,
                     break_lock: bool = False) -> dict[str, Any]:
    """`ddops rollback`, under the host's pivot lock (as a pivot holds it). An unfinished pivot on the
    host (its journal of intent: crashed, killed, its control machine gone) is taken back with the undos
    it recorded before it changed anything, to the state from before it. Else one backup is restored
    (every replica of a template). What is restored is gated, and the attempt recorded in the host's
    history, failed ones too. A rollback right after another has nothing to do and says so.

    What to do is read first, without the lock: a rollback with nothing to do (no backups, no such
    backup, a damaged one, the last rollback already done) says so and leaves the host untouched, its
    lock file and /var/lib/ddops included. Under the lock it is read again (a pivot may have run since)."""
    t0 = time.monotonic()
    report: dict[str, Any] = {}
    broken = hostlock.break_if_dead(executor, host) if break_lock else None
    if broken is not None:
        report["broke_lock"] = hostlock.describe(broken) + f" ({broken['dead']})"

    def what_to_undo() -> tuple[dict[str, Any] | None, list[Undo] | None]:
        unfinished = hostlock.journal(executor, host, "journal-read")["journal"]
        return unfinished, rollback_undos(executor, host, unit, backup_id, unfinished, report)

    if what_to_undo()[1] is None:
        report["seconds"] = round(time.monotonic() - t0, 2)
        return report
    token = hostlock.acquire(executor, host, f"ddops rollback --host {host.name}")
    try:
        with hostlock.LeaseKeeper(executor, host, token) as lease:
            unfinished, undos = what_to_undo()
            if undos is None:
                report["seconds"] = round(time.monotonic() - t0, 2)
                return report
            try:
                undo(executor, inventory, host, undos, retrying=Retrying(stop=stop_after_attempt(1), reraise=True),
                     progress=progress, skip_smoke=skip_smoke, report=report, lease=lease)
                if unfinished is not None:
                    hostlock.journal(executor, host, "journal-close", token)
            except UsageError:
                raise  # nothing was attempted (no such backup, or a damaged one): nothing to record
            except DdopsError as exc:
                history.append(executor, host, {"kind": "rollback", "unit": unit, "outcome": "failed",
                                                "backup_id": report.get("backup_id", backup_id), "error": exc.line(),
                                                "unfinished": report.get("unfinished"),
                                                "checked": report.get("checked"),
                                                "wall_s": round(time.monotonic() - t0, 2)})
                raise
    finally:
        hostlock.release(executor, host, token)
    report["seconds"] = round(time.monotonic() - t0, 2)
    history.append(executor, host, {"kind": "rollback", "unit": unit, "outcome": "ok",
                                    "backup_id": report.get("backup_id"), "restarted": report["restarted"],
                                    "unfinished": report.get("unfinished"), "saved_as": report.get("saved_as"),
                                    "removed": report.get("removed", False), "checked": report.get("checked"),
                                    "wall_s": report["seconds"]})
    return report


def rollback_undos(executor: Executor, host: Host, unit: str, backup_id: str | None,
                   unfinished: dict[str, Any] | None, report: dict[str, Any]) -> list[Undo] | None:
    """What `ddops rollback` applies: an unfinished pivot's recorded undos, else the restore of one
    backup; None when the newest backup was restored by the last rollback (nothing to do)."""
    if unfinished is not None:
        if backup_id is not None:
            raise UsageError(f"{host.name} has an unfinished pivot ({history.unfinished_words(unfinished)}): "
                             "it is rolled back first, to the state from before it",
                             fix=f"run ddops rollback --host {host.name} without --to")
        report["unfinished"] = {k: unfinished.get(k) for k in ("profile", "unit", "started_at", "step", "user",
                                                                "control_host", "pid")}
        return [from_record(r) for r in unfinished.get("undo") or []]
    records = history.read(executor, host)
    if backup_id is None:
        last = last_change(records, unit)
        if last is not None and last.get("kind") == "rollback" and last.get("outcome") == "ok":
            report.update(unchanged=True, backup_id=last.get("backup_id"), restarted=[],
                          rolled_back_at=last.get("time"))
            return None
    chosen = choose_backup(executor, host, unit, backup_id)["id"]   # a damaged one is refused here
    restore = RestoreBackup(unit, chosen, every_replica=True)
    # the pivot that took this backup recorded its way back: the release before it, what it stopped
    took = next((r for r in reversed(records) if r.get("kind") == "pivot" and r.get("backup_id") == chosen
                 and r.get("way_back")), None)
    if took is None:
        return [restore]
    # the restore cycles every replica the backup ran, once each and in order: the pivot's own undos of
    # its rolling batches (newest batch first) would only cycle them again, backwards
    way_back = [u for u in map(from_record, took["way_back"]) if not (isinstance(u, RollBackReplicas)
                                                                    and u.template == unit)]
    return [restore if isinstance(u, RestoreBackup) and u.unit == unit else u for u in way_back]


def last_change(records: list[dict[str, Any]], unit: str) -> dict[str, Any] | None:
    """The newest pivot or rollback of `unit` in a host's history."""
    return next((r for r in reversed(records) if r.get("unit") == unit and r.get("kind") in ("pivot", "rollback")),
                None)


def _settle(executor: Executor, host: Host, unit: str, wait_s: float = 3.0) -> str:
    """The unit's state after it had a moment to crash (a unit that dies at once is not 'active')."""
    time.sleep(wait_s)
    result = executor.run(host, ["systemctl", "is-active", unit], timeout=30)
    return result.stdout.strip() or "unknown"

"""A pivot's report: what happened, the outcome in words, and the exit code. One object feeds the
history record, `--json` and the summary, so the three never disagree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, DdopsError, HostUnreachable, Refused
from . import kernels
from .hostlock import LockLost
from .plan import Checks, Interrupted, Journal, StepState
from .profile import Profile

EXIT_INTERRUPTED = 130
SUCCESS = ("ok", "unchanged", "dry-run", "aborted")


@dataclass
class Report:
    profile: Profile
    dry_run: bool
    steps: list[StepState]
    journal: Journal = field(default_factory=Journal)
    gate_names: tuple[str, ...] = ()        # which rows are gates: a failed gate changed nothing itself
    release: str | None = None
    pool: dict[str, Any] | None = None      # what the KV pool will hold on the GPU (ddops.capacity)
    accepted_gpu_faults: list[str] = field(default_factory=list)   # what --accept-gpu-faults let through
    outcome: str | None = None
    state: str | None = None
    error: DdopsError | None = None
    failed_step: str | None = None
    interrupted: str | None = None
    interrupted_during: str | None = None   # the step that was running when the signal came
    rolled_back: bool | None = None        # None: no rollback was tried
    rollback: dict[str, Any] | None = None   # what the rollback did
    rollback_error: str | None = None
    signals: int = 0
    wall_s: float = 0.0
    way_back: list[dict[str, Any]] = field(default_factory=list)   # the undos to the state before it, as data
    kernel_seed: kernels.SeedDecision | None = None    # what the plan does with the Triton cache (ddtree only)
    kernel_harvest: dict[str, Any] | None = None        # the harvest after the gates passed

    def kernel_cache(self) -> dict[str, Any] | None:
        if self.kernel_seed is None:
            return None
        return kernels.report(self.kernel_seed, self.journal.kernels.get("seed"), self.kernel_harvest,
                              dry_run=self.dry_run)

    @property
    def changed(self) -> bool:
        return bool(self.journal.changed)

    def gates(self) -> dict[str, Any]:
        unit = {"unit": self.journal.unit_files} if self.journal.unit_files else {}
        return {**unit, **self.journal.gates}

    def conclude(self, no_rollback: bool) -> None:
        """Set outcome and state from what happened."""
        self.outcome, self.state = outcome(self, no_rollback)
        if self.interrupted and self.error is not None:
            during = self.interrupted_during or self.failed_step
            self.state = f"interrupted by {self.interrupted} during {during}; {self.state}"

    @property
    def exit_code(self) -> int:
        if self.outcome in SUCCESS:
            return EXIT_OK
        if self.interrupted and isinstance(self.error, Interrupted):
            return EXIT_INTERRUPTED
        if isinstance(self.error, HostUnreachable) and not self.changed:
            return EXIT_UNREACHABLE
        return EXIT_FAILED

    def history_record(self) -> dict[str, Any]:
        """The line appended to the host's history (history.append scrubs anything secret-looking)."""
        unit_files = self.journal.unit_files
        return {"kind": "pivot", "profile": self.profile.name, "unit": self.profile.unit, "outcome": self.outcome,
                "state": self.state, "release": self.release, "backup_id": self.journal.backup_id,
                "unit_sha256": unit_files.get("after", {}).get("unit"),
                "unit_sha256_before": unit_files.get("before", {}).get("unit"),
                "steps": [{"name": s.name, "status": s.status, "seconds": s.seconds, "summary": s.summary}
                          for s in self.steps if s.name != "record"],
                "gates": self.journal.gates,
                "training": self.journal.training, "stopped_units": self.journal.stopped_units,
                "error": self.error.line() if self.error else None, "wall_s": self.wall_s,
                # what the gates held this unit to: a later rollback to these files is held to the same
                "checks": Checks.of(self.profile).record(),
                # what `ddops rollback` to this pivot's backup applies: the release before it, what it stopped
                "way_back": self.way_back,
                **({"rolling": self.journal.rolling} if self.journal.rolling else {}),
                **({"kernel_cache": self.kernel_cache()} if self.kernel_seed else {}),
                **({"accepted_gpu_faults": self.accepted_gpu_faults} if self.accepted_gpu_faults else {})}

    def as_json(self) -> dict[str, Any]:
        """What `--json` prints and the summary reads."""
        out: dict[str, Any] = {"profile": self.profile.name, "host": self.profile.host, "dry_run": self.dry_run,
                               "outcome": self.outcome, "state": self.state}
        if self.failed_step is not None:
            out["failed_step"] = self.failed_step
            if self.failed_step != "preflight":
                out["error_detail"] = self.error.line() if self.error else None
        if self.rollback is not None:
            out["rollback"] = self.rollback
        if self.rolled_back is not None:
            out["rolled_back"] = self.rolled_back
        if self.rollback_error is not None:
            out["rollback_error"] = self.rollback_error
        if self.signals:
            out["signals"] = self.signals
        if self.pool is not None:
            out["pool"] = self.pool
        if self.journal.rolling:
            out["rolling"] = self.journal.rolling
        if self.accepted_gpu_faults:
            out["accepted_gpu_faults"] = self.accepted_gpu_faults
        if self.kernel_seed is not None:
            out["kernel_cache"] = self.kernel_cache()
        out.update(interrupted=self.interrupted, error=self.error.line() if self.error else None,
                   release=self.release, backup_id=self.journal.backup_id, changed=sorted(self.journal.changed),
                   stopped_units=self.journal.stopped_units, training=self.journal.training, gates=self.gates(),
                   wall_s=self.wall_s,
                   steps=[{"name": s.name, "status": s.status, "seconds": s.seconds, "summary": s.summary,
                           "changes": [op.what for op in s.changes],
                           **({"figures": [op.figures for op in s.changes if op.figures]}
                              if any(op.figures for op in s.changes) else {})} for s in self.steps],
                   exit_code=self.exit_code)
        return out


def outcome(report: Report, no_rollback: bool) -> tuple[str, str]:
    """The host's state in one word and one sentence (README: OK, UNCHANGED, REFUSED, FAILED, ROLLED-BACK, LOCK-LOST, ...)."""
    p, journal = report.profile, report.journal
    if report.error is None:
        if not report.changed:
            return "unchanged", f"{p.unit} on {p.host} was already in place; nothing restarted; gates passed"
        return "ok", f"{p.unit} on {p.host} is active and healthy ({p.name})"
    if isinstance(report.error, Refused) and not report.changed:
        # not a broken pivot: one that declined, by the run's own limits, before its first change
        return "refused", (f"the {report.failed_step} step refused: nothing was changed on {p.host}; "
                           f"{p.unit} is as it was")
    if not report.changed:
        return "failed", f"nothing was changed on {p.host}; " + (
            f"{p.unit} is as it was" if report.failed_step in report.gate_names else "")
    if isinstance(report.error, LockLost):
        return "lock-lost", lock_lost_state(report)
    if report.rolled_back and any(not b["ok"] for b in journal.rolling):
        return "rolled-back", rolling_state(report)
    if report.rolled_back:
        rep = report.rollback or {}
        what = (f"{p.unit} removed (it did not exist before)" if rep.get("removed")
                else f"previous {p.unit} restored and healthy" if journal.backup_id else f"{p.unit} untouched")
        again = ", ".join(rep.get("restarted", []))
        return "rolled-back", (f"rolled back on {p.host}: {what}" + (f"; running again: {again}" if again else "")
                               + smoke_passed(rep))
    if no_rollback:
        return "failed", (f"--no-rollback: {p.host} is left as the failed pivot made it "
                          f"(backup {journal.backup_id or 'none'}; `ddops rollback --host {p.host}` restores it)")
    why = (report.rollback_error or "").split("\n")[0]
    return "rollback-failed", (f"ROLLBACK FAILED on {p.host}: needs a human ({why + '; ' if why else ''}"
                               f"backup {journal.backup_id or 'none'}; "
                               f"units stopped by the pivot: {', '.join(journal.stopped_units) or 'none'}"
                               + (f"; {checked_words(report.rollback)}" if (report.rollback or {}).get("checked")
                                  else "") + ")")


def lock_lost_state(report: Report) -> str:
    """A run that lost its lock after it changed something: it stopped there and rolled nothing back (the
    host is the other run's now). What it changed, what it stopped, and the way back once that run is done."""
    p, journal = report.profile, report.journal
    stopped = f"; stopped {', '.join(journal.stopped_units)}" if journal.stopped_units else ""
    return (f"LOCK LOST on {p.host}: another run took the lock after this one changed {', '.join(journal.changed)}"
            f"{stopped}; this run stopped there and rolled nothing back, leaving the host to that run; its journal "
            f"of intent stays on {p.host}: once that run is done, if `ddops status --limit {p.host}` still shows "
            f"this pivot unfinished, `ddops rollback --host {p.host}` restores the state from before it")


def rolling_state(report: Report) -> str:
    """A rolled-back rolling restart in words: which batch failed, what was returned, what kept serving."""
    p, rolling = report.profile, report.journal.rolling
    failed = next(b for b in rolling if not b["ok"])
    touched = {u for b in rolling for u in b["replicas"]}
    untouched = [r.unit for r in p.replicas.members if r.unit not in touched]
    back = ", ".join(u for b in rolling for u in b["replicas"])
    return (f"rolled back on {p.host}: batch {failed['batch']} ({', '.join(failed['replicas'])}) failed at "
            f"{failed.get('failed_at')}; {back} returned to the previous release and healthy"
            + (f"; {', '.join(untouched)} never stopped serving" if untouched else "") + smoke_passed(report.rollback))


def checked_words(rollback: dict[str, Any]) -> str:
    """What the gates on the way back found, per gate: where it passed, failed or was not run (and why)."""
    by_gate: dict[str, dict[str, list[str]]] = {}
    for unit, gates in rollback.get("checked", {}).items():
        for gate, verdict in gates.items():
            if gate != "profile":
                by_gate.setdefault(gate, {}).setdefault(verdict, []).append(unit)
    return "; ".join(f"{gate} {verdict} on {', '.join(units)}" for gate, verdicts in by_gate.items()
                     for verdict, units in verdicts.items())


def smoke_passed(rollback: dict[str, Any] | None) -> str:
    """The state's words for a smoke test that ran on what a rollback restored (and passed)."""
    units = [u for u, gates in (rollback or {}).get("checked", {}).items() if gates.get("smoke") == "passed"]
    return f"; smoke passed on {', '.join(units)}" if units else ""

"""The pivot: preflight -> plan every step -> show plan and unit diff -> lock -> apply -> gates ->
record; automatic rollback when a step fails after something changed.

The outcome is one of: ok, unchanged (already in place, gates passed), dry-run, failed (nothing
changed), rolled-back (the previous state is back and healthy), rollback-failed (the host needs a
human: the summary says what is where).
"""

from __future__ import annotations

import os
import secrets as _secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential, wait_random

from . import history
from .errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, ConfigError, DdopsError, HostUnreachable, StepFailed
from .executor import CommandTimeout
from .progress import HEARTBEAT_S, NOTE_S, Activity
from .rollback import restore
from .steps.base import HISTORY_PATH, LOCK_PATH, Change, Interrupted, PivotRun, run_probe
from .steps.deps import DepsStep
from .steps.health import HealthStep
from .steps.preflight import PreflightStep
from .steps.ship import ShipStep
from .steps.smoke import SmokeStep
from .steps.start import StartStep
from .steps.sync import SyncStep
from .steps.training import TrainingStep
from .steps.unit import UnitStep, render

ICONS = {"pending": ("·", "dim"), "running": ("▶", "bold yellow"), "done": ("✔", "green"),
         "failed": ("✘", "bold red"), "skipped": ("–", "dim"), "planned": ("•", "cyan")}


@dataclass
class StepState:
    name: str
    title: str
    status: str = "pending"
    summary: str = ""
    changes: list[Change] = field(default_factory=list)
    seconds: float | None = None


class PlanView:
    """The plan while it runs: one row per step with pending / running / done / failed / skipped.

    In a terminal the table updates live. Anywhere else (a CI log, `| tee`) a live table prints
    nothing until the end, so the view writes a line when a step starts or ends, each new progress
    note and a heartbeat, as ddops.progress does for a single wait; the final table is printed once,
    complete, at the end.
    """

    def __init__(self, states: list[StepState], console: Console) -> None:
        self.states, self.console = states, console
        self.live: Live | None = None
        self.logging = False                   # not a terminal: write lines instead of a live table
        self.note = ""
        self.logged: dict[str, str] = {}       # step name -> the status last written to the log
        self.last_line = time.monotonic()
        self.last_note = ""
        self.step_started = time.monotonic()
        self.lock = threading.Lock()
        self.stop_heartbeat = threading.Event()

    def table(self) -> Table:
        table = Table(show_header=False, box=None, padding=(0, 1))
        for s in self.states:
            icon, style = ICONS[s.status]
            took = f"{s.seconds:.1f}s" if s.seconds is not None else ""
            detail = s.summary or "\n".join(c.what for c in s.changes)
            if s.status == "running" and self.note:
                detail = self.note
            table.add_row(Text(icon, style=style), Text(s.title, style="bold" if s.status == "running" else ""),
                          Text(s.status, style=style), Text(took, style="dim"), Text(detail, overflow="fold"))
        return table

    def refresh(self) -> None:
        if self.live is not None:
            self.live.update(self.table())
        elif self.logging:
            self.log_transitions()

    def progress(self, message: str) -> None:
        self.note = message
        if self.live is not None:
            self.live.update(self.table())
        elif self.logging and message != self.last_note and time.monotonic() - self.last_line >= NOTE_S:
            self.write(f"     {message}")
            self.last_note = message

    # -- the log -------------------------------------------------------------------------------------

    def write(self, line: str, style: str = "") -> None:
        with self.lock:
            self.console.print(Text(line, style=style), soft_wrap=True)
            self.last_line = time.monotonic()

    def log_transitions(self) -> None:
        for s in self.states:
            if self.logged.get(s.name) == s.status or s.status in ("pending", "planned"):
                continue
            self.logged[s.name] = s.status
            icon, style = ICONS[s.status]
            if s.status == "running":
                self.step_started, self.last_note = time.monotonic(), ""
                self.write(f" {icon} {s.title} ...", style)
            else:
                took = f" {s.seconds:.1f}s" if s.seconds is not None else ""
                self.write(f" {icon} {s.title}: {s.status}{took}" + (f": {s.summary}" if s.summary else ""), style)

    def heartbeat(self) -> None:
        while not self.stop_heartbeat.wait(1.0):
            running = next((s for s in self.states if s.status == "running"), None)
            if running is not None and time.monotonic() - self.last_line >= HEARTBEAT_S:
                waited = time.monotonic() - self.step_started
                self.write(f"     ... {running.title.lower()}, {waited:.0f}s" + (f": {self.note}" if self.note else ""),
                           "dim")

    def __enter__(self) -> "PlanView":
        if self.console.is_terminal:
            self.live = Live(self.table(), console=self.console, refresh_per_second=8, transient=False)
            self.live.__enter__()
        else:
            self.logging = True
            self.logged = {s.name: s.status for s in self.states}  # the plan above already shows these
            threading.Thread(target=self.heartbeat, name="plan-heartbeat", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.update(self.table())
            self.live.__exit__(*exc)
            self.live = None
            return
        self.stop_heartbeat.set()
        self.log_transitions()
        self.note = ""
        self.console.print(self.table())


EXIT_INTERRUPTED = 130
ROLLBACK_RETRY_S = 90.0   # a host that is briefly unreachable gets this long to come back for the rollback


class InterruptGuard:
    """While a pivot may change hosts, Ctrl-C and SIGTERM ask it to stop at the next safe point.

    The step in flight finishes (a unit is written whole or not at all), the run rolls back what it
    changed and reports the host's state. Further signals are noted, not obeyed: dying during the
    rollback is what would leave a host half-done. SIGKILL remains the way to stop it at once.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, run: PivotRun) -> None:
        self.run = run
        self.count = 0
        self.previous: dict = {}

    def handle(self, signum: int, frame) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.run.interrupted is None:
            self.run.interrupted = name
            message = f"\n{name}: stopping at the next safe point, then rolling back what changed\n"
        else:
            message = f"\n{name} again: already stopping; the rollback must finish (SIGKILL aborts it)\n"
        os.write(2, message.encode())  # async-signal-safe; the live view repaints over it

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def read_secrets(profile) -> dict[str, str]:
    values = {}
    for key, source in profile.secrets.items():
        value = os.environ.get(source)
        if not value:
            raise ConfigError(f"secret {key} comes from ${source}, which is not set", where=profile.where("secrets"),
                              fix=f"export {source}=... before running ddops")
        values[key] = value
    return values


def holder_info(profile_name: str) -> dict[str, Any]:
    return {**history.who(), "pid": os.getpid(), "command": f"ddops pivot --deploy {profile_name}",
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "token": _secrets.token_hex(8)}


class Pivot:
    def __init__(self, run: PivotRun, console: Console, *, yes: bool = False, no_rollback: bool = False,
                 break_lock: bool = False, confirm: Callable[[str], bool] | None = None) -> None:
        self.run, self.console = run, console
        self.yes, self.no_rollback, self.break_lock = yes, no_rollback, break_lock
        self.confirm = confirm
        self.preflight = PreflightStep(break_lock=break_lock)
        self.steps = [TrainingStep(), SyncStep(), DepsStep(), ShipStep(), UnitStep(), StartStep(),
                      HealthStep(), SmokeStep()]
        self.states = [StepState("preflight", "Preflight")] + [StepState(s.name, s.title) for s in self.steps] \
            + [StepState("record", "Record")]
        self.by_name = {s.name: s for s in self.states}
        self.report: dict[str, Any] = {"profile": run.profile.name, "host": run.profile.host,
                                       "dry_run": run.dry_run, "outcome": None, "state": None}

    # -- the flow --------------------------------------------------------------------------------

    def execute(self) -> dict[str, Any]:
        started = time.monotonic()
        run = self.run
        render(run.profile, run.secrets)  # a template error is the user's: say so before any host is touched
        self.banner(f"Preflight on {', '.join(h.name for h in self.preflight.hosts(run))}")
        pre = self.by_name["preflight"]
        t0 = time.monotonic()
        failure: DdopsError | None = None
        try:
            with Activity(self.console, "preflight") as activity:
                run.progress = activity.update
                pre.summary = self.preflight.execute(run)
            pre.status = "done"
        except DdopsError as exc:
            pre.status, pre.summary, failure = "failed", exc.line(), exc
        pre.seconds = round(time.monotonic() - t0, 2)
        if failure is not None:
            self.report["failed_step"] = "preflight"
            return self.finish("failed", "preflight failed: nothing was changed anywhere", failure, started)
        self.plan_all()
        self.show_plan()
        changing = [s for s in self.states if s.changes]
        if run.dry_run:
            return self.finish("dry-run", self.dry_run_state(), None, started)
        if changing and not self.yes and self.confirm is not None and not self.confirm("Apply this plan?"):
            return self.finish("aborted", "not confirmed: nothing was changed", None, started)
        with InterruptGuard(run) as guard:
            self.acquire_lock()
            error: DdopsError | None = None
            with PlanView(self.states, self.console) as view:
                try:
                    run.progress = view.progress
                    error = self.apply_all(view)
                    if error is not None and self.should_rollback() and not self.no_rollback:
                        self.rollback(view, error)
                except BaseException as exc:  # a bug: never record a run that blew up as "ok"
                    error = error or StepFailed(f"the pivot stopped on an unexpected {exc.__class__.__name__}: {exc}")
                    raise
                finally:
                    outcome, state = self.outcome(error)
                    self.record(outcome, state, error, started, view)
                    self.release_lock()
            if guard.count:
                self.report["signals"] = guard.count
        return self.finish(outcome, state, error, started)

    def plan_all(self) -> None:
        """Every step's changes from the facts; a step with none says so, and the gates say what they check."""
        planned = set()
        for step in self.steps:
            state = self.by_name[step.name]
            if isinstance(step, StartStep):
                step.planned = planned
            state.changes = step.plan(self.run)
            if state.changes:
                planned.add(step.name)
                state.status = "planned"
            elif hasattr(step, "execute"):
                state.status, state.summary = "planned", step.describe(self.run)
            else:
                state.status, state.summary = "skipped", "no change"
        record = self.by_name["record"]
        record.status, record.summary = "planned", f"append to {HISTORY_PATH} on {self.run.host.name}"

    def dry_run_state(self) -> str:
        training = self.by_name["training"].changes
        if training and not self.run.kill_training:
            return (f"nothing was changed; a real run must stop training on {self.run.profile.host}, "
                    "so it needs --kill-training")
        return "nothing was changed; run it without --dry-run to apply this plan"

    def apply_all(self, view: PlanView) -> DdopsError | None:
        for step in self.steps:
            state = self.by_name[step.name]
            t0 = time.monotonic()
            if self.run.interrupted:  # a safe point: between two steps
                return self.stop_here(state)
            if not state.changes and not hasattr(step, "execute"):
                state.status, state.summary = "skipped", state.summary or "no change"
                view.refresh()
                continue
            state.status = "running"
            view.note = ""
            view.refresh()
            try:
                state.summary = step.execute(self.run) if hasattr(step, "execute") else step.apply(self.run, state.changes)
                state.status = "done"
            except DdopsError as exc:
                state.status, state.summary = "failed", exc.line().split("\n")[0]
                self.report["failed_step"] = step.name
                self.report["error_detail"] = exc.line()
                for later in self.states[self.states.index(state) + 1:]:
                    if later.name == "record":
                        continue
                    later.status = "skipped"
                    later.summary = "not run"
                return exc
            finally:
                state.seconds = round(time.monotonic() - t0, 2)
                view.note = ""
                view.refresh()
        return None

    def stop_here(self, state: StepState) -> Interrupted:
        error = Interrupted(f"interrupted by {self.run.interrupted} before {state.title.lower()}: "
                            "stopped at a safe point")
        self.report["failed_step"] = state.name
        self.report["error_detail"] = error.line()
        for later in self.states[self.states.index(state):]:
            if later.name != "record":
                later.status, later.summary = "skipped", "not run (interrupted)"
        return error

    def should_rollback(self) -> bool:
        return bool(self.run.changed)

    def rollback(self, view: PlanView, error: DdopsError) -> None:
        run = self.run
        state = StepState("rollback", "Rollback", status="running")
        self.states.insert(len(self.states) - 1, state)
        view.refresh()
        t0 = time.monotonic()
        # The host may be briefly unreachable (that may be why the pivot failed): give it time.
        retrying = Retrying(stop=stop_after_delay(ROLLBACK_RETRY_S), reraise=True,
                            retry=retry_if_exception_type((HostUnreachable, CommandTimeout)),
                            wait=wait_exponential(multiplier=1, max=10) + wait_random(0, 1),
                            before_sleep=lambda rs: view.progress(
                                f"host not answering ({rs.outcome.exception().what}); retrying the rollback"))
        try:
            if run.backup_id:
                rep = retrying(restore, run.executor, run.inventory, run.host, run.profile.unit, run.backup_id,
                               progress=view.progress)
                state.summary = (f"restored backup {run.backup_id}"
                                 + (f"; restarted {', '.join(rep['restarted'])}" if rep["restarted"] else "")
                                 + ("; healthy" if rep.get("health") else ""))
                self.report["rollback"] = rep
            else:
                for unit in run.stopped_units:
                    view.progress(f"starting {unit} again")
                    retrying(lambda u=unit: run.executor.run(run.host, ["systemctl", "start", u], timeout=120)
                             .check(f"starting {u}"))
                state.summary = "unit untouched" + (f"; restarted {', '.join(run.stopped_units)}"
                                                    if run.stopped_units else "")
                self.report["rollback"] = {"restarted": list(run.stopped_units)}
            state.status = "done"
            self.report["rolled_back"] = True
        except DdopsError as exc:
            state.status, state.summary = "failed", exc.line().split("\n")[0]
            self.report["rolled_back"] = False
            self.report["rollback_error"] = exc.line()
        finally:
            state.seconds = round(time.monotonic() - t0, 2)
            view.refresh()

    def outcome(self, error: DdopsError | None) -> tuple[str, str]:
        outcome, state = self._outcome(error)
        if self.run.interrupted and error is not None:
            state = f"interrupted by {self.run.interrupted} during {self.report.get('failed_step')}; {state}"
        return outcome, state

    def _outcome(self, error: DdopsError | None) -> tuple[str, str]:
        run, p = self.run, self.run.profile
        if error is None:
            if not run.changed:
                return "unchanged", f"{p.unit} on {p.host} was already in place; nothing restarted; gates passed"
            return "ok", f"{p.unit} on {p.host} is active and healthy ({p.name})"
        if not run.changed:
            return "failed", f"nothing was changed on {p.host}; " + (
                f"{p.unit} is as it was" if self.report.get("failed_step") in ("health", "smoke") else "")
        if self.report.get("rolled_back"):
            rep = self.report.get("rollback", {})
            what = (f"{p.unit} removed (it did not exist before)" if rep.get("removed")
                    else f"previous {p.unit} restored and healthy" if run.backup_id else f"{p.unit} untouched")
            again = ", ".join(self.report.get("rollback", {}).get("restarted", []))
            return "rolled-back", f"rolled back on {p.host}: {what}" + (f"; running again: {again}" if again else "")
        if self.no_rollback:
            return "failed", (f"--no-rollback: {p.host} is left as the failed pivot made it "
                              f"(backup {run.backup_id or 'none'}; `ddops rollback --host {p.host}` restores it)")
        return "rollback-failed", (f"ROLLBACK FAILED on {p.host}: needs a human (backup {run.backup_id or 'none'}; "
                                   f"units stopped by the pivot: {', '.join(run.stopped_units) or 'none'})")

    # -- lock, record, report --------------------------------------------------------------------

    def acquire_lock(self) -> None:
        run = self.run
        if self.break_lock:
            cleared = run_probe(run.executor, run.host, "lock", {"action": "clear", "path": LOCK_PATH})
            if cleared.get("cleared"):
                self.banner(f"cleared a stale lock held by {cleared.get('holder')}")
        holder = holder_info(run.profile.name)
        out = run_probe(run.executor, run.host, "lock", {"action": "acquire", "path": LOCK_PATH, "holder": holder})
        if not out["acquired"]:
            from .steps.preflight import lock_problem
            raise StepFailed(lock_problem(run.host.name, out.get("holder")))
        run.lock_token = holder["token"]

    def release_lock(self) -> None:
        run = self.run
        if run.lock_token is None:
            return
        try:
            run_probe(run.executor, run.host, "lock", {"action": "release", "path": LOCK_PATH,
                                                      "token": run.lock_token})
        except DdopsError as exc:
            self.console.print(f"[yellow]warning:[/] could not release the lock on {run.host.name}: {exc.line()}")

    def record(self, outcome: str, state: str, error: DdopsError | None, started: float, view: PlanView) -> None:
        run = self.run
        rec_state = self.by_name["record"]
        rec_state.status = "running"
        view.refresh()
        t0 = time.monotonic()
        rec = {"kind": "pivot", "profile": run.profile.name, "unit": run.profile.unit, "outcome": outcome,
               "state": state, "release": run.release, "backup_id": run.backup_id,
               "unit_sha256": run.gates.get("unit", {}).get("after", {}).get("unit"),
               "unit_sha256_before": run.gates.get("unit", {}).get("before", {}).get("unit"),
               "steps": [{"name": s.name, "status": s.status, "seconds": s.seconds, "summary": s.summary}
                         for s in self.states if s.name != "record"],
               "gates": {k: v for k, v in run.gates.items() if k in ("health", "smoke")},
               "training": run.training, "stopped_units": run.stopped_units,
               "error": error.line() if error else None, "wall_s": round(time.monotonic() - started, 2)}
        try:
            history.append(run.executor, run.host, rec)
            rec_state.status, rec_state.summary = "done", f"appended to {HISTORY_PATH} on {run.host.name}"
        except DdopsError as exc:
            rec_state.status, rec_state.summary = "failed", exc.line()
        rec_state.seconds = round(time.monotonic() - t0, 2)
        view.refresh()

    def finish(self, outcome: str, state: str, error: DdopsError | None, started: float) -> dict[str, Any]:
        run = self.run
        self.report.update(outcome=outcome, state=state, interrupted=run.interrupted, error=error.line() if error else None,
                           release=run.release, backup_id=run.backup_id, changed=sorted(run.changed),
                           stopped_units=run.stopped_units, training=run.training,
                           gates={k: v for k, v in run.gates.items()}, wall_s=round(time.monotonic() - started, 2),
                           steps=[{"name": s.name, "status": s.status, "seconds": s.seconds, "summary": s.summary,
                                   "changes": [c.what for c in s.changes]} for s in self.states])
        if outcome in ("ok", "unchanged", "dry-run", "aborted"):
            code = EXIT_OK
        elif run.interrupted and isinstance(error, Interrupted):
            code = EXIT_INTERRUPTED
        elif isinstance(error, HostUnreachable) and not run.changed:
            code = EXIT_UNREACHABLE
        else:
            code = EXIT_FAILED
        self.report["exit_code"] = code
        return self.report

    # -- output ----------------------------------------------------------------------------------

    def banner(self, text: str) -> None:
        self.console.print(f"[bold blue]-->[/] {text}")

    def show_plan(self) -> None:
        self.banner(f"Plan for {self.run.profile.host} ({self.run.profile.name})")
        view = PlanView(self.states, self.console)
        self.console.print(view.table())
        for s in self.states:
            for c in s.changes:
                if c.detail and c.detail.startswith("---"):
                    self.console.print(Text(c.detail, style="dim"), soft_wrap=True)


def render_summary(report: dict[str, Any], console: Console) -> None:
    style = {"ok": "bold green", "unchanged": "bold green", "dry-run": "bold cyan", "rolled-back": "bold yellow",
             "aborted": "yellow"}.get(report["outcome"], "bold red")
    console.print(Text(f"{report['outcome'].upper()}: {report['state']}", style=style))
    if report.get("error"):
        console.print(Text(report["error"], style="red"))
    if report.get("rollback_error"):
        console.print(Text("rollback: " + report["rollback_error"], style="red"))
    smoke = (report.get("gates") or {}).get("smoke")
    if smoke:
        for r in smoke["results"]:
            console.print(Text(f"  smoke {smoke_line(r)}"), soft_wrap=True)
        console.print(Text(f"  (one short request is no speed test: `ddops bench --host {report['host']}` measures "
                           "tokens/s per mode)", style="dim"), soft_wrap=True)
    console.print(f"  wall time {report['wall_s']}s; exit {report['exit_code']}")


def smoke_line(r: dict[str, Any]) -> str:
    """One smoke result in words: the answer as sent (whitespace shown), how it was drafted, lossless or not."""
    text = r.get("text") or ""
    shown = repr(text[:60]) + ("..." if len(text) > 60 else "")
    line = f"{r['prompt']!r} -> {shown} {'ok' if r.get('ok') else 'FAILED'}"
    tokens, rounds, accepted = r.get("completion_tokens"), r.get("rounds"), r.get("mean_acceptance_length")
    if tokens is not None:
        line += f": {tokens} token(s)"
        if rounds and accepted is not None:
            line += f", {rounds} draft-and-verify round(s), {accepted:g} tokens accepted per round"
            if accepted * rounds > tokens:  # the runtime counts a round's accepted tokens before the stop cuts it
                line += " (counted before the answer's end cut the last round)"
    if "lossless" in r:
        line += "; identical to plain decoding" if r["lossless"] else "; DIFFERS from plain decoding"
    if r.get("seconds") is not None:
        line += f"; {r['seconds']:.2f}s"
    return line

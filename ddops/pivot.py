"""The pivot's flow: render -> preflight (facts) -> plan every step -> show the plan -> lock -> apply
-> gates -> record; a failure after something changed replays the recorded undos.

The outcome is one of: ok, unchanged (already in place, gates passed), dry-run, refused (a step
declined before any change: the training stop over its lost-steps limit), failed (nothing changed),
rolled-back (the previous state is back and healthy), rollback-failed (the host needs a human: the
summary says what is where), lock-lost (another run took the lock after a change: this one stopped there,
its journal kept for `ddops rollback`). ddops.report words it and picks the exit code.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from rich.console import Console
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential, wait_random

from . import history, hostlock
from .backups import discard_backup
from .errors import DdopsError, HostUnreachable, StepFailed
from .executor import CommandTimeout, Executor
from .gates import Gate, GateFailed
from .gates.health import HealthGate
from .gates.smoke import SmokeGate
from .hostlock import LeaseKeeper, LockLost
from .inventory import Inventory
from .kernels import harvest
from .paths import HISTORY_PATH
from .plan import Interrupted, Operation, PlanContext, RunContext, Step, StepState, way_back
from .preflight import involved_hosts, preflight
from .profile import Profile, Replica
from .progress import Activity
from .report import Report, checked_words
from .rollback import undo
from .signals import InterruptGuard
from .steps import pivot_steps
from .steps.kernels import seed_decision
from .steps.unit import render
from .undo import as_record
from .views import PlanView, show_plan

ROLLBACK_RETRY_S = 90.0   # a host that is briefly unreachable gets this long to come back for the rollback


@dataclass(frozen=True)
class PivotOptions:
    kill_training: bool = False
    dry_run: bool = False
    yes: bool = False
    no_rollback: bool = False
    break_lock: bool = False
    accept_lost_steps: float | None = None   # --accept-lost-steps N (inf: all); None: the profile's limit
    accept_gpu_faults: bool = False          # --accept-gpu-faults: faulty GPUs are warned about, not refused
    batch: int = 1            # replicas replaced at once by a rolling restart
    kernel_seed: bool = True  # --no-kernel-seed: an empty Triton cache is not seeded from the kernel store


class Pivot:
    """One pivot of one profile's host. `steps` and `gates` default to the real ones (tests pass fakes)."""

    def __init__(self, profile: Profile, inventory: Inventory, executor: Executor, console: Console, *,
                 secrets: dict[str, str] | None = None, options: PivotOptions = PivotOptions(),
                 confirm: Callable[[str], bool] | None = None, steps: list[Step] | None = None,
                 gates: list[Gate] | None = None) -> None:
        self.console, self.options, self.confirm = console, options, confirm
        self.ctx = RunContext(profile=profile, inventory=inventory, executor=executor, secrets=secrets or {})
        self.steps = pivot_steps(profile) if steps is None else steps
        self.gates: list[Gate] = [HealthGate(), SmokeGate()] if gates is None else gates
        self.ctx.check_batch = self.check_batch   # a rolling restart has each batch checked by the flow
        self.states = ([StepState("preflight", "Preflight")] + [StepState(s.name, s.title) for s in self.steps]
                       + [StepState(g.name, g.title) for g in self.gates] + [StepState("record", "Record")])
        self.by_name = {s.name: s for s in self.states}
        self.report = Report(profile=profile, dry_run=options.dry_run, steps=self.states, journal=self.ctx.journal,
                             gate_names=tuple(g.name for g in self.gates))
        self.lock_token: str | None = None
        self.lease: LeaseKeeper | None = None
        self.journal_open = False    # this run's journal of intent is on the host (closed when it ends well)

    # -- the flow --------------------------------------------------------------------------------

    def execute(self) -> Report:
        started = time.monotonic()
        ctx, options = self.ctx, self.options
        # A template error is the user's: say so before any host is touched.
        ctx.rendered = render(ctx.profile, ctx.secrets)
        self.banner(f"Preflight on {', '.join(h.name for h in involved_hosts(ctx.profile, ctx.inventory))}")
        pre = self.by_name["preflight"]
        t0 = time.monotonic()
        try:
            with Activity(self.console, "preflight"):
                ctx.facts, pre.summary = preflight(ctx.profile, ctx.inventory, ctx.executor,
                                                   kill_training=options.kill_training, dry_run=options.dry_run,
                                                   break_lock=options.break_lock,
                                                   accept_lost_steps=options.accept_lost_steps,
                                                   accept_gpu_faults=options.accept_gpu_faults)
            pre.status = "done"
        except DdopsError as exc:
            pre.status, pre.summary = "failed", exc.line()
            pre.seconds = round(time.monotonic() - t0, 2)
            self.report.failed_step = "preflight"
            return self.finish("failed", "preflight failed: nothing was changed anywhere", exc, started)
        pre.seconds = round(time.monotonic() - t0, 2)
        self.report.release = ctx.facts.release
        self.report.accepted_gpu_faults = list(ctx.facts.gpu_check.accepted) if ctx.facts.gpu_check else []
        self.report.pool = ctx.facts.pool.as_json() if ctx.facts.pool is not None else None
        self.plan_all()
        self.banner(f"Plan for {ctx.profile.host} ({ctx.profile.name})")
        show_plan(self.states, self.console, ctx.facts.pool.line if ctx.facts.pool is not None else None)
        if options.dry_run:
            return self.finish("dry-run", self.dry_run_state(), None, started)
        changing = any(s.changes for s in self.states)
        if changing and not options.yes and self.confirm is not None and not self.confirm("Apply this plan?"):
            return self.finish("aborted", "not confirmed: nothing was changed", None, started)
        with InterruptGuard(ctx) as guard:
            try:
                self.acquire_lock()
            except DdopsError as exc:   # held by another run (a live one, for --break-lock): nothing changed
                return self.finish("failed", f"nothing was changed on {ctx.host.name}", exc, started)
            with PlanView(self.states, self.console) as view:
                error: DdopsError | None = None
                try:
                    ctx.progress = view.progress
                    error = self.apply_all(view)
                    if error is None and ctx.profile.engine == "ddtree":
                        self.harvest_kernels(view)
                    # a run whose lock was broken changes nothing more: its journal stays for `ddops rollback`
                    if error is not None and self.report.changed and not options.no_rollback \
                            and not isinstance(error, LockLost):
                        self.roll_back(view)
                except BaseException as exc:  # a bug: never record a run that blew up as "ok"
                    error = error or StepFailed(f"the pivot stopped on an unexpected {exc.__class__.__name__}: {exc}")
                    raise
                finally:
                    self.report.error, self.report.interrupted = error, ctx.interrupted
                    self.report.conclude(options.no_rollback)
                    self.report.wall_s = round(time.monotonic() - started, 2)
                    if not self.report.changed:
                        self.close_journal(error)
                        self.discard_unused_backup()
                    self.record(view)
                    self.close_journal(error)
                    self.release_lock()
            self.report.signals = guard.count
        return self.finish(self.report.outcome, self.report.state, error, started)

    def plan_all(self) -> None:
        """Every step's operations from the facts (each sees what the steps before it plan); a step with
        none says so, and the gates say what they will check."""
        before: dict[str, list[Operation]] = {}
        plan_ctx = PlanContext(profile=self.ctx.profile, inventory=self.ctx.inventory, facts=self.ctx.facts,
                               rendered=self.ctx.rendered, kill_training=self.options.kill_training,
                               accept_lost_steps=self.options.accept_lost_steps, batch=self.options.batch,
                               kernel_seed=self.options.kernel_seed)
        for step in self.steps:
            state = self.by_name[step.name]
            state.changes = before[step.name] = step.plan(replace(plan_ctx, before=dict(before)))
            state.status, state.summary = ("planned", "") if state.changes else ("skipped", "no change")
        if self.ctx.profile.engine == "ddtree":   # what the plan does with the kernel cache, seeding or not
            self.report.kernel_seed = seed_decision(replace(plan_ctx, before=before))
        for gate in self.gates:
            state = self.by_name[gate.name]
            state.status, state.summary = "planned", gate.describe(self.ctx)
        record = self.by_name["record"]
        record.status, record.summary = "planned", f"append to {HISTORY_PATH} on {self.ctx.host.name}"

    def dry_run_state(self) -> str:
        lacking = [op.requires for s in self.states for op in s.changes if op.requires]
        if lacking:
            return f"nothing was changed; {lacking[0]}"
        return "nothing was changed; run it without --dry-run to apply this plan"

    def apply_all(self, view: PlanView) -> DdopsError | None:
        """The journal of intent, then the steps' plans, then the gates; the first failure stops the run
        and is returned. Before each step the journal notes it, checking that this run still holds the lock."""
        error = self.open_journal()
        if error is not None:
            return error
        work: list[tuple[StepState, Callable[[], str] | None]] = []
        for step in self.steps:
            state = self.by_name[step.name]
            work.append((state, (lambda s=step, st=state: s.apply(self.ctx, st.changes)) if state.changes else None))
        for gate in self.gates:
            work.append((self.by_name[gate.name], lambda g=gate: self.check_gate(g)))
        for state, action in work:
            if self.ctx.interrupted:  # a safe point: between two steps
                return self.stop_here(state)
            if action is None:
                state.status, state.summary = "skipped", state.summary or "no change"
                view.refresh()
                continue
            error = self.note(state) or self.run_one(state, action, view)
            if error is not None:
                return error
        return None

    def open_journal(self) -> DdopsError | None:
        """Before the first change: the journal of intent on the host, holding the way back to the state
        from before this pivot (what each step will change and its undo, the backup of the files the
        unit step replaces, the training job it stops), so that a rollback after any crash can rebuild
        it. A failure here (a full disk, an unfinished pivot, a lost lock) changes nothing."""
        ctx = self.ctx
        first = next((s for s in self.states if s.changes), None)
        if first is None:
            return None
        failed_at = first   # the row a failure here is shown on: the step whose preparation failed

        def preparing(name: str) -> None:
            nonlocal failed_at
            failed_at = self.by_name[name]

        try:
            out = hostlock.journal(ctx.executor, ctx.host, "journal-open", self.lock_token, record={
                **self.journal_owner(), "kind": "pivot", "profile": ctx.profile.name, "unit": ctx.profile.unit,
                "undo": [], "step": None})
            if "unfinished" in out:
                raise StepFailed(hostlock.unfinished_problem(ctx.host.name, out["unfinished"]))
            self.journal_open = True
            undos = way_back(ctx, self.steps, {s.name: s.changes for s in self.states}, at=preparing)
            self.report.way_back = [as_record(u) for u in undos]
            hostlock.journal(ctx.executor, ctx.host, "journal-note", self.lock_token,
                             note={"what": "the way back", "undo": len(undos)}, update={"undo": self.report.way_back})
        except DdopsError as exc:
            return self.fail_at(failed_at, exc)
        return None

    def note(self, state: StepState) -> DdopsError | None:
        """The journal notes the step about to run (a lost lock stops the run here, changing nothing more)."""
        if not self.journal_open:
            return None
        try:
            if self.lease is not None:
                self.lease.check()
            hostlock.journal(self.ctx.executor, self.ctx.host, "journal-note", self.lock_token,
                             note={"step": state.name}, update={"step": state.name})
        except DdopsError as exc:
            return self.fail_at(state, exc)
        return None

    def close_journal(self, error: DdopsError | None) -> None:
        """The pivot ended in a known state: its journal goes. Kept (the host needs `ddops rollback`)
        when the rollback failed, or when the lock was lost to another run."""
        if not self.journal_open or self.report.outcome == "rollback-failed" or isinstance(error, LockLost):
            return
        try:
            hostlock.journal(self.ctx.executor, self.ctx.host, "journal-close", self.lock_token)
            self.journal_open = False
        except DdopsError as exc:
            self.console.print(f"[yellow]warning:[/] could not close the journal on {self.ctx.host.name}: "
                               f"{exc.line()}")

    def discard_unused_backup(self) -> None:
        """A pivot that changed nothing leaves no backup behind: the one the unit step took before the first
        change would be the newest, and `ddops rollback` would restore what is already there instead of
        the state before the last pivot that did change something. Kept while a journal names it."""
        ctx, journal = self.ctx, self.ctx.journal
        if journal.backup_id is None or self.journal_open:
            return
        try:
            gone = discard_backup(ctx.executor, ctx.host, ctx.profile.unit, journal.backup_id)
        except DdopsError as exc:
            gone = False
            self.console.print(f"[yellow]warning:[/] could not remove the unused backup {journal.backup_id} on "
                               f"{ctx.host.name}: {exc.line()}")
        if gone:
            journal.backup_id, self.report.way_back = None, []

    def journal_owner(self) -> dict:
        """Who this run is, as the journal names it (`status`, `history` and a refusal show it)."""
        return {**history.who(), "pid": os.getpid(), "token": self.lock_token,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def harvest_kernels(self, view: PlanView) -> None:
        """The gates passed: the host's Triton cache goes into the kernel store for its GPU model (under the
        host's lock, so no other pivot changes it meanwhile). A failure is a warning: the deploy stands."""
        ctx = self.ctx
        view.progress(f"harvesting the kernel cache of {ctx.host.name}")
        self.report.kernel_harvest = harvest(ctx.executor, ctx.inventory, ctx.host, ctx.profile, ctx.facts.host,
                                             view.progress)

    def check_gate(self, gate: Gate) -> str:
        try:
            result = gate.check(self.ctx)
        except GateFailed as exc:
            self.ctx.journal.gates[gate.name] = exc.data  # what it measured shows in the report
            raise
        self.ctx.journal.gates[gate.name] = result.data
        return result.summary

    def check_batch(self, batch: Sequence[Replica], at: Callable[[str, str], None]) -> None:
        """The run's gates on a batch of replicas a rolling restart has just restarted (and only on them);
        `at(name, title)` is told before each gate runs, so a failure names its stage."""
        self.ctx.only = tuple(batch)
        try:
            for gate in self.gates:
                at(gate.name, gate.title)
                gate.check(self.ctx)
        finally:
            self.ctx.only = None

    def run_one(self, state: StepState, action: Callable[[], str], view: PlanView) -> DdopsError | None:
        t0 = time.monotonic()
        state.status = "running"
        view.note = ""
        view.refresh()
        calm = self.ctx.interrupted is None
        try:
            state.summary = action()
            state.status = "done"
            return None
        except DdopsError as exc:
            return self.fail_at(state, exc)
        finally:
            if calm and self.ctx.interrupted is not None:
                self.report.interrupted_during = state.name
            state.seconds = round(time.monotonic() - t0, 2)
            view.note = ""
            view.refresh()

    def fail_at(self, state: StepState, exc: DdopsError) -> DdopsError:
        state.status, state.summary = "failed", exc.line().split("\n")[0]
        self.report.failed_step = state.name
        # every row after it is not run, and so is any before it still planned (the journal failed)
        for other in self.states:
            after = self.states.index(other) > self.states.index(state)
            if other is not state and other.name != "record" and (after or other.status == "planned"):
                other.status, other.summary = "skipped", "not run"
        return exc

    def stop_here(self, state: StepState) -> Interrupted:
        during = self.report.interrupted_during
        error = Interrupted(f"interrupted by {self.ctx.interrupted}" + (f" during {during}" if during else "")
                            + f": stopped at a safe point, before {state.title.lower()}")
        self.report.failed_step = state.name
        for later in self.states[self.states.index(state):]:
            if later.name != "record":
                later.status, later.summary = "skipped", "not run (interrupted)"
        return error

    def roll_back(self, view: PlanView) -> None:
        """Replay the journal's undo operations; the host may be briefly unreachable (that may be why the
        pivot failed), so each gets ROLLBACK_RETRY_S to come back."""
        ctx, journal = self.ctx, self.ctx.journal
        state = StepState("rollback", "Rollback", status="running")
        self.states.insert(len(self.states) - 1, state)
        view.refresh()
        t0 = time.monotonic()
        retrying = Retrying(stop=stop_after_delay(ROLLBACK_RETRY_S), reraise=True,
                            retry=retry_if_exception_type((HostUnreachable, CommandTimeout)),
                            wait=wait_exponential(multiplier=1, max=10) + wait_random(0, 1),
                            before_sleep=lambda rs: view.progress(
                                f"host not answering ({rs.outcome.exception().what}); retrying the rollback"))
        rep: dict = {}
        try:
            undo(ctx.executor, ctx.inventory, ctx.host, journal.undo, retrying=retrying, progress=view.progress,
                 secrets=ctx.secrets, report=rep)
            restarted = f"; restarted {', '.join(rep['restarted'])}" if rep["restarted"] else ""
            checked = f"; {checked_words(rep)}" if rep.get("checked") else ""
            if "backup_id" in rep:
                state.summary = f"restored backup {rep['backup_id']}{restarted}{checked}"
            else:
                state.summary = "unit untouched" + restarted + checked
            state.status = "done"
            self.report.rollback, self.report.rolled_back = rep, True
        except DdopsError as exc:
            state.status, state.summary = "failed", exc.line().split("\n")[0]
            self.report.rolled_back, self.report.rollback_error = False, exc.line()
            self.report.rollback = rep or None   # what it did before it failed, and what each gate measured
        finally:
            state.seconds = round(time.monotonic() - t0, 2)
            view.refresh()

    # -- lock, record, finish --------------------------------------------------------------------

    def acquire_lock(self) -> None:
        """Take the host's lock (--break-lock first clears one whose holder is provably dead, else refuses
        naming it) and keep its lease renewed while the run holds it."""
        ctx = self.ctx
        if self.options.break_lock:
            holder = hostlock.break_if_dead(ctx.executor, ctx.host)
            if holder is not None:
                self.banner(f"cleared the lock of a dead run: {hostlock.describe(holder)} ({holder['dead']})")
        self.lock_token = hostlock.acquire(ctx.executor, ctx.host, f"ddops pivot --deploy {ctx.profile.name}")
        self.lease = LeaseKeeper(ctx.executor, ctx.host, self.lock_token).start()

    def release_lock(self) -> None:
        if self.lock_token is None:
            return
        if self.lease is not None:
            self.lease.stop()
        try:
            hostlock.release(self.ctx.executor, self.ctx.host, self.lock_token)
        except DdopsError as exc:
            self.console.print(f"[yellow]warning:[/] could not release the lock on {self.ctx.host.name}: {exc.line()}")

    def record(self, view: PlanView) -> None:
        state = self.by_name["record"]
        state.status = "running"
        view.refresh()
        t0 = time.monotonic()
        try:
            history.append(self.ctx.executor, self.ctx.host, self.report.history_record())
            state.status, state.summary = "done", f"appended to {HISTORY_PATH} on {self.ctx.host.name}"
        except DdopsError as exc:
            state.status, state.summary = "failed", exc.line()
        state.seconds = round(time.monotonic() - t0, 2)
        view.refresh()

    def finish(self, outcome: str, state: str, error: DdopsError | None, started: float) -> Report:
        report = self.report
        report.outcome, report.state, report.error = outcome, state, error
        report.interrupted = self.ctx.interrupted
        report.wall_s = round(time.monotonic() - started, 2)
        return report

    def banner(self, text: str) -> None:
        self.console.print(f"[bold blue]-->[/] {text}")

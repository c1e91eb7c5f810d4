"""What ddops shows in a terminal or a log: the live plan, the pivot's summary, and the tables of the
other commands. Nothing here talks to a host; the flow and the CLI hand it what to show."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import asdict, is_dataclass
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .kernels import mib
from .plan import StepState
from .report import checked_words
from .progress import HEARTBEAT_S, NOTE_S


def stdout_console() -> Console:
    """A console for tables: wide when piped, so no column is cut to fit 80 characters."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


# -- the pivot's plan, live ------------------------------------------------------------------------

ICONS = {"pending": ("·", "dim"), "running": ("▶", "bold yellow"), "done": ("✔", "green"),
         "failed": ("✘", "bold red"), "skipped": ("–", "dim"), "planned": ("•", "cyan")}


class PlanView:
    """The plan while it runs: one row per step with pending / running / done / failed / skipped.

    In a terminal the table updates live. Anywhere else (a CI log, `| tee`) a live table prints
    nothing until the end, so the view writes a line when a step starts or ends, each new progress
    note and a heartbeat, as ddops.progress does for a single wait. The step list itself is printed
    once there, as the plan: those lines already say how each step ended.
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


def show_plan(states: list[StepState], console: Console, capacity: str | None = None) -> None:
    """The whole plan, what the runtime's KV pool will hold on the GPU (when it serves on one), then
    every unified diff the plan holds (secrets already masked)."""
    console.print(PlanView(states, console).table())
    if capacity:
        console.print(Text(f"capacity: {capacity}", style="cyan"), soft_wrap=True)
    for s in states:
        for op in s.changes:
            if op.detail and op.detail.startswith("---"):
                console.print(Text(op.detail, style="dim"), soft_wrap=True)


# -- the pivot's summary ---------------------------------------------------------------------------

def render_summary(report: dict[str, Any], console: Console) -> None:
    if "reports" in report:  # host by host: each host's summary, then the rollout's
        for one in report["reports"]:
            console.print(Text(f"{one['host']}:", style="bold"))
            render_summary(one, console)
        console.print(Text(f"ROLLOUT {report['outcome'].upper()}: {report['state']}",
                           style="bold green" if report["exit_code"] == 0 else "bold red"), soft_wrap=True)
        return
    style = {"ok": "bold green", "unchanged": "bold green", "dry-run": "bold cyan", "rolled-back": "bold yellow",
             "refused": "bold yellow", "aborted": "yellow"}.get(report["outcome"], "bold red")
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
    for batch in report.get("rolling") or []:
        console.print(Text(f"  rolling {rolling_line(batch)}", style="" if batch["ok"] else "red"), soft_wrap=True)
    cache = report.get("kernel_cache")
    if cache:
        console.print(Text(f"  kernel cache: {cache['line']}"), soft_wrap=True)
        for warning in cache["warnings"]:
            console.print(Text(f"  warning: {warning}", style="yellow"), soft_wrap=True)
    if (report.get("rollback") or {}).get("checked"):
        console.print(Text(f"  on the way back: {checked_words(report['rollback'])}",
                           style="" if report.get("rolled_back") else "red"), soft_wrap=True)
    console.print(f"  wall time {report['wall_s']}s; exit {report['exit_code']}")


def rolling_line(batch: dict[str, Any]) -> str:
    """One batch of a rolling restart: how long each stage took, or where it failed."""
    line = f"batch {batch['batch']} {', '.join(batch['replicas'])}: "
    if not batch["ok"]:
        return line + f"FAILED at {batch.get('failed_at')}: {batch.get('error')}"
    left = f" ({batch['sessions_left']} session(s) left at the drain timeout)" if batch.get("sessions_left") else ""
    return line + (f"drained in {batch['drain_s']}s{left}, restarted and gated in {batch['restart_and_gates_s']}s, "
                   f"readmitted in {batch['readmit_s']}s; {batch['total_s']}s out of the balancer")


def smoke_line(r: dict[str, Any]) -> str:
    """One smoke result in words: the answer as sent (whitespace shown), how it was drafted, lossless or not."""
    text = r.get("text") or ""
    shown = repr(text[:60]) + ("..." if len(text) > 60 else "")
    line = (f"{r['replica']}: " if r.get("replica") else "") + f"{r['prompt']!r} -> {shown} {'ok' if r.get('ok') else 'FAILED'}"
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


# -- the other commands' tables --------------------------------------------------------------------

def lab_table(states: list) -> Table:
    table = Table(title="ddops lab")
    for column in ("host", "ssh port", "pid", "running", "sshd"):
        table.add_column(column)
    for s in states:
        d = as_dict(s)
        table.add_row(str(d.get("name")), str(d.get("port")), str(d.get("pid") or "-"),
                      "yes" if d.get("running") else "no", "answers" if d.get("sshd_ok") else "-")
    return table


def as_dict(state: object) -> dict:
    return asdict(state) if is_dataclass(state) else dict(vars(state))


def backups_table(backups: list, unit: str, host: str) -> Table:
    table = Table(title=f"backups of {unit} on {host} (newest last)")
    for column in ("id", "created (UTC)", "taken by", "unit existed", "restarts after rollback"):
        table.add_column(column, overflow="fold")
    for b in backups:
        m = b["meta"]
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m["created"])) if m.get("created") else "?"
        by = f"rollback (replaced by {m.get('replaced_by')})" if m.get("reason") == "rollback" else str(m.get("profile", ""))
        if b.get("damaged"):
            table.add_row(Text(b["id"], style="red"), created, by, Text(f"DAMAGED: {b['damaged']}", style="bold red"),
                          "never restored")
            continue
        table.add_row(b["id"], created, by, "yes" if m.get("unit_existed") else "no (rollback removes it)",
                      ", ".join(m.get("restart_after_rollback") or []) or "-")
    return table


def history_table(records: list[dict[str, Any]]) -> Table:
    table = Table(title="ddops history")
    for column in ("when (UTC)", "host", "kind", "profile/unit", "outcome", "release", "backup", "wall", "by"):
        table.add_column(column, overflow="fold")
    for r in records:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.get("time", 0)))
        outcome: str | Text = r.get("outcome", "")
        if outcome == "unfinished":
            outcome = Text(f"UNFINISHED\n{r.get('state')}", style="bold red")
        wall = f"{r['wall_s']}s" if r.get("wall_s") is not None else "-"
        table.add_row(when, r["host"], r.get("kind", "?"), r.get("profile") or r.get("unit") or "",
                      outcome + (" (GPU faults accepted)" if r.get("accepted_gpu_faults") else ""),
                      r.get("release") or "", r.get("backup_id") or "",
                      wall, f"{r.get('user')}@{r.get('control_host')}")
    return table


def kernels_table(stores: list) -> Table:
    """The kernel store, a row per GPU model (ddops.kernels.Stored)."""
    table = Table(title="kernel store")
    for column in ("GPU model", "harvested from", "at (UTC)", "files", "size", "compile record"):
        table.add_column(column, overflow="fold")
    for s in stores:
        table.add_row(s.gpu_model, s.host, s.harvested_at, str(s.files), mib(s.bytes),
                      "yes" if s.has_record else "-")
    return table


def rollback_line(report: dict[str, Any], unit: str, host: str) -> str:
    if report.get("unchanged"):
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(report.get("rolled_back_at") or 0))
        return (f"[bold]UNCHANGED:[/] nothing to roll back on {host}: backup {report['backup_id']} of {unit} was "
                f"restored by the last rollback ({when}); restore another with --to (see --list)")
    files = report.get("files") or {}
    what = ("removed (it did not exist before)" if report.get("removed")
            else "already as before (the pivot had not changed it)" if files and files["before"] == files["after"]
            else "restored" if report.get("backup_id") else "untouched (the pivot had not reached it)")
    source = f"from backup {report['backup_id']}" if report.get("backup_id") and what == "restored" else ""
    pivot = report.get("unfinished")
    return ((f"[bold green]ROLLED BACK:[/] the unfinished pivot of {pivot['profile']} on {host} (started "
             f"{pivot['started_at']}, got as far as {pivot['step'] or 'its start'}): {unit} {what} {source}".rstrip()
             if pivot else f"[bold green]ROLLED BACK:[/] {unit} on {host} {what} {source}".rstrip())
            + (f"; running again: {', '.join(report['restarted'])}" if report["restarted"] else "")
            + (f"; already running: {', '.join(report['running'])}" if report.get("running") else "")
            + (f"; what it replaced is kept as backup {report['saved_as']}" if report.get("saved_as") else "")
            + (f"; {checked_words(report)}" if report.get("checked") else "") + f" ({report['seconds']}s)")

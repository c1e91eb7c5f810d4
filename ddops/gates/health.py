"""The health gate: poll /health with tenacity until it says ok, while watching the unit.

A crash (unit failed, auto-restart, a restart counted, main PID gone or changed) stops the wait at
once and shows the journal tail; otherwise the profile's deadline applies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_exponential, wait_random

from .. import balancer
from ..errors import HostUnreachable, StepFailed
from ..executor import CommandTimeout, Executor
from ..inventory import Host
from ..plan import RunContext, serving_shape  # noqa: F401 - serving_shape: what the gate expects, also for its callers
from ..remote import journal_tail, run_probe
from . import GateContext, GateResult


FATAL_HEALTH = ("error", "failed")   # /health states a runtime never leaves by itself


class Crashed(StepFailed):
    """The unit died while we waited for it to become healthy."""


@dataclass
class Verdict:
    state: str         # "healthy", "waiting" or "crashed"
    reason: str
    detail: dict


def judge(poll: dict, first_pid: int | None, expect: dict | None = None) -> Verdict:
    """Classify one poll of the unit and its /health (pure: pinned by unit tests)."""
    unit, health = poll["unit"], poll["health"]
    state, sub = unit.get("ActiveState"), unit.get("SubState")
    restarts = int(unit.get("NRestarts") or 0)
    pid = int(unit.get("MainPID") or 0)
    if state == "failed":
        return Verdict("crashed", f"unit failed ({unit.get('Result')}, exit status {unit.get('ExecMainStatus')})", poll)
    if sub == "auto-restart" or restarts > 0:
        return Verdict("crashed", f"unit is crash-looping (restarts={restarts}, exit status "
                       f"{unit.get('ExecMainStatus')})", poll)
    if state in ("inactive", "deactivating"):
        return Verdict("crashed", f"unit is {state} (main process exited, status {unit.get('ExecMainStatus')})", poll)
    if first_pid and pid and pid != first_pid:
        return Verdict("crashed", f"main PID changed {first_pid} -> {pid} (the runtime restarted)", poll)
    body = health.get("body")
    if isinstance(body, dict) and body.get("status") in FATAL_HEALTH:
        # The process is up but its engine is dead (failed to load, worker died): it will not recover.
        return Verdict("crashed", f"/health reports {body.get('status')}: {body.get('detail') or ''}".strip(), poll)
    if health.get("http_status") == 200 and body is None and not expect:
        return Verdict("healthy", "ok", poll)   # SGLang's /health: 200 with an empty body
    if health.get("http_status") == 200 and isinstance(body, dict) and body.get("status") in ("ok", None):
        for key, value in (expect or {}).items():
            if body.get(key) != value:
                return Verdict("crashed", f"/health reports {key}={body.get(key)!r}, expected {value!r}", poll)
        return Verdict("healthy", "ok", poll)
    if isinstance(body, dict):
        return Verdict("waiting", f"/health {health.get('http_status')}: {body.get('status')} {body.get('detail') or ''}".strip(), poll)
    return Verdict("waiting", f"/health: {health.get('error') or health.get('http_status')}", poll)


def wait_healthy(executor: Executor, host: Host, unit: str, port: int, path: str, deadline_s: float,
                 interval_s: float = 1.0, expect: dict | None = None, *,
                 progress: Callable[[str], None] = lambda message: None,
                 check_interrupt: Callable[[], None] = lambda: None) -> dict:
    """Block until healthy; raise Crashed at once on a crash, StepFailed at the deadline.
    `check_interrupt` runs before every poll: a Ctrl-C stops the wait there."""
    started = time.monotonic()
    first_pid: list[int] = []
    last: list[Verdict] = []
    unreachable: list[float] = []   # when polls found the host not answering

    def poll() -> Verdict:
        check_interrupt()
        try:
            raw = run_probe(executor, host, "unitwatch", {"unit": unit, "port": port, "path": path},
                            timeout=min(30.0, host.command_timeout))
        except (HostUnreachable, CommandTimeout) as exc:
            # A host that stops answering for a while is waited for, up to the deadline: the unit
            # may be fine. The verdict says so; the deadline decides.
            unreachable.append(time.monotonic() - started)
            verdict = Verdict("waiting", f"{host.name} not answering: {exc.what}", {})
            last[:] = [verdict]
            progress(f"{time.monotonic() - started:.0f}s/{deadline_s:.0f}s {verdict.reason}")
            return verdict
        pid = int(raw["unit"].get("MainPID") or 0)
        if pid and not first_pid:
            first_pid.append(pid)
        verdict = judge(raw, first_pid[0] if first_pid else None, expect)
        last[:] = [verdict]
        progress(f"{time.monotonic() - started:.0f}s/{deadline_s:.0f}s {verdict.reason}")
        if verdict.state == "crashed":
            tail = journal_tail(executor, host, unit, 25)
            raise Crashed(f"{unit} on {host.name} crashed after {time.monotonic() - started:.1f}s: "
                          f"{verdict.reason}\n--- journal tail ---\n{tail}")
        return verdict

    retrying = Retrying(stop=stop_after_delay(deadline_s),
                        wait=wait_exponential(multiplier=0.25, max=interval_s) + wait_random(0, 0.2),
                        retry=retry_if_result(lambda v: v.state != "healthy"), reraise=True)
    try:
        verdict = retrying(poll)
    except RetryError:
        tail = journal_tail(executor, host, unit, 25)
        reason = last[0].reason if last else "no answer"
        raise StepFailed(f"{unit} on {host.name} not healthy within {deadline_s:.0f}s (last: {reason})"
                         f"\n--- journal tail ---\n{tail}") from None
    body = verdict.detail["health"]["body"]
    return {"seconds": round(time.monotonic() - started, 2), "health": body,
            "unreachable_polls": len(unreachable)}


class HealthGate:
    name = "health"
    title = "Health gate"

    def describe(self, ctx: RunContext) -> str:
        p = ctx.profile
        block = p.serve.block_size or "the drafter's"
        expect = f" with mode {p.serve.mode}, block size {block}" if p.engine == "ddtree" else ""
        if p.replicated:
            return (f"wait up to {p.health.deadline_s:g}s for {p.health.path} ok{expect} on each of "
                    f"{p.replicas.count} replica(s), then every one UP in HAProxy on port {p.port}")
        return f"wait up to {p.health.deadline_s:g}s for {p.health.path} ok{expect}, watching {p.unit}"

    def check(self, ctx: GateContext) -> GateResult:
        checks = ctx.checks
        if checks.replicated:
            return self.check_replicas(ctx)
        unit = ctx.serving()[0]
        out = wait_healthy(ctx.executor, ctx.host, unit.unit, unit.port, checks.health.path, checks.health.deadline_s,
                           checks.health.interval_s, checks.expect or None, progress=ctx.progress,
                           check_interrupt=ctx.check_interrupt)
        body = out["health"] if isinstance(out["health"], dict) else {}
        extra = f" mode={body.get('mode')} block_size={body.get('block_size')}" if body.get("mode") else ""
        gap = f" (host did not answer {out['unreachable_polls']} poll(s))" if out["unreachable_polls"] else ""
        return GateResult(f"healthy after {out['seconds']}s{extra}{gap}", out)

    def check_replicas(self, ctx: GateContext) -> GateResult:
        """Each replica in turn (they start together, so the first wait covers most of the others'); then,
        unless a batch is being checked, HAProxy must see every replica UP."""
        health, expect = ctx.checks.health, ctx.checks.expect
        replicas = {}
        for replica in ctx.serving():
            replicas[replica.unit] = wait_healthy(ctx.executor, ctx.host, replica.unit, replica.port, health.path,
                                                  health.deadline_s, health.interval_s, expect,
                                                  progress=lambda m, u=replica.unit: ctx.progress(f"{u}: {m}"),
                                                  check_interrupt=ctx.check_interrupt)
        data: dict = {"replicas": replicas}
        summary = f"{len(replicas)} replica(s) healthy (slowest {max(o['seconds'] for o in replicas.values())}s)"
        if ctx.only is None:  # the whole run's gate: only the flow checks every replica at once
            p = ctx.profile
            servers = [r.server for r in p.replicas.members]
            out = balancer.call(ctx.executor, ctx.host, balancer.as_spec(p), "up", servers,
                                timeout_s=p.balancer.ready_timeout_s)
            data["balancer"] = {"port": p.port, "up": out["ok"], "waited_s": out["waited_s"], "servers": out["states"]}
            if not out["ok"]:
                down = {n: s.get("status") for n, s in out["states"].items() if s.get("status") != "UP"}
                raise StepFailed(f"HAProxy on {ctx.host.name} does not see every replica UP within "
                                 f"{p.balancer.ready_timeout_s:g}s: {down}")
            summary += f"; all {len(servers)} UP in HAProxy on port {p.port}"
        return GateResult(summary, data)

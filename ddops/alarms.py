"""What `ddops top` calls wrong, from a host's last few samples: shown in the view, and with
`--once --fail-on KINDS` an exit code for cron and CI. `frame` is one refresh: each host's view from
the poller (`top`), with its alarms."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .gpuhealth import assess, stray_xids
from .top import Poller, Sample, Target, Thresholds, host_view, window

# Each kind, and what raises it.
KINDS = {
    "acceptance": "mean acceptance over the window under the profile's smoke.min_acceptance",
    "5xx": "a 5xx answered in the window",
    "queue": "a queue that grew at each of the last three refreshes",
    "restart": "a unit restarted since the last refresh (its restart count, main PID or start time changed)",
    "gpu-memory": "a GPU's memory over 95% used",
    "gpu": "a GPU with uncorrectable ECC errors or a fatal Xid since boot, or rows waiting to be remapped",
    "balancer": "a replica the balancer does not send to (DOWN, DRAIN, MAINT or absent)",
    "down": "a serving unit not active, or its /health not ok",
    "unreachable": "a host that did not answer",
}


@dataclass(frozen=True)
class Alarm:
    kind: str
    host: str
    text: str
    unit: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "host": self.host, "unit": self.unit, "text": self.text}


def host_alarms(host: str, history: list[Sample], thresholds: Thresholds, *, stalled: bool = False) -> list[Alarm]:
    """The alarms of one host now. `stalled`: its probe is overdue (shown as not answering)."""
    if not history:
        return []
    newest = history[-1]
    if newest.facts is None or stalled:
        return [Alarm("unreachable", host, newest.error or "no answer")]
    answered = [s for s in history if s.facts is not None]
    out = _gpu_alarms(host, newest.facts, thresholds.gpu_memory_fraction)
    before = {(t.unit, t.port): t for t in answered[-2].targets} if len(answered) >= 2 else {}
    by_target = [{(t.unit, t.port): t for t in s.targets} for s in answered]
    for t in newest.targets:
        out += _target_alarms(host, t, before.get((t.unit, t.port)), thresholds)
        waiting = [seen[(t.unit, t.port)].reading for seen in by_target if (t.unit, t.port) in seen]
        queue = [r.waiting for r in waiting if r is not None and r.waiting is not None]
        growth = thresholds.queue_growth_refreshes
        if len(queue) > growth and all(a < b for a, b in zip(queue[-growth - 1:], queue[-growth:])):
            out.append(Alarm("queue", host, f"queue grew {' -> '.join(f'{q:g}' for q in queue[-growth - 1:])}",
                             t.unit))
    return out


def _gpu_alarms(host: str, facts: dict[str, Any], fraction: float) -> list[Alarm]:
    out = [Alarm("gpu", host, f"GPU {h.index}: {'; '.join(h.faults)}") for h in assess(facts) if h.faults]
    out += [Alarm("gpu", host, stray) for stray in stray_xids(facts)]
    for g in facts.get("gpus", {}).get("list", []):
        used, total = g.get("memory_used_mib"), g.get("memory_total_mib")
        if used is not None and total and used / total > fraction:
            out.append(Alarm("gpu-memory", host, f"GPU {g.get('index')} memory {100 * used / total:.0f}% used "
                                                 f"({used}/{total} MiB)"))
    return out


def _target_alarms(host: str, t: Target, before: Target | None, thresholds: Thresholds) -> list[Alarm]:
    out = []
    if t.active is not None and t.active != "active":
        out.append(Alarm("down", host, f"{t.unit} is {t.active}", t.unit))
    elif not t.healthy:
        out.append(Alarm("down", host, f"{t.unit} /health: {t.health or 'no answer'}", t.unit))
    if t.balancer is not None and not t.balancer.startswith("UP"):
        out.append(Alarm("balancer", host, f"{t.unit} is {t.balancer} in the balancer", t.unit))
    if before is None:
        return out
    if _restarted(before, t):
        out.append(Alarm("restart", host, f"{t.unit} restarted (restarts {before.restarts} -> {t.restarts}, "
                                          f"pid {before.main_pid} -> {t.main_pid})", t.unit))
    if before.reading is None or t.reading is None:
        return out
    w = window(before.reading, t.reading)
    if w.errors_5xx:
        out.append(Alarm("5xx", host, f"{t.unit} answered {w.errors_5xx} 5xx in {w.seconds:.1f}s", t.unit))
    floor = thresholds.min_acceptance.get((host, t.port))
    if floor is not None and w.acceptance is not None and w.acceptance < floor:
        out.append(Alarm("acceptance", host, f"{t.unit} mean acceptance {w.acceptance:.2f} < {floor:g}", t.unit))
    return out


def _restarted(before: Target, after: Target) -> bool:
    if before.restarts is not None and after.restarts is not None and after.restarts > before.restarts:
        return True
    pids = (before.main_pid, after.main_pid)
    if all(pids) and pids[0] != pids[1]:
        return True
    return bool(before.since and after.since and before.since != after.since and after.active == "active")


def top_frame(poller: Poller, thresholds: Thresholds, now: float | None = None) -> dict[str, Any]:
    """One refresh of `ddops top`: every host's view from its last samples, and the alarms up."""
    now = time.monotonic() if now is None else now
    hosts, alarms = [], []
    for watch in poller.watches.values():
        history, in_flight = watch.snapshot()
        view = host_view(watch.host, history, in_flight, now, poller.interval)
        hosts.append(view)
        alarms += host_alarms(watch.host.name, history, thresholds, stalled=view["state"] != "ok")
    return {"time": time.time(), "interval_s": poller.interval, "hosts": hosts,
            "alarms": [a.as_json() for a in alarms]}

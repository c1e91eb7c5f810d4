"""One replica cycle: drain, restart, gate, readmit. The rolling redeploy (ddops.steps.roll) replaces
each batch with it and the rollback (ddops.rollback) returns each replica with it, so both ways keep
the same bounds (drain and readmit are bounded by the balancer's timeouts), say the same progress lines
and fail the same way: at a named stage, with the replica left drained when it did not pass its gates.

The cycle does not pick the gates: its caller hands it `gate(batch, at)`, the flow's (the run's gates)
or the rollback's (the restored profile's), which calls `at(name, title)` before each gate it runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from . import balancer
from .errors import DdopsError, StepFailed
from .executor import Executor
from .inventory import Host
from .profile import Replica
from .remote import check

GateBatch = Callable[[Sequence[Replica], Callable[[str, str], None]], None]


@dataclass(frozen=True)
class Balanced:
    """The balancer in front of the replicas (`balancer.call`'s spec) and the cycle's bounds."""

    spec: dict[str, Any]
    drain_timeout_s: float
    ready_timeout_s: float

    @classmethod
    def of(cls, spec: dict[str, Any]) -> "Balanced":
        """From a spec that carries its timeouts (the replicas manifest's `balancer`)."""
        return cls(spec, spec.get("drain_timeout_s", 120.0), spec.get("ready_timeout_s", 60.0))


def cycle(executor: Executor, host: Host, batch: Sequence[Replica], *, balanced: Balanced | None, gate: GateBatch,
          record: dict[str, Any], progress: Callable[[str], None], label: str = "",
          restarted: Callable[[], None] = lambda: None) -> None:
    """Drain `batch` (when `balanced`: no new requests, its sessions waited for, bounded), restart it,
    gate it, readmit it and wait until the balancer sees it UP. `record` gets each stage's figures and,
    on a failure, `failed_at` (the stage: drain, restart, a gate's name, readmit) before the error is
    raised again; `restarted` is called once the batch has been restarted."""
    units, servers = [r.unit for r in batch], [r.server for r in batch]
    names = ", ".join(units)
    stage = "drain"

    def at(name: str, title: str) -> None:
        nonlocal stage
        stage = name
        progress(f"{label}{title.lower()} on {names}")

    try:
        if balanced is not None:
            progress(f"{label}draining {names}")
            drained = balancer.call(executor, host, balanced.spec, "drain", servers, timeout_s=balanced.drain_timeout_s)
            record.update(drain_s=drained["waited_s"], drained=drained["ok"],
                          sessions_left=sum(s.get("sessions", 0) for n, s in drained["states"].items() if n in servers))
        stage = "restart"
        started = time.monotonic()
        for unit in units:
            progress(f"{label}restarting {unit}")
            executor.run(host, ["systemctl", "reset-failed", unit], timeout=60)
            check(executor.run(host, ["systemctl", "restart", unit], timeout=120), f"systemctl restart {unit}")
        restarted()
        gate(batch, at)
        record["restart_and_gates_s"] = round(time.monotonic() - started, 2)
        stage = "readmit"
        if balanced is not None:
            ready = balancer.call(executor, host, balanced.spec, "ready", servers, timeout_s=balanced.ready_timeout_s)
            record["readmit_s"] = ready["waited_s"]
            if not ready["ok"]:
                raise StepFailed(f"HAProxy on {host.name} did not see {names} UP within {balanced.ready_timeout_s:g}s "
                                 f"after readmitting them: {ready['states']}")
    except DdopsError:
        record["failed_at"] = stage
        raise

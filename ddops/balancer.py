"""HAProxy in front of a host's replicas, through its admin socket (the `balancer` action, run there).

Below the steps: the rolling restart drains and readmits with it, the health gate reads it, rollback
uses it to put replicas back one at a time. Every call is bounded; a socket that does not answer is
a StepFailed naming the host, never a hang.
"""

from __future__ import annotations

from typing import Any

from .errors import StepFailed
from .executor import Executor
from .inventory import Host
from .remote import run_probe


def call(executor: Executor, host: Host, balancer: dict[str, Any], action: str, servers: list[str] = (),
         timeout_s: float = 60.0) -> dict[str, Any]:
    """Run `action` (drain, ready, up, state) for `servers`; `balancer` holds socket and backend (the profile's
    Balancer as a dict, or the manifest's `balancer`). Returns the action's report; raises if the socket
    could not be used."""
    spec = {"socket": balancer["socket"], "backend": balancer["backend"], "servers": list(servers),
            "action": action, "timeout_s": timeout_s, "interval_s": 0.25}
    out = run_probe(executor, host, "balancer", stdin=spec, timeout=timeout_s + 60)
    if out.get("error"):
        raise StepFailed(f"HAProxy on {host.name} ({balancer['socket']}): {out['error']}",
                         fix=f"check `systemctl status {balancer.get('unit', 'haproxy.service')}` there")
    return out


def as_spec(profile) -> dict[str, Any]:
    """The profile's balancer as `call` takes it."""
    b = profile.balancer
    return {"socket": b.socket, "backend": b.backend, "unit": b.unit}

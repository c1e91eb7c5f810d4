"""The host's pivot lock (`paths.LOCK_PATH`): one ddops run changes a host at a time.

The lock is a JSON file created exclusively on the host (the `lock` action); it names its holder so a
refusal can say who holds it, and a stale one (its run died) is cleared with --break-lock.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Any

from . import history
from .errors import StepFailed
from .executor import Executor
from .inventory import Host
from .paths import LOCK_PATH
from .remote import run_probe


def holder_info(profile_name: str) -> dict[str, Any]:
    return {**history.who(), "pid": os.getpid(), "command": f"ddops pivot --deploy {profile_name}",
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "token": secrets.token_hex(8)}


def lock_problem(host: str, holder: dict | None) -> str | None:
    if holder is None:
        return None
    who = ", ".join(f"{k}={holder[k]}" for k in ("user", "control_host", "pid", "command", "started_at")
                    if k in holder)
    return (f"{host} is locked by another ddops run ({who or 'unknown holder'}); if that run is dead, "
            f"clear the lock with --break-lock")


def clear(executor: Executor, host: Host) -> dict[str, Any] | None:
    """Remove the lock whoever holds it; returns the holder it removed, if any."""
    out = run_probe(executor, host, "lock", {"action": "clear", "path": LOCK_PATH})
    return out.get("holder") if out.get("cleared") else None


def acquire(executor: Executor, host: Host, profile_name: str) -> str:
    """Take the lock or raise naming its holder; returns the token that releases it."""
    holder = holder_info(profile_name)
    out = run_probe(executor, host, "lock", {"action": "acquire", "path": LOCK_PATH, "holder": holder})
    if not out["acquired"]:
        raise StepFailed(lock_problem(host.name, out.get("holder")))
    return holder["token"]


def release(executor: Executor, host: Host, token: str) -> None:
    run_probe(executor, host, "lock", {"action": "release", "path": LOCK_PATH, "token": token})

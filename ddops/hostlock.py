"""The host's pivot lock (`paths.LOCK_PATH`): one ddops run changes a host at a time.

The lock is a JSON file created exclusively on the host (the `lock` action). It names its holder (who,
where, which command) and proves whether that holder still lives:
- on the same control machine, by its pid and that process's start time (a reused pid is not the holder);
- from another control machine, by a lease: the holder renews `renewed_at` every LEASE_S / 4 while it
  runs (`LeaseKeeper`); a lease past its expiry means the holder is gone.
`--break-lock` clears a lock only when its holder is provably dead; otherwise it refuses, naming it.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from . import history
from .errors import DdopsError, StepFailed, UsageError
from .executor import Executor
from .inventory import Host
from .paths import JOURNAL_PATH, LOCK_PATH
from .remote import run_probe

LEASE_S = 120.0    # a holder on another control machine is dead once its lease is this old
RENEW_TIMEOUT_S = 30.0


class LockLost(StepFailed):
    """The lock this run held was cleared or taken by another run: it must not change the host any more."""


def process_start(pid: int) -> str | None:
    """A process's identity beyond its pid: this boot's id and its start time in clock ticks (Linux's
    /proc); None where that cannot be read (then only the pid is compared)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"


def holder_info(command: str) -> dict[str, Any]:
    pid = os.getpid()
    return {**history.who(), "pid": pid, "pid_start": process_start(pid), "command": command,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "lease_s": LEASE_S,
            "token": secrets.token_hex(8)}


def describe(holder: dict[str, Any]) -> str:
    """The holder in words: `user@control-host pid N (command, since T)`."""
    if holder.get("unreadable"):
        return "an unreadable lock file"
    where = f"{holder.get('user', '?')}@{holder.get('control_host', '?')} pid {holder.get('pid', '?')}"
    what = ", ".join(str(holder[k]) for k in ("command", "started_at") if holder.get(k))
    return where + (f" ({what})" if what else "")


def lock_problem(host: str, holder: dict | None) -> str | None:
    if holder is None:
        return None
    return (f"{host} is locked by another ddops run: {describe(holder)}; if that run is dead, "
            f"clear the lock with --break-lock")


def liveness(holder: dict[str, Any], lease_left_s: float | None) -> str | None:
    """Why the holder is provably dead (a sentence), or None while it may be alive."""
    if holder.get("unreadable"):
        return "its lock file cannot be read"
    if holder.get("control_host") == history.who()["control_host"]:
        pid = holder.get("pid")
        if not isinstance(pid, int) or not _pid_exists(pid):
            return f"pid {pid} no longer runs on {holder.get('control_host')}"
        recorded, now = holder.get("pid_start"), process_start(pid)
        if recorded and now and recorded != now:
            return f"pid {pid} on {holder.get('control_host')} is now another process"
        return None
    if lease_left_s is None:
        return "it holds no lease (an older ddops)"
    if lease_left_s < 0:
        return f"its lease expired {-lease_left_s:.0f}s ago"
    return None


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def break_if_dead(executor: Executor, host: Host) -> dict[str, Any] | None:
    """--break-lock: clear the lock when its holder is provably dead and return it; refuse (UsageError,
    naming the holder) while it may be alive. None: there was no lock."""
    out = run_probe(executor, host, "lock", {"action": "inspect", "path": LOCK_PATH})
    holder = out.get("holder")
    if holder is None:
        return None
    dead = liveness(holder, out.get("lease_left_s"))
    if dead is None:
        left = out.get("lease_left_s")
        lease = f", lease renewed {holder['lease_s'] - left:.0f}s ago" if left is not None and holder.get("lease_s") else ""
        raise UsageError(f"{host.name} is locked by a live ddops run: {describe(holder)}{lease}; "
                         "--break-lock clears only a lock whose holder is dead",
                         fix="wait for that run to finish, or stop it")
    cleared = run_probe(executor, host, "lock", {"action": "clear", "path": LOCK_PATH, "token": holder.get("token")})
    if not cleared.get("cleared"):
        raise UsageError(f"the lock on {host.name} changed hands while it was being cleared: "
                         f"{describe(cleared.get('holder') or {})}", fix="run the command again")
    return {**holder, "dead": dead}


def acquire(executor: Executor, host: Host, command: str) -> str:
    """Take the lock or raise naming its holder; returns the token that releases it."""
    holder = holder_info(command)
    out = run_probe(executor, host, "lock", {"action": "acquire", "path": LOCK_PATH, "holder": holder})
    if not out["acquired"]:
        raise StepFailed(lock_problem(host.name, out.get("holder")))
    return holder["token"]


def release(executor: Executor, host: Host, token: str) -> None:
    run_probe(executor, host, "lock", {"action": "release", "path": LOCK_PATH, "token": token})


def lost_words(host: str, holder: dict[str, Any] | None) -> str:
    now = f"now held by {describe(holder)}" if holder else "it was cleared"
    return f"this run's lock on {host} was broken ({now}): stopping before the next change"


class LeaseKeeper:
    """Renews the lock's lease while a run holds it (a daemon thread, every LEASE_S / 4), and notes when
    the lock is no longer this run's. An unreachable host is retried at the next beat."""

    def __init__(self, executor: Executor, host: Host, token: str) -> None:
        self.executor, self.host, self.token = executor, host, token
        self.lost: dict[str, Any] | None = None   # the holder found instead of this run ({} : no lock)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name=f"ddops-lease-{host.name}", daemon=True)

    def start(self) -> "LeaseKeeper":
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing; a renewal in flight finishes first (it must not write the lock back after its
        release)."""
        self.stopping.set()
        self.thread.join(timeout=RENEW_TIMEOUT_S + 5)

    def __enter__(self) -> "LeaseKeeper":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def run(self) -> None:
        while not self.stopping.wait(LEASE_S / 4):
            try:
                out = run_probe(self.executor, self.host, "lock",
                                {"action": "renew", "path": LOCK_PATH, "token": self.token}, timeout=RENEW_TIMEOUT_S)
            except DdopsError:
                continue
            if not out.get("renewed"):
                self.lost = out.get("holder") or {}

    def check(self) -> None:
        if self.lost is not None:
            raise LockLost(lost_words(self.host.name, self.lost))


def journal(executor: Executor, host: Host, action: str, token: str | None = None, **spec: Any) -> dict[str, Any]:
    """One journal action (see actions/lock.py) under the lock held with `token`."""
    out = run_probe(executor, host, "lock", {"action": action, "path": LOCK_PATH, "journal": JOURNAL_PATH,
                                             "token": token, **spec})
    if out.get("lost"):
        raise LockLost(lost_words(host.name, out.get("holder")))
    return out


def unfinished_problem(host: str, journal: dict[str, Any]) -> str:
    """The one line that refuses a pivot over an unfinished one, with the way out."""
    return (f"{host} has an unfinished pivot ({history.unfinished_words(journal)}): restore the state from before it "
            f"with `ddops rollback --host {host}` (add --break-lock if its dead run still holds the lock)")

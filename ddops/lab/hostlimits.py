"""The machine's limits a lab of N hosts needs, checked before anything boots (and raised where we may).

Every lab host boots its own systemd, and all of them run as this machine's root: their inotify
instances and watches count against root's per-user limits. The kernel's default of 128 instances
runs out at about 20 hosts (each takes 6, its systemd and its services'), and
the host that hits it never gets its sshd up ("Failed to create inotify object: Too many open
files" on its console). The `lab up` process itself holds a few descriptors per host while it waits
for them (ssh's pipes, the banner socket), under its own RLIMIT_NOFILE.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import LabError


def read_sysctl(key: str) -> int:
    return int(_sysctl_path(key).read_text().split()[0])


def write_sysctl(key: str, value: int) -> None:
    _sysctl_path(key).write_text(f"{value}\n")


def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


def read_open_files() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_open_files(value: int) -> None:
    """Soft limit to `value`; the hard one too where it is lower (root may, CAP_SYS_RESOURCE)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < value:
        hard = value
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (value, hard))
    except ValueError as err:  # above the hard limit without the right to raise it
        raise PermissionError(str(err)) from err


@dataclass(frozen=True)
class Limit:
    """One limit: what it is called, what a host takes of it and what the rest of the machine keeps."""

    name: str
    per_host: int
    reserve: int
    fix: str                        # the command that sets it, with {value}
    lasts: str                      # how long a raise holds
    read: Callable[[], int]
    raise_to: Callable[[int], None]  # OSError where we may not

    def needed(self, hosts: int) -> int:
        return self.reserve + self.per_host * hosts


def _sysctl(key: str, per_host: int, reserve: int) -> Limit:
    return Limit(key, per_host, reserve, fix=f"sysctl -w {key}={{value}}", lasts="until reboot",
                 read=lambda: read_sysctl(key), raise_to=lambda value: write_sysctl(key, value))


# Measured on a booted lab host: 6 inotify instances, 21-24 watches. The control side holds about 4
# descriptors per host while it waits for them. Each figure has room on top of what was measured.
LIMITS = (
    _sysctl("fs.inotify.max_user_instances", per_host=8, reserve=64),
    _sysctl("fs.inotify.max_user_watches", per_host=64, reserve=2048),
    Limit("RLIMIT_NOFILE", per_host=8, reserve=64, fix="ulimit -n {value}",
          lasts="for this run",
          read=read_open_files, raise_to=raise_open_files),
)


@dataclass(frozen=True)
class Shortfall:
    limit: Limit
    current: int
    needed: int

    def raised(self) -> str:
        return f"{self.limit.name} {self.current} -> {self.needed} ({self.limit.lasts})"

    def refused(self) -> str:
        return f"{self.limit.name} is {self.current}"

    def fix(self) -> str:
        return self.limit.fix.format(value=self.needed)


def shortfalls(hosts: int, limits: tuple[Limit, ...] = LIMITS) -> list[Shortfall]:
    """The limits below what `hosts` lab hosts need (nothing changed)."""
    found = []
    for limit in limits:
        current, needed = limit.read(), limit.needed(hosts)
        if current < needed:
            found.append(Shortfall(limit, current, needed))
    return found


def ensure_limits(hosts: int, progress: Callable[[str], None],
                  limits: tuple[Limit, ...] = LIMITS) -> None:
    """Raise every limit below what `hosts` need, saying so in one line; refuse in one line if we may not."""
    short = shortfalls(hosts, limits)
    refused = []
    for s in short:
        try:
            s.limit.raise_to(s.needed)
        except OSError:
            refused.append(s)
    raised = [s for s in short if s not in refused]
    if raised:
        progress(f"Raised for {hosts} lab hosts: {', '.join(s.raised() for s in raised)}")
    if refused:
        raise LabError(f"{hosts} lab hosts need more than this machine allows: "
                       + ", ".join(f"{s.refused()}, they need {s.needed}" for s in refused),
                       fix="as root: " + " && ".join(s.fix() for s in refused))

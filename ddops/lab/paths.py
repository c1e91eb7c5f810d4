"""Where the lab keeps its state: one folder, `LAB_DIR`, overridable with DDOPS_LAB_DIR."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

LAB_DIR = Path(os.environ.get("DDOPS_LAB_DIR", "/var/lib/ddops/lab"))
ASSETS = Path(__file__).resolve().parent / "assets"
SUITE = "bookworm"


def lab_dir() -> Path:
    """LAB_DIR, read again so tests can point DDOPS_LAB_DIR elsewhere after import."""
    return Path(os.environ.get("DDOPS_LAB_DIR", str(LAB_DIR)))


@dataclass(frozen=True)
class HostDir:
    """The files of one lab host under LAB_DIR/hosts/NAME."""

    top: Path

    @property
    def root(self) -> Path:  # the overlay mount point the container boots from
        return self.top / "root"

    @property
    def upper(self) -> Path:  # the host's writable layer
        return self.top / "upper"

    @property
    def work(self) -> Path:
        return self.top / "work"

    @property
    def hostkeys(self) -> Path:  # kept across `up`s so known_hosts stays valid
        return self.top / "hostkeys"

    @property
    def console(self) -> Path:
        return self.top / "console.log"

    @property
    def pidfile(self) -> Path:
        return self.top / "nspawn.pid"

    @property
    def state(self) -> Path:
        return self.top / "state.json"


def host_dir(name: str) -> HostDir:
    return HostDir(lab_dir() / "hosts" / name)


def base_dir() -> Path:
    return lab_dir() / f"base-{SUITE}"

"""Shared fixtures. `lab`: the real local lab (systemd-nspawn hosts), booted once per test run.

Lab tests need root and systemd-nspawn + debootstrap; without them they are skipped with the reason.
The lab is shut down at the end of the run unless DDOPS_LAB_KEEP=1 (then the next run finds it up
and `lab up` leaves the running hosts alone).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAB_INVENTORY = REPO / "inventories" / "lab.yaml"


@dataclass(frozen=True)
class LabHostInfo:
    name: str
    port: int               # the host's own sshd on 127.0.0.1 (ct200's too, though ddops uses pct)
    pct: int | None = None
    via: str | None = None
    gpu_count: int = 0


@dataclass
class Lab:
    inventory_path: Path
    key: Path
    known_hosts: Path
    lab_dir: Path
    hosts: dict[str, LabHostInfo] = field(default_factory=dict)

    def ssh_argv(self, host: str, command: str | list[str]) -> list[str]:
        if not isinstance(command, str):
            command = shlex.join(command)
        return ["ssh", "-T", "-i", str(self.key), "-p", str(self.hosts[host].port),
                "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "ConnectTimeout=5",
                "-o", "LogLevel=ERROR", "root@127.0.0.1", command]

    def ssh(self, host: str, command: str | list[str], *, input: str | None = None,
            timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess:
        """Run `command` on a lab host with OpenSSH, straight to its own sshd port.

        A string goes to the remote shell as it is; a list is quoted argument by argument.
        """
        return subprocess.run(self.ssh_argv(host, command), input=input, capture_output=True,
                              text=True, timeout=timeout, check=check,
                              stdin=None if input is not None else subprocess.DEVNULL)


def _lab_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "the lab needs root (systemd-nspawn, overlay mounts)"
    from ddops.lab.rootfs import base_ready

    tools = ["systemd-nspawn", "ssh", "ssh-keygen"]
    cache = os.environ.get("DDOPS_LAB_ROOTFS_CACHE")
    if not base_ready() and not (cache and Path(cache).is_file()):
        tools.append("debootstrap")  # the rootfs must be built first
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        return f"the lab needs {', '.join(missing)} (apt-get install systemd-container debootstrap openssh-client)"
    return None


@pytest.fixture(scope="session")
def lab() -> Lab:
    reason = _lab_skip_reason()
    if reason:
        pytest.skip(reason)
    from ddops.lab import lab_down, lab_up
    from ddops.lab.paths import lab_dir
    from ddops.lab.spec import read_inventory, ssh_files

    doc, specs = read_inventory(LAB_INVENTORY)
    key, known_hosts = ssh_files(doc, lab_dir())
    lab_up(LAB_INVENTORY, progress=lambda line: print(line, file=sys.stderr))
    yield Lab(inventory_path=LAB_INVENTORY, key=key, known_hosts=known_hosts, lab_dir=lab_dir(),
              hosts={h.name: LabHostInfo(h.name, h.port, h.pct, h.via, h.gpus.count) for h in specs})
    if os.environ.get("DDOPS_LAB_KEEP") != "1":
        lab_down(progress=lambda line: print(line, file=sys.stderr))

"""Shared fixtures. `lab`: the real local lab (systemd-nspawn hosts), booted once per test run.

Lab tests need root and systemd-nspawn + debootstrap; without them they are skipped with the reason.
The lab is shut down at the end of the run unless DDOPS_LAB_KEEP=1 (then the next run finds it up
and `lab up` leaves the running hosts alone).
"""

from __future__ import annotations

import fcntl
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


# -- the tiny models (runtime tests, lab pivots) -----------------------------------------------------

TINY_SEED = 0


def _cache_root() -> Path:
    return Path(os.environ.get("DDOPS_CACHE") or Path.home() / ".cache" / "ddops")


def _tiny(name: str, arch: str) -> Path:
    """Path holding target/ and draft/, built by ddtree-tiny on first use and reused while OUT/.complete
    exists. A file lock keeps parallel sessions from building twice."""
    out = _cache_root() / f"{name}-seed{TINY_SEED}"
    if not (out / ".complete").exists():
        out.mkdir(parents=True, exist_ok=True)
        with open(out.parent / f".{out.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / ".complete").exists():
                from ddtree_runtime.tiny import build

                build(out, TINY_SEED, arch=arch)
    # the tiny models are all per-op overhead: one intra-op thread is faster than two and keeps test
    # times stable when the CPUs are shared (the build above keeps torch's default, for determinism)
    import torch

    torch.set_num_threads(1)
    return out


@pytest.fixture(scope="session")
def tiny_models() -> Path:
    """The tiny Qwen3 target + DFlash drafter."""
    return _tiny("tiny-models", "qwen3")


@pytest.fixture(scope="session")
def tiny_hybrid_models() -> Path:
    """The tiny hybrid (Gated DeltaNet + full attention, Qwen3.5-style) target + DFlash drafter."""
    return _tiny("tiny-hybrid", "qwen3_5")

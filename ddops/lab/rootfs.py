"""The cached Debian 12 base every lab host boots from (read-only lower layer of each overlay)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable

from .errors import LabError
from .paths import SUITE, base_dir

PACKAGES = ("systemd", "systemd-sysv", "dbus", "openssh-server", "openssh-client", "python3",
            "python3-venv", "rsync", "procps", "iproute2", "ca-certificates")
MARKER = ".ddops-lab-base"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# What the control machine needs, and the Debian package that provides it.
TOOLS = {"systemd-nspawn": "systemd-container", "ssh": "openssh-client",
         "ssh-keygen": "openssh-client", "setsid": "util-linux", "mount": "mount"}


def check_control_machine() -> None:
    """Raise LabError unless we are root and every tool the lab runs is installed."""
    if os.geteuid() != 0:
        raise LabError("the lab needs root (systemd-nspawn and overlay mounts)",
                       fix="run it as root, e.g. `sudo ddops lab up`")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        packages = " ".join(sorted({TOOLS[tool] for tool in missing}))
        raise LabError(f"the lab needs {', '.join(missing)}, not found on this machine",
                       fix=f"apt-get install -y {packages}")


def debian_mirror() -> str:
    """DDOPS_LAB_MIRROR, else the Debian mirror apt already uses here, else deb.debian.org."""
    if os.environ.get("DDOPS_LAB_MIRROR"):
        return os.environ["DDOPS_LAB_MIRROR"]
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for src in sources:
        try:
            text = src.read_text()
        except OSError:
            continue
        for url in re.findall(r"(?:^deb\s+(?:\[[^\]]*\]\s+)?|^URIs:\s*)(\S+)", text, re.M):
            if re.search(r"/debian/?$", url) and url.startswith(("http://", "https://")):
                return url.rstrip("/")
    return DEFAULT_MIRROR


def _marker_text() -> str:
    return f"suite={SUITE} packages={','.join(PACKAGES)}\n"


def base_ready(base: Path | None = None) -> bool:
    base = base or base_dir()
    try:
        return (base / MARKER).read_text() == _marker_text()
    except OSError:
        return False


def ensure_base(progress: Callable[[str], None]) -> Path:
    """Return the base rootfs, building it (debootstrap, ~1 min) or unpacking the CI cache first."""
    base = base_dir()
    if base_ready(base):
        return base
    if _in_use(base):
        raise LabError(f"the base rootfs {base} is incomplete but lab hosts still use it",
                       fix="run `ddops lab down` first")
    building = base.with_name(base.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    cache = os.environ.get("DDOPS_LAB_ROOTFS_CACHE")
    if cache and Path(cache).is_file():
        progress(f"Unpacking the cached Debian {SUITE} rootfs from {cache}")
        building.mkdir(parents=True)
        _run(["tar", "-C", str(building), "--numeric-owner", "-xpf", cache], "unpacking the rootfs cache")
    else:
        if shutil.which("debootstrap") is None:
            raise LabError("building the lab rootfs needs debootstrap, not found on this machine",
                           fix="apt-get install -y debootstrap (or point DDOPS_LAB_ROOTFS_CACHE at a saved rootfs)")
        mirror = debian_mirror()
        progress(f"Building the Debian {SUITE} rootfs with debootstrap from {mirror} (about a minute)")
        start = time.monotonic()
        building.parent.mkdir(parents=True, exist_ok=True)
        _run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
              str(building), mirror], "debootstrap", log=building.with_suffix(".log"), progress=progress)
        _trim(building)
        progress(f"debootstrap done in {time.monotonic() - start:.0f} s")
    (building / MARKER).write_text(_marker_text())
    building.rename(base)
    if cache and not Path(cache).is_file():
        progress(f"Saving the rootfs to {cache} for later runs")
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        _run(["tar", "-C", str(base), "--numeric-owner", "-cpf", cache + ".tmp", "."], "saving the rootfs cache")
        os.replace(cache + ".tmp", cache)
    return base


def _trim(root: Path) -> None:
    """Drop what must differ per host (host keys, machine-id, hostname) and the package cache."""
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    (root / "etc/machine-id").write_text("")
    (root / "etc/hostname").unlink(missing_ok=True)
    for deb in (root / "var/cache/apt/archives").glob("*.deb"):
        deb.unlink()
    for lists in (root / "var/lib/apt/lists").glob("*_Packages"):
        lists.unlink()


def _in_use(base: Path) -> bool:
    try:
        mounts = Path("/proc/mounts").read_text()
    except OSError:
        return False
    return f"lowerdir={base}," in mounts or f"lowerdir={base} " in mounts


PROGRESS_EVERY_S = 8.0   # a long command logged to a file still shows a line this often
TIMEOUT_S = 1800.0


def _run(argv: list[str], what: str, log: Path | None = None,
         progress: Callable[[str], None] | None = None) -> None:
    """Run argv; with a log, its output goes there and `progress` hears its latest line every few seconds."""
    if log is None:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
        if proc.returncode != 0:
            raise LabError(f"{what} failed (exit {proc.returncode}): {(proc.stdout or '').strip().splitlines()[-1:]}")
        return
    start = time.monotonic()
    with open(log, "w") as out:
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            while True:
                try:
                    code = child.wait(timeout=PROGRESS_EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() - start > TIMEOUT_S:
                        raise LabError(f"{what} took over {TIMEOUT_S:.0f}s; see {log}") from None
                    if progress is not None:
                        progress(f"{what}, {time.monotonic() - start:.0f}s: {_last_line(log)}")
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    if code != 0:
        raise LabError(f"{what} failed (exit {code}): see {log}")


def _last_line(path: Path) -> str:
    try:
        lines = path.read_bytes()[-4096:].decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:120] if lines else ""

"""A lab host's root: an overlay over the cached base (or a copy), then its own files on top."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from .errors import LabError
from .paths import ASSETS, HostDir, lab_dir
from .spec import LabHost

# Units that wait for hardware a container lacks, or wake up to do nothing useful here.
MASKED = ("console-getty.service", "container-getty@.service", "getty@.service",
          "systemd-networkd-wait-online.service", "apt-daily.timer", "apt-daily-upgrade.timer",
          "e2scrub_all.timer", "e2scrub_reap.service", "dpkg-db-backup.timer", "fstrim.timer")


@dataclass(frozen=True)
class LabKeys:
    """Public keys the hosts must trust, and the private key only the pct node holds."""

    control_pub: str
    pct_private: Path
    pct_pub: str


def ssh_keygen(path: Path, comment: str) -> str:
    """Create an ed25519 key pair at `path` unless it exists; return the public key line."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                       check=True, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    return path.with_name(path.name + ".pub").read_text().strip()


def host_key(hd: HostDir, name: str) -> str:
    """The host's own sshd key, generated once and kept so known_hosts stays valid across `up`s."""
    return ssh_keygen(hd.hostkeys / "ssh_host_ed25519_key", f"root@{name}")


def is_mounted(path: Path) -> bool:
    return os.path.ismount(path)


def release_root(hd: HostDir) -> None:
    """Unmount the host's overlay (lazily if something still holds it)."""
    if is_mounted(hd.root):
        if subprocess.run(["umount", str(hd.root)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(hd.root)], capture_output=True)


def make_root(hd: HostDir, base: Path, keep: bool = False) -> str:
    """The host's root at hd.root, fresh unless `keep` (and a previous layer exists).

    Returns "overlay", or "copy" where overlayfs is refused (a full copy of the base).
    """
    release_root(hd)
    if keep and hd.upper.is_dir() and any(hd.root.iterdir() if hd.root.is_dir() else ()):
        return "copy"  # a kept copy-mode root: nothing to mount
    if not (keep and hd.upper.is_dir()):
        for d in (hd.upper, hd.work, hd.root):
            discard(d)
        empty_trash()
    for d in (hd.upper, hd.work, hd.root):
        d.mkdir(parents=True, exist_ok=True)
    opts = f"lowerdir={base},upperdir={hd.upper},workdir={hd.work}"
    if subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(hd.root)],
                      capture_output=True).returncode == 0:
        return "overlay"
    proc = subprocess.run(["cp", "-a", "--reflink=auto", f"{base}/.", str(hd.root)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise LabError(f"cannot create the root of {hd.top.name}: {proc.stderr.strip()}")
    return "copy"


def trash_dir() -> Path:
    return lab_dir() / "trash"


def discard(path: Path) -> None:
    """Move a previous writable layer out of the way at once; empty_trash deletes it in the background.

    A layer a pivot wrote holds a venv with torch (tens of thousands of files): deleting it in line
    made a warm `lab up` take 20-30 s on two busy cores, with nothing to show for it.
    """
    if not path.exists():
        return
    trash = trash_dir()
    trash.mkdir(parents=True, exist_ok=True)
    try:
        path.rename(trash / f"{path.parent.name}-{path.name}-{uuid.uuid4().hex[:8]}")
    except OSError:  # a mount point, say: delete it here
        shutil.rmtree(path, ignore_errors=True)


def empty_trash() -> None:
    """Delete what discard moved aside, detached: the removal outlives this command if it must."""
    entries = [str(p) for p in trash_dir().iterdir()] if trash_dir().is_dir() else []
    if entries:
        subprocess.Popen(["rm", "-rf", "--one-file-system", "--", *entries], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


class RootWriter:
    """Writes files inside a container root without ever following a link out of it."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def path(self, rel: str) -> Path:
        target = self.root / rel.lstrip("/")
        parent = target.parent
        parent.mkdir(parents=True, exist_ok=True)
        if not str(parent.resolve()).startswith(str(self.root)):
            raise LabError(f"{rel} would be written outside the container root {self.root}")
        if target.is_symlink():
            target.unlink()
        return target

    def text(self, rel: str, content: str, mode: int = 0o644) -> None:
        target = self.path(rel)
        target.write_text(content)
        os.chmod(target, mode)

    def asset(self, name: str, rel: str, mode: int = 0o644) -> None:
        self.text(rel, (ASSETS / name).read_text(), mode)

    def link(self, rel: str, to: str) -> None:
        target = self.path(rel)
        if target.exists():
            target.unlink()
        target.symlink_to(to)

    def enable(self, unit: str) -> None:
        self.link(f"etc/systemd/system/multi-user.target.wants/{unit}", f"/etc/systemd/system/{unit}")


def assets_digest() -> str:
    """Changes when any asset changes, so `up` rebuilds hosts that run old copies."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for path in sorted(ASSETS.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def populate(hd: HostDir, host: LabHost, keys: LabKeys, guest_keys: dict[str, str]) -> None:
    """Everything that makes the base into this host: identity, sshd, GPUs, fixtures."""
    w = RootWriter(hd.root)
    name = host.name
    w.text("etc/hostname", name + "\n")
    w.text("etc/hosts", f"127.0.0.1\tlocalhost\n127.0.1.1\t{name}\n::1\tlocalhost ip6-localhost\n")
    w.text("etc/machine-id", uuid.uuid5(uuid.NAMESPACE_DNS, f"{name}.ddops-lab").hex + "\n", 0o444)
    for unit in MASKED:
        w.link(f"etc/systemd/system/{unit}", "/dev/null")

    w.text("etc/ssh/sshd_config", (ASSETS / "sshd_config").read_text().replace("{port}", str(host.port)))
    for suffix, mode in (("", 0o600), (".pub", 0o644)):
        src = hd.hostkeys / f"ssh_host_ed25519_key{suffix}"
        w.text(f"etc/ssh/ssh_host_ed25519_key{suffix}", src.read_text(), mode)
    authorized = [keys.control_pub] + ([keys.pct_pub] if host.pct is not None else [])
    w.text("root/.ssh/authorized_keys", "\n".join(authorized) + "\n", 0o600)
    os.chmod(hd.root / "root/.ssh", 0o700)

    w.text("etc/ddops-lab/host.json", json.dumps(
        {"name": name, "port": host.port, "fixtures": list(host.fixtures), "pct": host.pct,
         "via": host.via}, indent=2) + "\n")
    w.text("etc/ddops-lab/gpus.json", json.dumps(host.gpu_config(), indent=2) + "\n")
    w.asset("ddops_lab_gpu.py", "usr/lib/python3/dist-packages/ddops_lab_gpu.py")
    if host.gpus.count:
        w.asset("nvidia-smi", "usr/bin/nvidia-smi", 0o755)
    w.asset("pip.conf", "etc/pip.conf")
    (hd.root / "opt/wheels").mkdir(parents=True, exist_ok=True)
    w.text("etc/tmpfiles.d/ddops-gpu.conf", "d /run/ddops-gpu 0755 root root -\n")
    # The imitated kernel log (ddops_lab_gpu.xid writes the driver's Xid lines there): nspawn gives a container
    # no /dev/kmsg, and tmpfiles.d leaves /dev alone in one, so a unit makes it an empty file at each boot.
    w.text("etc/systemd/system/ddops-lab-kmsg.service",
           "[Unit]\nDescription=ddops lab: the imitated kernel log /dev/kmsg\nDefaultDependencies=no\n"
           "Before=sysinit.target\n\n[Service]\nType=oneshot\nExecStart=/usr/bin/install -m 0600 /dev/null /dev/kmsg\n"
           "\n[Install]\nWantedBy=multi-user.target\n")
    w.enable("ddops-lab-kmsg.service")
    # The journal lives in memory: no 8 MiB journal file per host, and nothing to flush at boot.
    w.text("etc/systemd/journald.conf.d/ddops-lab.conf", "[Journal]\nStorage=volatile\nRuntimeMaxUse=32M\n")

    if "training" in host.fixtures:
        w.asset("train_dflash_pipeline.py", "opt/train/train_dflash_pipeline.py", 0o755)
        w.asset("dflash-train.service", "etc/systemd/system/dflash-train.service")
        w.text("etc/default/dflash-train", "# DFLASH_IGNORE_SIGTERM=1\n# DFLASH_STEP_SECONDS=0.5\n")
        (hd.root / "root/train/checkpoints").mkdir(parents=True, exist_ok=True)
        w.enable("dflash-train.service")
    if "sglang" in host.fixtures:
        # The stand-in SGLang as the module `sglang.launch_server` of the system python3, which
        # /opt/sglang/venv/bin/python is (the lab's SGLang install: profiles name that interpreter).
        w.text("usr/lib/python3/dist-packages/sglang/__init__.py", '"""ddops lab stand-in for SGLang."""\n')
        w.asset("sglang_stub.py", "usr/lib/python3/dist-packages/sglang/launch_server.py")
        w.link("opt/sglang/venv/bin/python", "/usr/bin/python3")
        w.asset("sglang-qwen.service", "etc/systemd/system/sglang-qwen.service")
        w.enable("sglang-qwen.service")
    if "models" in host.fixtures:
        w.text("root/models/README.md", "Models for evaluation. `ddops lab up` copies "
               f"{lab_dir()}/seed-models/{name}/* here.\n")
        copy_seed_models(hd, name)
    if host.containers:
        w.asset("pct", "usr/sbin/pct", 0o755)
        w.text("etc/pve/lab-containers.json", json.dumps(
            {str(vmid): {"name": g, "hostname": g, "port": port} for vmid, g, port in host.containers},
            indent=2) + "\n")
        w.text("root/.ssh/pct_id_ed25519", keys.pct_private.read_text(), 0o600)
        w.text("etc/ddops-lab/pct_known_hosts", "".join(
            f"[127.0.0.1]:{port} {guest_keys[g]}\n" for _, g, port in host.containers))


def copy_seed_models(hd: HostDir, name: str) -> None:
    """Copy LAB_DIR/seed-models/NAME/* into the host's /root/models (also into a running host's root)."""
    seed = lab_dir() / "seed-models" / name
    if seed.is_dir():
        subprocess.run(["cp", "-a", "--reflink=auto", f"{seed}/.", str(hd.root / "root/models")],
                       check=True, capture_output=True)

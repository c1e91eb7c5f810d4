"""`ddops lab up|down|status` as plain functions (the CLI wraps them; no click here)."""

from __future__ import annotations

import fcntl
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from . import hostfs, machine, tiny
from .errors import LabError
from .hostlimits import ensure_limits
from .paths import HostDir, host_dir, lab_dir
from .rootfs import check_control_machine, ensure_base
from .spec import LabHost, read_inventory, ssh_files, write_inventory

SGLANG_PORT = 30000
BOOT_TIMEOUT = 90.0

Progress = Callable[[str], None]


@dataclass(frozen=True)
class LabHostState:
    name: str
    port: int
    pid: int | None
    running: bool
    sshd_ok: bool
    rootfs: Path
    console: Path
    boot_seconds: float | None = None  # set by `up` for hosts it booted


def lab_up(inventory: Path, extra: int = 0, progress: Progress = print,
           keep_state: bool = False) -> list[LabHostState]:
    """Bring the lab to exactly the inventory's hosts (+ `extra` eval hosts), booted and reachable.

    Hosts already running with the same spec are left alone; hosts that changed or are no longer
    wanted are shut down. Hosts it boots get a fresh writable layer over the cached base, unless
    `keep_state` keeps what they wrote since the last `up`. The tiny model pairs are installed from their
    fixtures into $DDOPS_CACHE and the drafter put on the eval host, so the lab profiles work at once.
    The machine's limits for that many hosts (inotify, open files) are raised first, or `up` refuses.
    """
    check_control_machine()
    doc, hosts = read_inventory(Path(inventory), extra)
    ensure_limits(len(hosts), progress)  # before any change: a host past a limit never gets its sshd up
    lab = lab_dir()
    lab.mkdir(parents=True, exist_ok=True)
    with _locked(lab):
        base = ensure_base(progress)
        key, known_hosts = ssh_files(doc, lab)
        keys = hostfs.LabKeys(control_pub=hostfs.ssh_keygen(key, "ddops-lab-control"),
                              pct_private=lab / "ssh" / "pct_id_ed25519",
                              pct_pub=hostfs.ssh_keygen(lab / "ssh" / "pct_id_ed25519", "root@pve-pct"))
        running = _stop_unwanted({h.name: h for h in hosts}, progress)
        to_boot = [h for h in hosts if h.name not in running]
        _check_ports(to_boot)
        host_keys = {h.name: hostfs.host_key(host_dir(h.name), h.name) for h in hosts}
        _write_known_hosts(known_hosts, hosts, host_keys)
        if running:
            progress(f"Already running: {', '.join(sorted(running))}")
        tiny.provide_lab_models(lab / "seed-models", progress)
        booted = _boot(to_boot, base, keys, host_keys, key, known_hosts, keep_state, progress)
        for h in hosts:  # hosts left running get the seed models too: the README's pivot needs them
            if h.name in running and "models" in h.fixtures:
                hostfs.copy_seed_models(host_dir(h.name), h.name)
        write_inventory(doc, lab / "inventory.yaml")
    by_name = {s.name: s for s in lab_status()}
    return [_with_boot_time(by_name[h.name], booted.get(h.name)) for h in hosts if h.name in by_name]


def lab_down(progress: Progress = print) -> list[LabHostState]:
    """Shut every lab host down (clean poweroff, SIGKILL after a deadline) and unmount its root."""
    check_control_machine()
    lab = lab_dir()
    if not lab.is_dir():
        return []
    with _locked(lab):
        dirs = _host_dirs()
        live = [hd for hd in dirs if _proc(hd) is not None]
        if live:
            progress(f"Shutting down {', '.join(hd.top.name for hd in live)}")
        with ThreadPoolExecutor(max_workers=max(1, len(dirs))) as pool:
            list(pool.map(lambda hd: _shutdown(hd, progress), dirs))
    return lab_status()


def lab_status() -> list[LabHostState]:
    """Every host the lab knows of: its pid, whether it runs and whether its sshd answers."""
    states = []
    for hd in _host_dirs():
        st = machine.read_state(hd) or {}
        proc = _proc(hd)
        port = int(st.get("port", 0))
        states.append(LabHostState(
            name=hd.top.name, port=port, pid=proc.pid if proc else None, running=proc is not None,
            sshd_ok=bool(proc) and machine.sshd_answers(port, timeout=1.0),
            rootfs=hd.root, console=hd.console))
    return sorted(states, key=lambda s: (s.port, s.name))


# --- helpers ------------------------------------------------------------------------------------

@contextmanager
def _locked(lab: Path) -> Iterator[None]:
    """One `up`/`down` at a time on this machine."""
    with open(lab / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _host_dirs() -> list[HostDir]:
    top = lab_dir() / "hosts"
    return sorted((HostDir(p) for p in top.iterdir() if p.is_dir()), key=lambda hd: hd.top.name) \
        if top.is_dir() else []


def _proc(hd: HostDir) -> machine.Proc | None:
    st = machine.read_state(hd)
    if not st or not st.get("pid"):
        return None
    proc = machine.Proc(int(st["pid"]), int(st.get("starttime") or 0))
    return proc if proc.alive() else None


def _shutdown(hd: HostDir, progress: Progress) -> None:
    st = machine.read_state(hd) or {}
    proc = machine.Proc(int(st.get("pid") or 0), int(st.get("starttime") or 0))
    if st.get("pid") and not machine.stop(proc, machine.read_init(st)):
        progress(f"{hd.top.name} did not power off cleanly; killed it (see {hd.console})")
    hostfs.release_root(hd)


def _stop_unwanted(wanted: dict[str, LabHost], progress: Progress) -> set[str]:
    """Shut down hosts that are unwanted or changed; return the names left running."""
    keep, stop = set(), []
    for hd in _host_dirs():
        name, proc = hd.top.name, _proc(hd)
        st = machine.read_state(hd) or {}
        if proc is not None and name in wanted and st.get("fingerprint") == _fingerprint(wanted[name]):
            keep.add(name)
        else:
            stop.append(hd)
    live = [hd.top.name for hd in stop if _proc(hd) is not None]
    if live:
        progress(f"Shutting down changed or unwanted hosts: {', '.join(live)}")
    with ThreadPoolExecutor(max_workers=max(1, len(stop))) as pool:
        list(pool.map(lambda hd: _shutdown(hd, progress), stop))
    for hd in stop:  # hosts no longer in the lab leave nothing behind
        if hd.top.name not in wanted and not hostfs.is_mounted(hd.root):
            shutil.rmtree(hd.top, ignore_errors=True)
    return keep


def _fingerprint(host: LabHost) -> str:
    return f"{host.fingerprint()}-{hostfs.assets_digest()}"


def _check_ports(hosts: list[LabHost]) -> None:
    for h in hosts:
        ports = [(h.port, "sshd")] + ([(SGLANG_PORT, "sglang")] if "sglang" in h.fixtures else [])
        for port, what in ports:
            if not machine.port_free(port):
                raise LabError(f"port {port} ({what} of {h.name}) is already in use by another process",
                               fix=f"find it with `ss -ltnp 'sport = :{port}'` and stop it")


def _write_known_hosts(path: Path, hosts: list[LabHost], host_keys: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"[127.0.0.1]:{h.port} {host_keys[h.name]}\n" for h in hosts))
    tmp.replace(path)


def _boot(hosts: list[LabHost], base: Path, keys: hostfs.LabKeys, host_keys: dict[str, str],
          key: Path, known_hosts: Path, keep_state: bool, progress: Progress) -> dict[str, float]:
    """Prepare and start every host, then wait for all of them; seconds to ready per host."""
    if not hosts:
        return {}
    progress(f"Booting {', '.join(h.name for h in hosts)}")
    procs = {}
    for h in hosts:
        hd = host_dir(h.name)
        mode = hostfs.make_root(hd, base, keep=keep_state)
        hostfs.populate(hd, h, keys, host_keys)
        procs[h.name] = machine.start(h, hd)
        init = machine.find_init(procs[h.name])
        machine.write_state(hd, h, procs[h.name], init, mode, _fingerprint(h))
    deadline = time.monotonic() + BOOT_TIMEOUT

    def wait(h: LabHost) -> float:
        return machine.wait_ready(h, host_dir(h.name), procs[h.name], key, known_hosts, deadline)

    with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
        futures = {h.name: pool.submit(wait, h) for h in hosts}
        errors, times = [], {}
        for name, fut in futures.items():
            try:
                times[name] = fut.result()
            except LabError as err:
                errors.append(err)
    if errors:
        raise errors[0]
    progress("ready: " + ", ".join(f"{n} {t:.1f}s" for n, t in times.items()))
    return times


def _with_boot_time(state: LabHostState, seconds: float | None) -> LabHostState:
    if seconds is None:
        return state
    return LabHostState(**{**state.__dict__, "boot_seconds": round(seconds, 2)})

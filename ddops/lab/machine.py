"""Running a lab host: systemd-nspawn in the background, its pid, its sshd, its shutdown."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import LabError
from .paths import HostDir
from .spec import LabHost

CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
WHEELS = Path("/opt/wheels")


@dataclass(frozen=True)
class Proc:
    """The nspawn process of a host, identified by pid and start time (pids get reused)."""

    pid: int
    starttime: int

    def alive(self) -> bool:
        return proc_starttime(self.pid) == self.starttime and _is_nspawn(self.pid)


@dataclass(frozen=True)
class Init:
    """The container's PID 1 as seen from here. Killing it ends everything in the container,
    which matters when nspawn itself died: its container would otherwise run on, orphaned."""

    pid: int
    starttime: int

    def alive(self) -> bool:
        return proc_starttime(self.pid) == self.starttime

    def kill(self, timeout: float = 10.0) -> None:
        """Ask systemd to power off (SIGRTMIN+4), then SIGKILL the whole namespace at the deadline."""
        for sig, wait in ((signal.SIGRTMIN + 4, timeout), (signal.SIGKILL, 5.0)):
            if not self.alive():
                return
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.05)


def find_init(nspawn: Proc, timeout: float = 30.0) -> Init | None:
    """The child of nspawn that is PID 1 of its own pid namespace. It appears within milliseconds on an
    idle machine, but hosts boot one after another, and on two busy cores (a CI run) it once took over 3 s;
    the fault tests need it (they freeze a host by its namespace)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and nspawn.alive():
        try:
            children = Path(f"/proc/{nspawn.pid}/task/{nspawn.pid}/children").read_text().split()
        except OSError:
            children = []
        for child in map(int, children):
            try:
                status = Path(f"/proc/{child}/status").read_text()
            except OSError:
                continue
            nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            started = proc_starttime(child)
            if len(nspid) > 1 and nspid[-1] == "1" and started is not None:
                return Init(child, started)
        time.sleep(0.02)
    return None


def proc_starttime(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _is_nspawn(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"systemd-nspawn")
    except OSError:
        return False


def nspawn_argv(host: LabHost, hd: HostDir) -> list[str]:
    argv = ["systemd-nspawn", "--boot", "--register=no", "--keep-unit", "--quiet",
            "-D", str(hd.root), f"--machine={host.name}", f"--hostname={host.name}",
            "--console=read-only", "--link-journal=no", "--resolv-conf=copy-host",
            "--timezone=copy"]
    if WHEELS.is_dir():
        argv.append(f"--bind-ro={WHEELS}:/opt/wheels")
    if CA_BUNDLE.is_file():
        argv.append(f"--bind-ro={CA_BUNDLE}:/etc/ddops-lab/ca.crt")
    return argv


def start(host: LabHost, hd: HostDir) -> Proc:
    """Boot the host detached from us (own session, reparented to init); return its process."""
    hd.pidfile.unlink(missing_ok=True)
    with open(hd.console, "wb") as console:  # one boot per log
        console.write(f"\n==== ddops lab: booting {host.name} at {time.ctime()} ====\n".encode())
        console.flush()
        subprocess.run(["setsid", "-f", "sh", "-c", 'echo $$ > "$0" && exec "$@"', str(hd.pidfile),
                        *nspawn_argv(host, hd)],
                       stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT, check=True,
                       timeout=10)
    # The pid is written by the shell before it execs nspawn: until the exec, the process is still `sh`,
    # and a Proc taken then is not alive() (its command is not nspawn), which read as "stopped while
    # booting" on a loaded machine. So wait for the exec too.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            pid = int(hd.pidfile.read_text())
        except (OSError, ValueError):
            time.sleep(0.02)
            continue
        started = proc_starttime(pid)
        if started is None:
            break
        if _is_nspawn(pid):
            return Proc(pid, started)
        time.sleep(0.02)
    raise LabError(f"systemd-nspawn for {host.name} exited at once", fix=f"see {hd.console}")


def stop(proc: Proc, init: Init | None, timeout: float = 45.0) -> bool:
    """SIGTERM (a clean poweroff inside), SIGKILL after `timeout`; True if it shut down cleanly."""
    if not proc.alive():
        if init is not None and init.alive():  # nspawn died and left its container running
            init.kill()
            return False
        return True
    os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            return True
        time.sleep(0.05)
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if init is not None:
        init.kill(timeout=0)
    for _ in range(100):
        if not proc.alive():
            break
        time.sleep(0.05)
    return False


def sshd_answers(port: int, timeout: float = 1.0) -> bool:
    """True when something on 127.0.0.1:port speaks SSH (sends its banner)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ssh_argv(port: int, key: Path, known_hosts: Path, *command: str) -> list[str]:
    return ["ssh", "-T", "-i", str(key), "-p", str(port), "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}",
            "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR", "root@127.0.0.1", *command]


def wait_ready(host: LabHost, hd: HostDir, proc: Proc, key: Path, known_hosts: Path,
               deadline: float) -> float:
    """Wait for the banner, then for a real key login that sees the boot finished; seconds taken."""
    start = time.monotonic()
    while not sshd_answers(host.port, timeout=0.5):
        if not proc.alive():
            raise LabError(f"{host.name} stopped while booting", fix=f"see {hd.console}")
        if time.monotonic() > deadline:
            raise LabError(f"{host.name}: no sshd on 127.0.0.1:{host.port} after boot",
                           fix=f"see {hd.console}")
        time.sleep(0.05)
    last = ""
    while time.monotonic() < deadline:
        left = max(1, int(deadline - time.monotonic()))
        argv = ssh_argv(host.port, key, known_hosts, f"timeout {left} systemctl is-system-running --wait")
        try:
            res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                 timeout=left + 5)
        except subprocess.TimeoutExpired:
            break
        state = res.stdout.strip()
        if state in ("running", "degraded"):
            return time.monotonic() - start
        last = (res.stderr.strip() or state or f"exit {res.returncode}").splitlines()[-1]
        time.sleep(0.2)
    raise LabError(f"{host.name}: ssh root@127.0.0.1:{host.port} did not come up ({last})",
                   fix=f"see {hd.console}")


def write_state(hd: HostDir, host: LabHost, proc: Proc, init: Init | None, mode: str,
                fingerprint: str) -> None:
    hd.state.write_text(json.dumps({
        "name": host.name, "port": host.port, "pid": proc.pid, "starttime": proc.starttime,
        "init_pid": init.pid if init else None, "init_starttime": init.starttime if init else None,
        "fingerprint": fingerprint, "mode": mode, "root": str(hd.root)}, indent=2) + "\n")


def read_init(state: dict) -> Init | None:
    if not state.get("init_pid"):
        return None
    return Init(int(state["init_pid"]), int(state.get("init_starttime") or 0))


def read_state(hd: HostDir) -> dict | None:
    try:
        return json.loads(hd.state.read_text())
    except (OSError, ValueError):
        return None

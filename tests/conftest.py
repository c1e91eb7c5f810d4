"""Shared fixtures. `lab`: the real local lab (systemd-nspawn hosts), booted once per test run.

Lab tests need root and systemd-nspawn + debootstrap; without them they are skipped with the reason.
A lab the run booted is shut down at its end unless DDOPS_LAB_KEEP=1 (then the next run finds it up
and `lab up` leaves the running hosts alone); a lab that was already running is left running.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
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


# -- never silent in a log ---------------------------------------------------------------------------

HEARTBEAT_S = 8.0   # in a log (not a terminal), a test or fixture running longer says so this often


def _say(config: pytest.Config, line: str) -> None:
    """A line on pytest's own terminal, past output capture (fixtures' progress: lab boot, model install).
    An xdist worker's terminal goes nowhere: it writes to its stderr, which is the controller's."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if capture is None:
        print(line, file=sys.stderr)
        return
    with capture.global_and_fixture_disabled():  # as pytest's live logging does
        if reporter is None or hasattr(config, "workerinput"):
            print(line, file=sys.stderr, flush=True)
        else:
            reporter.write_line(line)


_running: dict[str, list[float]] = {}   # test in flight -> [when it started, when it was last named]
_session_over = threading.Event()


def pytest_sessionstart(session: pytest.Session) -> None:
    """In a log, a thread names each test in flight every HEARTBEAT_S. It runs where the log is written:
    in the one process, or under xdist (make test) in the controller, which hears each worker's tests
    start and finish."""
    config = session.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if hasattr(config, "workerinput") or reporter is None or reporter.isatty:
        return

    def beat() -> None:
        while not _session_over.wait(1.0):
            now = time.monotonic()
            for nodeid, times in list(_running.items()):
                if now - times[1] >= HEARTBEAT_S:
                    times[1] = now
                    _say(config, f"    ... {nodeid} still running ({now - times[0]:.0f}s)")

    threading.Thread(target=beat, name="test-heartbeat", daemon=True).start()


def pytest_runtest_logstart(nodeid: str, location) -> None:
    now = time.monotonic()
    _running[nodeid] = [now, now]


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    _running.pop(nodeid, None)


def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    _session_over.set()


# -- two workers (make test: pytest -n 2 --dist loadgroup) ------------------------------------------

@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the marks into node ids' @group
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test of the booted lab goes to the same worker, in this order: they share one lab (its hosts,
    their fixed ports on 127.0.0.1, the state each test leaves the next), booted once per session."""
    for item in items:
        if "lab" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("lab"))


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker's torch (and the servers its tests start) gets its share of the cores: with one
    thread per core in each worker, two workers on two cores would oversubscribe them."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if not workers:
        return
    threads = str(max(1, len(os.sched_getaffinity(0)) // workers))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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
def lab(pytestconfig: pytest.Config) -> Lab:
    reason = _lab_skip_reason()
    if reason:
        pytest.skip(reason)
    from ddops.lab import lab_down, lab_status, lab_up
    from ddops.lab.paths import lab_dir
    from ddops.lab.spec import read_inventory, ssh_files

    doc, specs = read_inventory(LAB_INVENTORY)
    key, known_hosts = ssh_files(doc, lab_dir())
    was_running = any(s.running for s in lab_status())
    lab_up(LAB_INVENTORY, progress=lambda line: _say(pytestconfig, line))
    yield Lab(inventory_path=LAB_INVENTORY, key=key, known_hosts=known_hosts, lab_dir=lab_dir(),
              hosts={h.name: LabHostInfo(h.name, h.port, h.pct, h.via, h.gpus.count) for h in specs})
    if not was_running and os.environ.get("DDOPS_LAB_KEEP") != "1":  # a lab found running stays running
        lab_down(progress=lambda line: _say(pytestconfig, line))


# -- the tiny models (runtime tests, lab pivots) -----------------------------------------------------

def _tiny(config: pytest.Config, name: str) -> Path:
    """The committed fixture pair `name`, installed into $DDOPS_CACHE/name (where the lab profiles look)."""
    from ddops.lab.tiny import install

    out = install(name, progress=lambda line: _say(config, line))
    # the tiny models are all per-op overhead: one intra-op thread is faster than two and keeps test
    # times stable when the CPUs are shared
    import torch

    torch.set_num_threads(1)
    return out


@pytest.fixture(scope="session")
def tiny_models(pytestconfig: pytest.Config) -> Path:
    """The tiny Qwen3 target + DFlash drafter."""
    from ddops.lab.tiny import QWEN3

    return _tiny(pytestconfig, QWEN3)


@pytest.fixture(scope="session")
def tiny_hybrid_models(pytestconfig: pytest.Config) -> Path:
    """The tiny hybrid (Gated DeltaNet + full attention, Qwen3.5-style) target + DFlash drafter."""
    from ddops.lab.tiny import HYBRID

    return _tiny(pytestconfig, HYBRID)


@pytest.fixture
def cli(monkeypatch, capsys):
    """Run `ddops ARGS` in-process from the repository; any attempt to open an SSH connection fails the
    test. Returns (exit code, stdout + stderr)."""
    from ddops.cli import main
    from ddops.executor import Executor

    def forbidden(self, host):
        raise AssertionError(f"an in-process CLI test must not reach any host (tried {host.name})")

    monkeypatch.setattr(Executor, "_open", forbidden)
    monkeypatch.chdir(REPO)

    def run(*args: str, env: dict | None = None) -> tuple[int, str]:
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(sys, "argv", ["ddops", *args])
        with pytest.raises(SystemExit) as exited:
            main()
        out, err = capsys.readouterr()
        return exited.value.code, out + err
    return run

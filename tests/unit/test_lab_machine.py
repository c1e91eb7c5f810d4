"""The lab's machine start, without booting one: the process start() returns is the nspawn itself."""

from __future__ import annotations

import os
import shutil
import signal
from types import SimpleNamespace

from ddops.lab import machine


def test_start_returns_the_process_once_it_is_nspawn_not_the_shell_before_its_exec(tmp_path, monkeypatch):
    """The shell writes its pid, then execs nspawn; on a loaded machine the exec may come late. A Proc
    taken before it is not alive() (its command is `sh`), which wait_ready read as "stopped while booting"."""
    nspawn = tmp_path / "systemd-nspawn"
    nspawn.symlink_to(shutil.which("sleep"))     # argv[0] ends in systemd-nspawn, as the real one's does
    monkeypatch.setattr(machine, "nspawn_argv", lambda host, hd: ["sh", "-c", 'sleep 0.5; exec "$0" 30', str(nspawn)])
    hd = SimpleNamespace(pidfile=tmp_path / "pid", console=tmp_path / "console")
    proc = machine.start(SimpleNamespace(name="h"), hd)
    try:
        assert proc.alive()
    finally:
        os.kill(proc.pid, signal.SIGKILL)

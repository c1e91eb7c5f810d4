"""Run ``ddtree-serve`` as a real subprocess on a free 127.0.0.1 port (for tests and benchmarks).

    with ServerProcess(["--target", t, "--draft", d]) as srv:
        srv.wait_ready()
        httpx.get(srv.url + "/health")

``faults=True`` runs it through ``ddtree_devtools.serve``, which adds POST /_test/fault (``faults``).

The server's output goes to a log file, shown by ``srv.log_tail()`` when something goes wrong.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import ddtree_runtime

import ddtree_devtools

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, port: int | None = None,
                 faults: bool = False) -> None:
        self.module = "ddtree_devtools.serve" if faults else "ddtree_runtime.server"
        self.port = port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        self._args = [*args, "--host", HOST, "--port", str(self.port)]
        # The child imports the same ddtree_runtime (and devtools) as this process, installed or not.
        roots = [str(Path(package.__file__).resolve().parents[1]) for package in (ddtree_runtime, ddtree_devtools)]
        path = os.pathsep.join(p for p in (*roots, os.environ.get("PYTHONPATH", "")) if p)
        self._env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = tempfile.NamedTemporaryFile(prefix="ddtree-serve-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", self.module, *self._args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self._env)
        return self

    def health(self) -> tuple[int | None, dict]:
        """(status code, body) of GET /health; (None, {}) while nothing listens."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None, {}

    def wait_listening(self, timeout: float = 60.0) -> tuple[int, dict]:
        return self._wait(lambda code, body: code is not None, timeout, "listening")

    def wait_ready(self, timeout: float = 120.0) -> dict:
        return self._wait(lambda code, body: code == 200, timeout, "healthy")[1]

    def wait_status(self, status: str, timeout: float = 30.0) -> dict:
        return self._wait(lambda code, body: body.get("status") == status, timeout, f"status {status!r}")[1]

    def _wait(self, done, timeout: float, what: str) -> tuple[int, dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"ddtree-serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            code, body = self.health()
            if done(code, body):
                return code, body
            time.sleep(0.05)
        raise TimeoutError(f"ddtree-serve not {what} after {timeout}s:\n{self.log_tail()}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def log_tail(self, chars: int = 6000) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-chars:]

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self._log.close()
        os.unlink(self._log.name)

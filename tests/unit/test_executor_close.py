"""The executor's close and a frozen host (issue 36, defect 8): closing never crashes or hangs while
fan-out workers that outlived their deadline still connect or drop connections, and `status` calls a
host that stopped answering mid-command unreachable (exit 4)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ddops.errors import EXIT_UNREACHABLE, HostUnreachable
from ddops.executor import CommandTimeout, Executor
from ddops.inventory import load_inventory
from ddops.status import collect, exit_code

INVENTORY = """\
hosts:
  a: {address: 10.0.0.1, connect_timeout: 1, command_timeout: 1}
  b: {address: 10.0.0.2, connect_timeout: 1, command_timeout: 1}
  c: {address: 10.0.0.3, connect_timeout: 1, command_timeout: 1}
"""


class FakeConnection:
    """Stands in for a fabric Connection: its close() runs `on_close` (or blocks, for a frozen host)."""

    def __init__(self, on_close=None, frozen: threading.Event | None = None) -> None:
        self.on_close = on_close
        self.frozen = frozen
        self.closed = False
        self.is_connected = True

    def close(self) -> None:
        if self.frozen is not None:
            self.frozen.wait()
        if self.on_close:
            self.on_close()
        self.closed = True


@pytest.fixture
def executor(tmp_path: Path) -> Executor:
    path = tmp_path / "inv.yaml"
    path.write_text(INVENTORY)
    return Executor(load_inventory(path))


def test_close_survives_a_worker_dropping_a_connection_meanwhile(executor):
    """A worker past its fan-out deadline drops its connection while close() is closing the others:
    before, close() iterated the live dict and died with 'dictionary changed size during iteration'."""
    hosts = executor.inventory.hosts
    executor._connections["b"] = FakeConnection()
    executor._connections["a"] = FakeConnection(on_close=lambda: executor._drop(hosts["b"]))
    executor._connections["c"] = FakeConnection()
    executor.close()
    assert executor._connections == {}


def test_close_does_not_wait_for_a_frozen_host(executor):
    frozen = threading.Event()
    healthy = FakeConnection()
    executor._connections.update(a=FakeConnection(frozen=frozen), b=healthy)
    start = time.monotonic()
    executor.close(timeout=0.3)
    assert time.monotonic() - start < 2
    assert healthy.closed
    frozen.set()


def test_a_connection_opened_after_close_is_closed_and_refused(executor, monkeypatch):
    late = FakeConnection()
    monkeypatch.setattr(executor, "_open", lambda host: late)
    executor.close()
    with pytest.raises(HostUnreachable, match="after this run had stopped waiting"):
        executor.connection(executor.inventory.hosts["a"])
    assert late.closed and executor._connections == {}


def test_status_calls_a_host_frozen_mid_command_unreachable(executor, monkeypatch):
    def run(host, argv, **kwargs):
        raise CommandTimeout(f"`python3 ...` on {host.name} ran past its timeout")

    monkeypatch.setattr(executor, "run", run)
    records = collect(executor, [executor.inventory.hosts["b"]])
    assert not records[0]["reachable"]
    assert "stopped answering during the facts probe" in records[0]["error"]
    assert exit_code(records) == EXIT_UNREACHABLE

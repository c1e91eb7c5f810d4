"""The mechanics behind the fault tests, without the lab: Ctrl-C handling, a health gate that waits out
an unreachable host, rsync's failure messages and flags, model dirs kept out of system trees."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddops.errors import ConfigError, HostUnreachable
from ddops.inventory import load_inventory
from ddops.gates import health
from ddops.plan import Interrupted, RunContext
from ddops.signals import InterruptGuard
from ddops.transfer import rsync_argv, rsync_failure

REPO = Path(__file__).resolve().parents[2]
LAB = load_inventory(REPO / "inventories" / "lab.yaml")


def fake_run() -> RunContext:
    return RunContext(profile=SimpleNamespace(), inventory=LAB, executor=None)


def test_ctrl_c_is_deferred_to_a_safe_point_and_counted():
    run = fake_run()
    run.check_interrupt()  # nothing asked yet
    before = signal.getsignal(signal.SIGINT)
    with InterruptGuard(run) as guard:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert run.interrupted == "SIGINT" and guard.count == 2
        with pytest.raises(Interrupted, match="interrupted by SIGINT: stopped at a safe point"):
            run.check_interrupt()
    assert signal.getsignal(signal.SIGINT) is before


def test_health_gate_waits_out_an_unreachable_host(monkeypatch):
    polls = iter([HostUnreachable("gone"), HostUnreachable("still gone"),
                  {"unit": {"ActiveState": "active", "SubState": "running", "MainPID": "42", "NRestarts": "0"},
                   "health": {"http_status": 200, "body": {"status": "ok"}}}])

    def probe(*args, **kwargs):
        item = next(polls)
        if isinstance(item, Exception):
            raise item
        return item

    monkeypatch.setattr(health, "run_probe", probe)
    run = fake_run()
    out = health.wait_healthy(run.executor, LAB.host("ct200"), "ddtree.service", 8200, "/health", 30, 0.1,
                              progress=run.progress, check_interrupt=run.check_interrupt)
    assert out["unreachable_polls"] == 2 and out["health"]["status"] == "ok"


def test_health_gate_stops_on_ctrl_c(monkeypatch):
    monkeypatch.setattr(health, "run_probe", lambda *a, **k: pytest.fail("polled after Ctrl-C"))
    run = fake_run()
    run.interrupted = "SIGINT"
    with pytest.raises(Interrupted):
        health.wait_healthy(run.executor, LAB.host("ct200"), "ddtree.service", 8200, "/health", 30, 0.1,
                            progress=run.progress, check_interrupt=run.check_interrupt)


@pytest.mark.parametrize("code,meaning", [(11, "destination disk full"), (30, "stopped answering"),
                                          (255, "ssh failed"), (12, "connection lost"), (99, "failed")])
def test_rsync_failures_say_what_happened(code, meaning):
    assert meaning in rsync_failure(code, "")
    assert rsync_failure(11, "a\nrsync: write failed: No space left on device (28)\n").endswith("(28)")


def test_rsync_never_leaves_a_truncated_file_and_never_hangs():
    argv = rsync_argv(LAB, "/cache/t", "/root/models/t", dst_host=LAB.host("ct200"))
    assert "--partial" not in argv and "--delay-updates" in argv and "--delete-after" in argv
    assert "--timeout=60" in argv  # ct200's command_timeout
    ssh = argv[argv.index("-e") + 1]
    assert "ServerAliveInterval=5" in ssh and "ServerAliveCountMax=3" in ssh and "BatchMode=yes" in ssh


@pytest.mark.parametrize("path,ok", [
    ("/root/models/x", True), ("/dev/shm/Qwen3.6-27B", True), ("/data/models/x", True),
    ("/usr/lib", False), ("/etc/systemd/system", False), ("/var/lib/dpkg", False), ("/dev/sda", False),
    ("/boot/efi", False), ("/root", False),
])
def test_model_dirs_stay_out_of_system_trees(tmp_path, path, ok):
    from ddops.profile import load_profile

    text = (REPO / "playbooks" / "lab-ddtree16.yaml").read_text().replace("/root/models/tiny-draft\n", f"{path}\n", 1)
    profile = tmp_path / "p.yaml"
    profile.write_text(text)
    if ok:
        assert load_profile(profile, repo_root=REPO).model("draft").path == path
    else:
        with pytest.raises(ConfigError, match="system directory"):
            load_profile(profile, repo_root=REPO)


def test_a_runtime_whose_engine_failed_is_a_crash_not_a_wait():
    poll = {"unit": {"ActiveState": "active", "SubState": "running", "MainPID": "7", "NRestarts": "0"},
            "health": {"http_status": 503, "body": {"status": "error", "detail": "engine failed to start: boom"}}}
    verdict = health.judge(poll, 7)
    assert verdict.state == "crashed" and "engine failed to start: boom" in verdict.reason
    poll["health"]["body"] = {"status": "starting", "detail": "loading"}
    assert health.judge(poll, 7).state == "waiting"


class _RelayedChannel:
    """A channel whose exit status arrives before the last of its output (as through `pct exec`)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks, self.closed, self.eof_received = list(chunks), False, False
        self.polls = 0

    def recv_ready(self) -> bool:
        self.polls += 1
        return bool(self.chunks) and self.polls % 3 == 0   # data trickles in

    def recv(self, n: int) -> bytes:
        chunk = self.chunks.pop(0)
        self.eof_received = not self.chunks
        return chunk

    def recv_stderr_ready(self) -> bool:
        return False

    def exit_status_ready(self) -> bool:
        return True


def test_output_that_trails_the_exit_status_is_not_cut_short(monkeypatch):
    from ddops import executor

    monkeypatch.setattr(executor.select, "select", lambda r, w, x, t: (r, [], []))
    chunks = [bytes([65 + i]) * 65536 for i in range(5)]
    out, err = executor._drain(_RelayedChannel(chunks), float("inf"), None, LAB.host("ct200"), ["cat", "big"])
    assert out.encode() == b"".join(chunks) and err == ""

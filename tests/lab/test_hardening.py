"""Issue 36's hardening on real hosts: a venv path that leads into a system directory through a symlink,
or into a folder of someone else's files, is refused by preflight (nothing changed, /usr untouched);
`ddops monitor` refuses a taken port 9090 at once, naming what is known of its holder (the lab hosts share
this machine's loopback, so a listener here is one that eval-a6000 cannot see the process of); and rsync's
holding dirs a stopped sync left in a model folder are gone after the next pivot."""

from __future__ import annotations

import json
import socket
import time

import pytest

from test_pivot import ct200, ddops, pivot, pivot_lab, step, variant  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.lab, pytest.mark.slow]


@pytest.fixture
def odd_dirs(lab):
    ct200(lab, "mkdir -p /opt/hb/full && echo x > /opt/hb/full/notes.txt && ln -sfn /usr /opt/hb/venv")
    yield
    ct200(lab, "rm -rf /opt/hb")


@pytest.mark.parametrize("venv, problem", [
    ("/opt/hb/venv", "runtime.venv /opt/hb/venv on ct200 leads to /usr (a symlink), which is a system directory"),
    ("/opt/hb/full", "runtime.venv /opt/hb/full on ct200 holds 1 file(s) and is not a venv"),
])
def test_a_venv_out_of_bounds_on_the_host_is_refused_before_any_change(lab, odd_dirs, tmp_path, venv, problem):
    profile = variant(tmp_path, runtime__venv=venv)
    done = ddops(lab, "pivot", "--kill-training", "--deploy", str(profile), "--yes", "--json")
    report = json.loads(done.stdout)
    assert done.returncode == 2 and report["failed_step"] == "preflight", done.stderr[-2000:]
    assert problem in report["error"]
    assert ct200(lab, "ls /usr/pyvenv.cfg /opt/hb/full/pyvenv.cfg 2>&1; ls /opt/hb/full").split("\n")[-2:] == [
        "notes.txt", ""]


def test_monitor_refuses_a_taken_port_at_once(lab):
    before = lab.ssh("eval-a6000", "ls /var/lib/ddops/backups/prometheus.service 2>/dev/null").stdout
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", 9090))
        except OSError:
            pytest.skip("port 9090 is already taken on this machine")
        taken.listen()
        started = time.monotonic()
        done = ddops(lab, "--limit", "ct200", "monitor", "--host", "eval-a6000", timeout=300)
        took = time.monotonic() - started
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("-->")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "port 9090 on eval-a6000 is held by a process this host cannot see" in lines[0]
    assert "None" not in lines[0] and "nothing was changed" in lines[0]
    assert took < 60, took      # before: two 60 s waits for /-/ready, and a failed rollback restart
    assert lab.ssh("eval-a6000", "ls /var/lib/ddops/backups/prometheus.service 2>/dev/null").stdout == before


def test_holding_dirs_a_stopped_sync_left_are_cleared(pivot_lab):
    lab = pivot_lab
    ct200(lab, "mkdir -p '/root/models/tiny-target/.~tmp~' '/root/models/tiny-draft/sub/.~tmp~' && "
               "echo half > '/root/models/tiny-target/.~tmp~/model.safetensors' && "
               "echo half > '/root/models/tiny-draft/sub/.~tmp~/x'")
    done, report = pivot(lab)
    assert done.returncode == 0 and report["outcome"] == "ok", report
    assert step(report, "sync")["status"] == "done"
    assert ct200(lab, "find /root/models -name '.~tmp~'") == ""
    # the folder that held only rsync's holding dir is not the drafter's: the mirror removed it
    assert ct200(lab, "test -e /root/models/tiny-draft/sub || echo absent").strip() == "absent"
    done, report = pivot(lab)
    assert report["outcome"] == "unchanged", report

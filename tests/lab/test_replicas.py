"""Two replicas on ct200 behind HAProxy (issue 17), on the real lab: a pivot, a rolling redeploy under
load that must drop nothing, a rolling redeploy whose release crashes, and rollback of all replicas.

The tests run in order and share ct200's state. The load client runs here, on the control machine:
the lab hosts share its network, so ct200's balancer answers on 127.0.0.1:8200. With
DDOPS_ROLLING_FIGURES=PATH the zero-downtime test writes its figures (requests, failures, seconds per
replica) there as JSON; the README quotes them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.lab, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "playbooks" / "lab-replicas.yaml"
BALANCER = "http://127.0.0.1:8200"
PROMPT = "Repeat the word tree 5 times."
CLIENT_CAP_S = 420.0      # the load client stops by itself after this long, whatever happens


def ddops(lab, *args, timeout=900) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "ddops", "-i", str(lab.inventory_path), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL)


def pivot(lab, profile: Path, *extra) -> tuple[subprocess.CompletedProcess, dict]:
    done = ddops(lab, "pivot", "--kill-training", "--deploy", str(profile), "--yes", "--json", *extra)
    try:
        return done, json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"no JSON report (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}")


def ct200(lab, command: str, timeout=120) -> str:
    return lab.ssh("ct200", command, timeout=timeout).stdout


def variant(tmp_path: Path, **serve) -> Path:
    doc = yaml.safe_load(PROFILE.read_text())
    doc["serve"].update(serve)
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def chat(timeout=60.0) -> dict:
    """One greedy chat completion through the balancer (raises on anything but a complete answer)."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16,
                       "temperature": 0}).encode()
    req = urllib.request.Request(BALANCER + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


@dataclass
class LoadClient:
    """Threads sending requests through the balancer back to back until stopped (or CLIENT_CAP_S): every
    answer must be HTTP 200, whole JSON, finish `stop` or `length`, and the very text `expected`."""

    expected: str
    threads: int = 2
    sent: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    workers: list[threading.Thread] = field(default_factory=list)

    def one(self) -> None:
        deadline = time.monotonic() + CLIENT_CAP_S
        while not self.stop.is_set() and time.monotonic() < deadline:
            problem = None
            try:
                data = chat()
                choice = data["choices"][0]
                if choice.get("finish_reason") not in ("stop", "length"):
                    problem = f"finish_reason {choice.get('finish_reason')!r}"
                elif choice["message"]["content"] != self.expected:
                    problem = f"text {choice['message']['content']!r}, expected {self.expected!r}"
                elif not data.get("usage", {}).get("completion_tokens"):
                    problem = "no completion tokens in usage"
            except urllib.error.HTTPError as exc:
                problem = f"HTTP {exc.code}: {exc.read(200).decode(errors='replace')}"
            except (OSError, ValueError, KeyError, IndexError) as exc:
                problem = f"{exc.__class__.__name__}: {exc}"
            with self.lock:
                self.sent += 1
                if problem:
                    self.failures.append(problem)

    def __enter__(self) -> "LoadClient":
        self.workers = [threading.Thread(target=self.one, daemon=True) for _ in range(self.threads)]
        for worker in self.workers:
            worker.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for worker in self.workers:
            worker.join(timeout=90)


def main_pids(lab) -> dict[str, str]:
    return {u: ct200(lab, f"systemctl show {u} -p MainPID --value").strip()
            for u in ("ddtree@1.service", "ddtree@2.service")}


def balancer_counters(lab) -> dict[str, tuple[int, int, int]]:
    """Each replica's retries, redispatches and connection/response errors as HAProxy counts them."""
    status = json.loads(ddops(lab, "--limit", "ct200", "status", "--json").stdout)[0]
    return {r["server"]: (r["balancer"]["retries"], r["balancer"]["redispatches"], r["balancer"]["errors"])
            for r in status["replicas"][0]["replicas"]}


# Debian's own haproxy.cfg, from the package apt left in its cache: whatever an earlier suite deployed, the
# first replicated deploy here backs up Debian's file, which the last rollback must put back.
DEBIAN_HAPROXY_CFG = ("deb=$(ls /var/cache/apt/archives/haproxy_*.deb 2>/dev/null | head -1); "
                      "if [ -n \"$deb\" ] && [ -d /etc/haproxy ]; then dpkg-deb --fsys-tarfile \"$deb\" | "
                      "tar -xO ./etc/haproxy/haproxy.cfg > /etc/haproxy/haproxy.cfg; fi")


@pytest.fixture(scope="module")
def replicas_lab(lab):
    """ct200 training, no runtime of ours; at the end, everything the tests installed is rolled back."""
    from ddops.demo import ensure_tiny_models, seed_drafter
    from ddops.executor import Executor
    from ddops.inventory import load_inventory

    ensure_tiny_models(lambda m: None)
    inventory = load_inventory(lab.inventory_path)
    with Executor(inventory) as ex:
        seed_drafter(inventory, ex, lambda m: None)
    reset = ("systemctl disable --now ddtree.service ddtree@1.service ddtree@2.service 2>/dev/null; "
             "systemctl stop haproxy.service 2>/dev/null; " + DEBIAN_HAPROXY_CFG + "; rm -f /etc/systemd/system/ddtree@.service "
             "/etc/ddops/ddtree@*.env /var/lib/ddops/pivot.lock; rm -rf /var/lib/ddops/replicas "
             "/var/lib/ddops/backups/ddtree@.service; systemctl daemon-reload; systemctl reset-failed; "
             "systemctl start dflash-train.service")
    ct200(lab, reset)
    yield lab
    ct200(lab, reset)


def test_two_replicas_behind_haproxy(replicas_lab):
    lab = replicas_lab
    done, report = pivot(lab, PROFILE)
    assert done.returncode == 0 and report["outcome"] == "ok", report
    health = report["gates"]["health"]
    assert set(health["replicas"]) == {"ddtree@1.service", "ddtree@2.service"}
    assert all(s["status"] == "UP" for s in health["balancer"]["servers"].values())
    assert {r["replica"] for r in report["gates"]["smoke"]["results"]} == set(health["replicas"])
    assert ct200(lab, "cat /etc/ddops/ddtree@2.env").splitlines()[2:] == ["DDOPS_REPLICA_PORT=8202",
                                                                         "CUDA_VISIBLE_DEVICES=1"]
    status = json.loads(ddops(lab, "--limit", "ct200", "status", "--json").stdout)[0]
    deployment, = status["replicas"]
    assert deployment["balancer"]["health"]["healthy"]
    assert [(r["unit"], r["health"]["healthy"], r["balancer"]["status"]) for r in deployment["replicas"]] == [
        ("ddtree@1.service", True, "UP"), ("ddtree@2.service", True, "UP")]
    shown = ddops(lab, "--limit", "ct200", "status").stdout
    assert "ddtree@1.service │ 8201" in shown and "ddtree@2.service │ 8202" in shown
    answers = [chat() for _ in range(4)]  # leastconn over two idle replicas: both answer
    assert all(a["choices"][0]["finish_reason"] in ("stop", "length") for a in answers)
    assert len({a["choices"][0]["message"]["content"] for a in answers}) == 1


def test_rolling_redeploy_drops_no_request(replicas_lab, tmp_path):
    lab = replicas_lab
    expected = chat()["choices"][0]["message"]["content"]   # greedy and lossless: every budget gives this text
    before = main_pids(lab)
    counters_before = balancer_counters(lab)
    started = time.monotonic()
    with LoadClient(expected) as client:
        time.sleep(3)   # the client is in full flow before the redeploy starts
        done, report = pivot(lab, variant(tmp_path, tree_budget=8), "--batch", "1")
        time.sleep(3)   # and still sending after it ends
    seconds = round(time.monotonic() - started, 1)
    assert done.returncode == 0 and report["outcome"] == "ok", report
    rolling = report["rolling"]
    assert [(b["batch"], b["replicas"], b["ok"]) for b in rolling] == [
        (1, ["ddtree@1.service"], True), (2, ["ddtree@2.service"], True)]
    after = main_pids(lab)
    assert all(after[u] != before[u] for u in before)  # both really restarted
    figures = {"requests": client.sent, "failed": len(client.failures), "client_seconds": seconds,
               "pivot_wall_s": report["wall_s"], "threads": client.threads,
               "per_replica": {b["replicas"][0]: {k: b.get(k) for k in ("drain_s", "restart_and_gates_s", "readmit_s",
                                                                       "total_s")} for b in rolling}}
    print("\nrolling redeploy figures:", json.dumps(figures))
    if os.environ.get("DDOPS_ROLLING_FIGURES"):
        Path(os.environ["DDOPS_ROLLING_FIGURES"]).write_text(json.dumps(figures, indent=1) + "\n")
    assert client.sent >= 20, figures
    assert client.failures == [], figures
    # and none of it was saved by HAProxy retrying or redispatching a request a replica dropped: the
    # drain kept every request away from a replica before it restarted
    assert all(b["drained"] and b["sessions_left"] == 0 for b in rolling), rolling
    assert balancer_counters(lab) == counters_before
    for unit in before:
        port = 8200 + int(unit[7])
        body = json.loads(ct200(lab, f"python3 -c \"import urllib.request as u; print(u.urlopen("
                                     f"'http://127.0.0.1:{port}/health').read().decode())\""))
        assert body["tree_budget"] == 8


def test_a_release_that_crashes_halts_at_the_first_batch(replicas_lab, tmp_path):
    lab = replicas_lab
    expected = chat()["choices"][0]["message"]["content"]
    before = main_pids(lab)
    with LoadClient(expected, threads=1) as client:
        done, report = pivot(lab, variant(tmp_path, tree_budget=8, extra_args=["--tree-budget", "0"]))
    assert done.returncode == 2 and report["outcome"] == "rolled-back", report
    assert report["failed_step"] == "roll"
    assert "rolling restart halted at batch 1/2 (ddtree@1.service)" in report["error"]
    assert "ddtree@2.service kept serving the old release" in report["error"]
    assert "ddtree@2.service never stopped serving" in report["state"]
    batch, = report["rolling"]
    assert not batch["ok"] and batch["failed_at"] == "health"
    after = main_pids(lab)
    assert after["ddtree@2.service"] == before["ddtree@2.service"]      # never restarted
    assert after["ddtree@1.service"] != before["ddtree@1.service"]      # back on the old release
    assert "--tree-budget 0" not in ct200(lab, "cat /etc/systemd/system/ddtree@.service")
    assert client.failures == [] and client.sent > 0, (client.sent, client.failures)
    status = json.loads(ddops(lab, "--limit", "ct200", "status", "--json").stdout)[0]
    assert [(r["health"]["healthy"], r["balancer"]["status"]) for r in status["replicas"][0]["replicas"]] == [
        (True, "UP"), (True, "UP")]


def test_a_release_whose_code_cannot_start_goes_back_with_its_batch(replicas_lab, tmp_path):
    """A new runtime *release* (its code, not a flag) whose engine cannot load: batch 1 fails its gate and
    comes back on the release that was installed before (reinstalled before any restart), replica 2 never
    stops serving, nothing fails for the clients."""
    lab = replicas_lab
    broken = tmp_path / "runtime"
    shutil.copytree(REPO / "runtime", broken,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "devtools", "bench"))
    worker = broken / "ddtree_runtime" / "server" / "worker.py"
    marker = '    """The engine the worker builds unless the app is given another factory."""\n'
    assert marker in worker.read_text()
    worker.write_text(worker.read_text().replace(
        marker, marker + '    raise RuntimeError("this release cannot load an engine")\n'))
    doc = yaml.safe_load(PROFILE.read_text())
    doc["runtime"]["ship"] = str(broken)
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(doc))
    release_before = json.loads(ct200(lab, "cat /opt/ddtree/venv/ddtree-release.json"))["release"]
    expected = chat()["choices"][0]["message"]["content"]
    before = main_pids(lab)
    with LoadClient(expected, threads=1) as client:
        done, report = pivot(lab, profile)
    assert done.returncode == 2 and report["outcome"] == "rolled-back", report
    assert report["failed_step"] == "roll" and report["rollback"]["reinstalled"] == release_before, report
    assert json.loads(ct200(lab, "cat /opt/ddtree/venv/ddtree-release.json"))["release"] == release_before
    assert "cannot load an engine" not in ct200(lab, "cat /opt/ddtree/venv/lib/python3*/site-packages/"
                                                     "ddtree_runtime/server/worker.py")
    after = main_pids(lab)
    assert after["ddtree@2.service"] == before["ddtree@2.service"]      # never restarted
    assert after["ddtree@1.service"] != before["ddtree@1.service"]      # restarted on the old release
    assert client.failures == [] and client.sent > 0, (client.sent, client.failures)
    status = json.loads(ddops(lab, "--limit", "ct200", "status", "--json").stdout)[0]
    assert [(r["health"]["healthy"], r["balancer"]["status"]) for r in status["replicas"][0]["replicas"]] == [
        (True, "UP"), (True, "UP")]


def test_rollback_restores_every_replica_then_removes_them(replicas_lab):
    lab = replicas_lab
    listing = json.loads(ddops(lab, "rollback", "--host", "ct200", "--unit", "ddtree@.service", "--list",
                               "--json").stdout)
    assert not listing[0]["meta"]["unit_existed"] and len(listing) >= 3
    # the backup the budget-8 redeploy took holds the budget-16 replicas
    done = ddops(lab, "rollback", "--host", "ct200", "--unit", "ddtree@.service", "--to", listing[1]["id"], "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["restarted"] == ["ddtree@1.service", "ddtree@2.service"]
    assert all(r["health"]["health"]["tree_budget"] == 16 for r in report["replicas"].values())
    done = ddops(lab, "rollback", "--host", "ct200", "--unit", "ddtree@.service", "--to", listing[0]["id"], "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report.get("removed") and "dflash-train.service" in report["restarted"]
    assert ct200(lab, "systemctl is-active ddtree@1.service ddtree@2.service").split() == ["inactive", "inactive"]
    assert "ddops" not in ct200(lab, "head -2 /etc/haproxy/haproxy.cfg")   # Debian's own config is back
    assert ct200(lab, "systemctl is-active dflash-train.service").strip() == "active"

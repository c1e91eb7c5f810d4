"""`ddops top` as a person uses it: in a terminal (tmux: send keys, read the pane) over the lab while
`ddops bench --concurrency` loads one replica, then faults induced by hand (a replica stopped, an
acceptance collapse, a 5xx from the devtools' fault switch) must show within two refreshes, and
`--once --fail-on` must exit 1 on each.

The module pivots ct200 to lab-replicas (two replicas behind HAProxy) and rolls everything back at the end.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.lab.test_replicas import DEBIAN_HAPROXY_CFG, PROFILE, REPO, ct200, pivot

pytestmark = [pytest.mark.lab, pytest.mark.slow]

INTERVAL = 2.0
TWO_REFRESHES_S = 2 * INTERVAL + 3.0   # and the probe's own round trip, on 2 shared CPU cores
SESSION = "ddops-top-test"
FAULTY_PORT = 8299
FAULTY_UNIT = "ddtree-faulty.service"
RESET = ("systemctl disable --now ddtree.service ddtree@1.service ddtree@2.service ddtree@3.service 2>/dev/null; "
         f"systemctl stop haproxy.service {FAULTY_UNIT} 2>/dev/null; {DEBIAN_HAPROXY_CFG}; "
         "rm -f /etc/systemd/system/ddtree@.service "
         "/etc/ddops/ddtree@*.env /var/lib/ddops/pivot.lock; rm -rf /var/lib/ddops/replicas "
         "/var/lib/ddops/backups/ddtree@.service /opt/ddops-faults; systemctl daemon-reload; "
         "systemctl reset-failed; systemctl start dflash-train.service")


def serve_replicas(lab) -> None:
    """ct200 from a clean state to serving the replicas profile (the tiny models and drafter in place)."""
    from ddops.demo import ensure_tiny_models, seed_drafter
    from ddops.executor import Executor
    from ddops.inventory import load_inventory

    ensure_tiny_models(lambda m: None)
    inventory = load_inventory(lab.inventory_path)
    with Executor(inventory) as ex:
        seed_drafter(inventory, ex, lambda m: None)
    ct200(lab, RESET)
    done, report = pivot(lab, PROFILE)
    assert done.returncode == 0 and report["outcome"] == "ok", report


@pytest.fixture(scope="module")
def served(lab, tmp_path_factory):
    """ct200 serving two replicas; an inventory copy that also lists the fault server's unit and port."""
    if shutil.which("tmux") is None:
        pytest.skip("the top test drives a terminal through tmux (apt-get install tmux)")
    serve_replicas(lab)
    doc = yaml.safe_load(Path(lab.inventory_path).read_text())
    doc["hosts"]["ct200"]["services"].append({"unit": FAULTY_UNIT, "port": FAULTY_PORT, "health": "/health"})
    watched = tmp_path_factory.mktemp("top") / "inventory.yaml"
    watched.write_text(yaml.safe_dump(doc))
    yield lab, watched
    subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    ct200(lab, RESET)


def top_argv(inventory: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "ddops", "-i", str(inventory), "--limit", "ct200", "top", "--profile",
            str(PROFILE), "--interval", str(INTERVAL), *args]


def pane() -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", SESSION], capture_output=True, text=True).stdout


COLUMNS = ("HOST", "UNIT", "PORT", "TP", "STATE", "RUN/CAP", "WAIT", "TOK/S", "ACCEPT", "TTFT p50/p95 ms",
           "ROUND p50/p95 ms", "4XX", "5XX", "LB")


def row(screen: str, unit: str) -> dict[str, str]:
    """A target's row on the screen, cut where the column headers start."""
    header = next(line for line in screen.splitlines() if line.startswith("HOST") and "TOK/S" in line)
    starts = [header.index(c) for c in COLUMNS] + [None]
    line = next(line for line in screen.splitlines() if f" {unit} " in line and line.startswith("ct200"))
    return {c: line[a:b].strip() for c, a, b in zip(COLUMNS, starts, starts[1:])}


def wait_screen(check, timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    while True:
        screen = pane()
        try:
            if check(screen):
                return screen
        except (StopIteration, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not on the screen within {timeout:.0f}s:\n{screen}")
        time.sleep(0.25)


LOAD_REQUESTS = 100000   # far more than the checks take: a load runs until stop() ends it


def bench(lab, port: int, modes: str, prompts: Path, requests: int = LOAD_REQUESTS) -> subprocess.Popen:
    argv = [sys.executable, "-m", "ddops", "-i", str(lab.inventory_path), "bench", "--host", "ct200", "--port",
            str(port), "--concurrency", "3", "--modes", modes, "--max-tokens", "64", "--requests", str(requests),
            "--prompts", str(prompts), "--json"]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)


def stop(load: subprocess.Popen) -> None:
    """The load has done its part once the screen showed it: end it (the probe on ct200 stops taking
    requests at its next progress line, which finds nobody reading)."""
    load.terminate()
    load.communicate(timeout=60)


def once(inventory: Path, fail_on: str) -> subprocess.CompletedProcess:
    return subprocess.run(top_argv(inventory, "--once", "--json", "--fail-on", fail_on), capture_output=True,
                          text=True, timeout=120, cwd=REPO, stdin=subprocess.DEVNULL)


def test_top_in_a_terminal_under_load_then_faults(served, tmp_path):
    lab, inventory = served
    # the smoke's prompts: what the tiny pair was trained on, so its acceptance clears the profile's floor
    # (the bundled coding prompts bring it to about 1.3, which the acceptance alarm rightly calls low)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p["prompt"]}) + "\n"
                               for p in yaml.safe_load(PROFILE.read_text())["smoke"]["prompts"]))
    command = shlex.join(top_argv(inventory))
    subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    subprocess.run(["tmux", "new-session", "-d", "-s", SESSION, "-x", "200", "-y", "50", "-c", str(REPO),
                    # pytest exports COLUMNS=80, which would beat the pane's own size
                    f"env -u COLUMNS -u LINES PYTHONPATH={shlex.quote(os.environ.get('PYTHONPATH', ''))} {command}"],
                   check=True)
    wait_screen(lambda s: row(s, "ddtree@2.service")["LB"] == "UP", 30, "both replicas")

    # load on replica 1 only: its tokens/s and running requests move, replica 2's stay at rest
    load = bench(lab, 8201, "ddtree", prompts)
    try:
        screen = wait_screen(lambda s: float(row(s, "ddtree@1.service")["TOK/S"]) > 5
                             and row(s, "ddtree@1.service")["RUN/CAP"] not in ("0/16", "-"), 60, "replica 1 loaded")
        one, two = row(screen, "ddtree@1.service"), row(screen, "ddtree@2.service")
        assert float(two["TOK/S"]) == 0.0 and two["RUN/CAP"] == "0/16"
        running, capacity = map(int, one["RUN/CAP"].split("/"))
        assert 1 <= running <= 3 and capacity == 16            # 3 clients; --max-running default for the tiny pair
        assert 1.0 <= float(one["ACCEPT"]) <= 16.0
        p50, p95 = (float(x) for x in one["TTFT p50/p95 ms"].split("/"))
        assert 0 < p50 <= p95
        assert "no alarms" in screen
    finally:
        stop(load)
    # the stopped bench's load ends on ct200 too (its probe's next progress line finds nobody reading)
    wait_screen(lambda s: row(s, "ddtree@1.service")["TOK/S"] == "0.0", 2.0 + TWO_REFRESHES_S, "replica 1 at rest")

    # a replica stopped: down and out of the balancer within two refreshes
    ct200(lab, "systemctl stop ddtree@2.service")
    started = time.monotonic()
    screen = wait_screen(lambda s: "down" in s and "ddtree@2.service is inactive" in s, TWO_REFRESHES_S,
                         "the stopped replica")
    wait_screen(lambda s: "balancer    ct200: ddtree@2.service is" in s, TWO_REFRESHES_S, "the balancer alarm")
    assert time.monotonic() - started <= 2 * TWO_REFRESHES_S
    done = once(inventory, "down")
    assert done.returncode == 1 and "alarm: down" in done.stderr, done.stderr
    ct200(lab, "systemctl start ddtree@2.service")
    wait_screen(lambda s: row(s, "ddtree@2.service")["LB"] == "UP", 120, "replica 2 back")

    # an acceptance collapse (every round commits one token, as a broken drafter does): under the
    # profile's smoke.min_acceptance
    load = bench(lab, 8201, "ar", prompts)
    try:
        wait_screen(lambda s: "ddtree@1.service mean acceptance 1.00 < 1.5" in s, 30, "the acceptance alarm")
        done = once(inventory, "acceptance")
        assert done.returncode == 1 and "alarm: acceptance" in done.stderr, done.stderr + done.stdout
    finally:
        stop(load)

    # a 5xx: the devtools' fault server on ct200, its next admission failing inside the engine
    start_faulty_server(lab)
    wait_screen(lambda s: row(s, FAULTY_UNIT)["STATE"] == "active", 120, "the fault server")
    post("/_test/fault", {"engine_errors": 1})
    assert post("/v1/completions", {"prompt": "1", "max_tokens": 2}) == 500
    started = time.monotonic()
    screen = wait_screen(lambda s: f"{FAULTY_UNIT} answered 1 5xx" in s, TWO_REFRESHES_S, "the 5xx alarm")
    assert row(screen, FAULTY_UNIT)["5XX"] == "1"
    # and `q` quits
    subprocess.run(["tmux", "send-keys", "-t", SESSION, "q"], check=True)
    deadline = time.monotonic() + 10
    while subprocess.run(["tmux", "has-session", "-t", SESSION], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "q did not quit:\n" + pane()
        time.sleep(0.2)


def post(path: str, body: dict) -> int:
    """POST to the fault server (the lab hosts share this machine's loopback); its HTTP status."""
    req = urllib.request.Request(f"http://127.0.0.1:{FAULTY_PORT}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read()).get("status") == "ok"
    except (OSError, ValueError):
        return False


def start_faulty_server(lab) -> None:
    """The runtime with the test fault switch (ddtree_devtools.serve), as a transient unit on ct200."""
    devtools = REPO / "runtime" / "devtools" / "ddtree_devtools"
    for name in ("__init__.py", "faults.py", "serve.py"):
        lab.ssh("ct200", f"mkdir -p /opt/ddops-faults/ddtree_devtools && cat > /opt/ddops-faults/ddtree_devtools/{name}",
                input=(devtools / name).read_text(), check=True)
    argv = ["systemd-run", f"--unit={FAULTY_UNIT}", "--setenv=PYTHONPATH=/opt/ddops-faults",
            "--setenv=OMP_NUM_THREADS=1", "/opt/ddtree/venv/bin/python", "-m", "ddtree_devtools.serve",
            "--target", "/root/models/tiny-target", "--draft", "/root/models/tiny-draft", "--host", "127.0.0.1",
            "--port", str(FAULTY_PORT), "--device", "cpu", "--dtype", "float32", "--served-model-name", "tiny"]
    lab.ssh("ct200", argv, check=True)
    deadline = time.monotonic() + 240
    while not healthy(f"http://127.0.0.1:{FAULTY_PORT}/health"):
        assert time.monotonic() < deadline, ct200(lab, f"journalctl -u {FAULTY_UNIT} -n 30 --no-pager")
        time.sleep(1)

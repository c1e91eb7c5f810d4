"""Reliability tests: faults injected into the real lab, and what ddops makes of them.

Every fault is undone in a `finally` (or a fixture's teardown) so the next test finds a healthy lab.
The fault tests share one pivoted state (`base`: ct200 serving the lab profile, training stopped);
each one starts from it and must leave it, or the newer healthy unit, behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "playbooks" / "lab-ddtree16.yaml"
UNIT = "/etc/systemd/system/ddtree.service"
ENV = "/etc/ddops/ddtree.env"
FREEZER = Path("/sys/fs/cgroup/freezer")


FIGURES: dict[str, dict] = {}   # written to $DDOPS_RELIABILITY_FIGURES at the end of the run (the report)


def note(name: str, report: dict, **extra) -> None:
    """Keep the figures of one injected fault: outcome, exit code, how long detection and recovery took."""
    steps = {s["name"]: s for s in report.get("steps", [])}
    failed = report.get("failed_step")
    FIGURES[name] = {"outcome": report.get("outcome"), "exit_code": report.get("exit_code"),
                     "wall_s": report.get("wall_s"), "failed_step": failed,
                     "failed_step_s": (steps.get(failed) or {}).get("seconds"),
                     "rollback_s": (steps.get("rollback") or {}).get("seconds"), **extra}


def ddops_argv(lab, *args, inventory=None) -> list[str]:
    return [sys.executable, "-m", "ddops", "-i", str(inventory or lab.inventory_path), *args]


def ddops(lab, *args, inventory=None, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(ddops_argv(lab, *args, inventory=inventory), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def pivot_argv(lab, profile, *extra, inventory=None) -> list[str]:
    return ddops_argv(lab, "pivot", "--kill-training", "--deploy", str(profile), "--yes", "--json", *extra,
                      inventory=inventory)


def report_of(stdout: str, stderr: str, code: int) -> dict:
    try:
        return json.loads(stdout)
    except ValueError:
        pytest.fail(f"no JSON report (exit {code}):\n{stdout}\n{stderr[-3000:]}")


def pivot(lab, profile, *extra, inventory=None, env=None, timeout=600) -> tuple[subprocess.CompletedProcess, dict]:
    done = subprocess.run(pivot_argv(lab, profile, *extra, inventory=inventory), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    return done, report_of(done.stdout, done.stderr, done.returncode)


class Background:
    """A ddops pivot running in the background, its output in files."""

    def __init__(self, lab, profile, *extra, inventory=None, folder: Path) -> None:
        self.out, self.err = folder / "stdout", folder / "stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(pivot_argv(lab, profile, *extra, inventory=inventory), stdout=out,
                                         stderr=err, cwd=REPO, stdin=subprocess.DEVNULL)

    def wait(self, timeout: float = 600) -> tuple[int, dict]:
        code = self.proc.wait(timeout=timeout)
        return code, report_of(self.out.read_text(), self.err.read_text(), code)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)


def step(report: dict, name: str) -> dict:
    return next(s for s in report["steps"] if s["name"] == name)


def variant(folder: Path, name: str, changes: dict, base: Path = PROFILE) -> Path:
    """A copy of a profile with `changes` ({"a.b": value}) applied; written to folder/name.yaml."""
    doc = yaml.safe_load(base.read_text())
    for dotted, value in changes.items():
        keys = dotted.split(".")
        node = doc
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def inventory_variant(lab, folder: Path, name: str, mutate: Callable[[dict], None]) -> Path:
    doc = yaml.safe_load(Path(lab.inventory_path).read_text())
    mutate(doc)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def short_timeouts(command_timeout: int = 8) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        doc["defaults"].update(command_timeout=command_timeout, connect_timeout=4)
    return mutate


def sh(lab, host: str, command: str, timeout: float = 60) -> str:
    return lab.ssh(host, command, timeout=timeout).stdout


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def unit_state(lab) -> dict:
    """The served unit's files and process, as ct200 sees them."""
    out = sh(lab, "ct200", f"echo unit=$(sha256sum < {UNIT} 2>/dev/null | cut -c1-64); "
                           f"echo env=$(sha256sum < {ENV} 2>/dev/null | cut -c1-64); "
                           "echo active=$(systemctl is-active ddtree.service); "
                           "echo pid=$(systemctl show -p MainPID --value ddtree.service)")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def healthy(lab, port: int = 8200) -> bool:
    body = sh(lab, "ct200", "python3 -c \"import urllib.request as u; "
                            f"print(u.urlopen('http://127.0.0.1:{port}/health', timeout=5).read().decode())\"")
    try:
        return json.loads(body)["status"] == "ok"
    except (ValueError, KeyError):
        return False


def no_leftovers(lab) -> str:
    """Temp files a half-done write would leave (empty when every write was whole)."""
    return sh(lab, "ct200", "find /etc/systemd/system /etc/ddops -name '*.ddops-tmp*' 2>/dev/null").strip()


def lock_holder(lab) -> dict | None:
    text = sh(lab, "ct200", "cat /var/lib/ddops/pivot.lock 2>/dev/null").strip()
    return json.loads(text) if text else None


# -- freezing a whole lab host (every process in its pid namespace), as a hung machine would be --

def _init_pid(lab, host: str) -> int:
    state = json.loads((Path(lab.lab_dir) / "hosts" / host / "state.json").read_text())
    return int(state["init_pid"])


def host_pids(lab, host: str) -> list[int]:
    ns = os.readlink(f"/proc/{_init_pid(lab, host)}/ns/pid")
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                pids.append(int(entry))
        except OSError:
            continue
    return pids


@contextmanager
def frozen(lab, host: str):
    """Freeze every process of a lab host (cgroup v1 freezer) until the block ends; always thawed."""
    group = FREEZER / f"ddops-reliability-{host}"
    group.mkdir(exist_ok=True)
    moved = []
    try:
        for pid in host_pids(lab, host):
            try:
                (group / "cgroup.procs").write_text(str(pid))
                moved.append(pid)
            except OSError:
                pass  # exited meanwhile
        (group / "freezer.state").write_text("FROZEN")
        yield moved
    finally:
        thaw(group)


def thaw(group: Path) -> None:
    (group / "freezer.state").write_text("THAWED")
    wait_for(lambda: (group / "freezer.state").read_text().strip() == "THAWED", 10, 0.05)
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            (FREEZER / "cgroup.procs").write_text(pid)
        except OSError:
            pass
    try:
        group.rmdir()
    except OSError:
        pass


def freezer_available() -> bool:
    return (FREEZER / "cgroup.procs").exists()


# -- the shared pivoted state --------------------------------------------------------------------

IGNORE_SIGTERM = "DFLASH_IGNORE_SIGTERM=1\nDFLASH_STEP_SECONDS=0.5\n"
STUBBORN_CLEANUP = (
    "pid=$(systemctl show -p MainPID --value dflash-train.service); "
    "if [ \"$pid\" != 0 ] && tr '\\0' '\\n' < /proc/$pid/environ | grep -q '^DFLASH_IGNORE_SIGTERM=1'; then "
    "systemctl kill -s KILL dflash-train.service; sleep 1; systemctl reset-failed dflash-train.service; "
    "systemctl start dflash-train.service; fi")


@pytest.fixture(scope="session")
def base(lab, tmp_path_factory):
    """ct200 serving the lab profile (grace 3 s) after stopping a training job that ignores SIGTERM.

    Yields {"profile", "report", "unit", "env", "folder"}: the state every fault test must end in
    (healthy-old) unless it reports a newer healthy unit.
    """
    from ddops.demo import ensure_tiny_models, seed_drafter
    from ddops.executor import Executor
    from ddops.inventory import load_inventory

    ensure_tiny_models(lambda m: None)
    inventory = load_inventory(lab.inventory_path)
    with Executor(inventory) as ex:
        seed_drafter(inventory, ex, lambda m: None)
    folder = tmp_path_factory.mktemp("reliability")
    profile = variant(folder, "base", {"training.grace_s": 3, "health.deadline_s": 90})
    saved = sh(lab, "ct200", "cat /etc/default/dflash-train 2>/dev/null")
    training_was = sh(lab, "ct200", "systemctl is-active dflash-train.service").strip()
    try:
        lab.ssh("ct200", ["bash", "-c", "cat > /etc/default/dflash-train && rm -f /var/lib/ddops/pivot.lock /var/lib/ddops/pivot.journal.json "
                                        "&& systemctl reset-failed && systemctl restart dflash-train.service"],
                input=IGNORE_SIGTERM)
        wait_for(lambda: "step" in sh(lab, "ct200", "tail -n1 /root/train/train.log"), 20)
        done, report = pivot(lab, profile)
    finally:
        lab.ssh("ct200", ["bash", "-c", "cat > /etc/default/dflash-train"], input=saved)
        # A rollback may have restarted the job with the stubborn setting: replace it with a normal one.
        sh(lab, "ct200", STUBBORN_CLEANUP)
    assert done.returncode == 0 and report["outcome"] in ("ok", "unchanged"), report
    state = unit_state(lab)
    assert state["active"] == "active" and healthy(lab)
    yield {"profile": profile, "report": report, "unit": state["unit"], "env": state["env"], "folder": folder}
    if training_was == "active":  # the lab as the suite found it: training runs (the runtime stays, healthy)
        sh(lab, "ct200", "systemctl reset-failed dflash-train.service; systemctl start dflash-train.service")

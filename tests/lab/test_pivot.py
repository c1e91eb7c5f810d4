"""The pivot on the real lab: ct200 from training to the DDTree runtime, gated, recorded, rolled back.

The tests run in order and share ct200's state: a clean pivot, a re-run that changes nothing, a
missing package, a crash on start (auto rollback), a wrong identity, a dry run, the lock, rollback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.lab, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "playbooks" / "lab-ddtree16.yaml"
SNAPSHOT = r"""
for p in /etc/systemd/system /etc/ddops /var/lib/ddops /root/models /opt/ddtree/venv/ddtree-release.json /root/train/checkpoints; do
  [ -e "$p" ] && find "$p" -type f -o -type l | sort | xargs -r sha256sum
done
for u in ddtree.service dflash-train.service; do systemctl show "$u" -p ActiveState -p MainPID -p UnitFileState; done
"""


def ddops(lab, *args, inventory=None, timeout=900) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "ddops", "-i", str(inventory or lab.inventory_path), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          stdin=subprocess.DEVNULL)


def pivot(lab, *extra, profile=PROFILE, inventory=None) -> tuple[subprocess.CompletedProcess, dict]:
    done = ddops(lab, "pivot", "--kill-training", "--deploy", str(profile), "--yes", "--json", *extra,
                 inventory=inventory)
    try:
        report = json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"no JSON report (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}")
    return done, report


def step(report, name) -> dict:
    return next(s for s in report["steps"] if s["name"] == name)


def ct200(lab, command: str, timeout=120) -> str:
    return lab.ssh("ct200", command, timeout=timeout).stdout


def main_pid(lab) -> str:
    return ct200(lab, "systemctl show ddtree.service -p MainPID --value").strip()


def variant(tmp_path, **changes) -> Path:
    doc = yaml.safe_load(PROFILE.read_text())
    for key, value in changes.items():
        section, _, sub = key.partition("__")
        if sub:
            doc[section][sub] = value
        else:
            doc[section] = value
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


PIVOT_RESET = ("systemctl disable --now ddtree.service; rm -f /etc/systemd/system/ddtree.service /etc/ddops/ddtree.env "
               "/var/lib/ddops/pivot.lock /var/lib/ddops/pivot.journal.json; rm -rf /var/lib/ddops/backups; "
               "systemctl daemon-reload; systemctl reset-failed; systemctl start dflash-train.service")


@pytest.fixture(scope="module")
def pivot_lab(lab):
    """ct200 training, no ddtree.service; the tiny models built and the drafter on eval-a6000. ct200 is
    left that way afterwards too: a module that pivots it must not hand the next one a serving host (the
    lab's own tests expect training, `monitor` would scrape the leftover unit)."""
    from ddops.demo import ensure_tiny_models, seed_drafter
    from ddops.executor import Executor
    from ddops.inventory import load_inventory

    ensure_tiny_models(lambda m: None)
    inventory = load_inventory(lab.inventory_path)
    with Executor(inventory) as ex:
        seed_drafter(inventory, ex, lambda m: None)
    ct200(lab, PIVOT_RESET)
    yield lab
    ct200(lab, PIVOT_RESET)


def test_pivot_end_to_end(pivot_lab, tmp_path):
    lab = pivot_lab
    done, report = pivot(lab)
    assert done.returncode == 0, report
    assert report["outcome"] == "ok"
    training = report["training"]
    assert training["graceful"] and training["checkpoint"]["path"].endswith("-final.ckpt")
    assert "dflash-train.service" in report["stopped_units"]
    health = report["gates"]["health"]["health"]
    assert health["status"] == "ok" and health["block_size"] == 16 and health["mode"] == "ddtree"
    smoke = report["gates"]["smoke"]["results"][0]
    assert smoke["ok"] and smoke["lossless"] and smoke["mean_acceptance_length"] >= 1.5
    assert ct200(lab, "systemctl is-active ddtree.service").strip() == "active"
    assert ct200(lab, "systemctl is-active dflash-train.service").strip() != "active"
    assert ct200(lab, "stat -c %a /etc/ddops/ddtree.env").strip() == "600"
    status = json.loads(ddops(lab, "--limit", "ct200", "status", "--json").stdout)[0]
    assert any(r["unit"] == "ddtree.service" and r["healthy"] for r in status["runtime"])
    history = json.loads(ddops(lab, "history", "--host", "ct200", "--json").stdout)
    assert history[-1]["outcome"] == "ok" and history[-1]["release"] == report["release"]


def test_rerun_changes_nothing(pivot_lab):
    pid = main_pid(pivot_lab)
    done, report = pivot(pivot_lab)
    assert done.returncode == 0 and report["outcome"] == "unchanged", report
    assert main_pid(pivot_lab) == pid
    assert step(report, "smoke")["status"] == "done"


def test_bench_against_the_deployed_runtime(pivot_lab, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "count", "prompt": "Count from 3 to 20."}\n{"id": "add", "prompt": "What is 2+3?"}\n')
    done = ddops(pivot_lab, "bench", "--host", "ct200", "--profile", str(PROFILE), "--prompts", str(prompts),
                 "--modes", "ar,ddtree:4,ddtree:16", "--max-tokens", "24", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["errors"] == 0 and len(report["results"]) == 6
    dd = report["overall"]["ddtree:16"]
    assert dd["same_text_as_ar"] == dd["compared_with_ar"] == 2
    assert dd["mean_acceptance_length"] > 1.5 and dd["tokens_per_s"] > 0
    assert "1/6: count, ar" in done.stderr and "6/6: add, ddtree:16" in done.stderr   # progress, as it ran


def test_bench_load_run_against_the_deployed_runtime(pivot_lab):
    """`ddops bench --concurrency N` over SSH and `pct exec`: every request streamed to its end."""
    done = ddops(pivot_lab, "bench", "--host", "ct200", "--profile", str(PROFILE), "--modes", "ddtree:16",
                 "--concurrency", "3", "--requests", "6", "--max-tokens", "16", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["concurrency"] == 3 and report["requests"] == 6 and report["errors"] == 0
    load = report["overall"]["ddtree:16"]
    assert load["requests"] == 6 and load["tokens_per_s"] > 0 and load["wall_s"] > 0
    assert 0 < load["ttft_p50_s"] <= load["latency_p99_s"]
    assert all(r["finish_reason"] in ("stop", "length") for r in report["results"])
    text = ddops(pivot_lab, "bench", "--host", "ct200", "--profile", str(PROFILE), "--modes", "ar",
                 "--concurrency", "2", "--requests", "2", "--max-tokens", "8")
    assert text.returncode == 0 and "2 clients at once" in text.stdout and "first token p50" in text.stdout


def test_missing_package_installed_before_start(pivot_lab):
    ct200(pivot_lab, "/opt/ddtree/venv/bin/pip uninstall -y -q uvicorn", timeout=120)
    done, report = pivot(pivot_lab)
    assert done.returncode == 0, report
    deps = step(report, "deps")
    assert deps["status"] == "done" and "uvicorn" in deps["summary"]
    assert ct200(pivot_lab, "/opt/ddtree/venv/bin/python -c 'import uvicorn; print(1)'").strip() == "1"


def test_crash_on_start_is_caught_fast_and_rolled_back(pivot_lab, tmp_path):
    bad = variant(tmp_path, serve__extra_args=["--tree-budget", "0"])
    done, report = pivot(pivot_lab, profile=bad)
    assert done.returncode == 2
    assert report["outcome"] == "rolled-back", report
    health = step(report, "health")
    assert health["status"] == "failed" and health["seconds"] < 30  # not the 240 s deadline
    assert "journal tail" in report["error"]
    assert ct200(pivot_lab, "systemctl is-active ddtree.service").strip() == "active"
    assert "--tree-budget 0" not in ct200(pivot_lab, "cat /etc/systemd/system/ddtree.service")
    body = ct200(pivot_lab, "python3 -c \"import urllib.request as u; "
                            "print(u.urlopen('http://127.0.0.1:8200/health').read().decode())\"")
    assert json.loads(body)["status"] == "ok"


def test_identity_mismatch_changes_nothing(pivot_lab, tmp_path):
    before = ct200(pivot_lab, SNAPSHOT)
    doc = yaml.safe_load(Path(pivot_lab.inventory_path).read_text())
    doc["hosts"]["ct200"]["expect"]["gpu_model"] = "RTX A6000"
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump(doc))
    done, report = pivot(pivot_lab, "--break-lock", profile=variant(tmp_path, serve__tree_budget=8),
                         inventory=inventory)
    assert done.returncode == 2 and report["outcome"] == "failed"
    assert "IDENTITY MISMATCH on ct200" in report["error"]
    assert ct200(pivot_lab, SNAPSHOT) == before


def test_dry_run_is_byte_identical(pivot_lab, tmp_path):
    before = {h: pivot_lab.ssh(h, SNAPSHOT).stdout for h in ("ct200", "eval-a6000")}
    done = ddops(pivot_lab, "pivot", "--kill-training", "--deploy", str(variant(tmp_path, serve__tree_budget=8)),
                 "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "-ExecStart=" in done.stdout and "--tree-budget 8" in done.stdout
    assert {h: pivot_lab.ssh(h, SNAPSHOT).stdout for h in ("ct200", "eval-a6000")} == before


def test_lock_refuses_a_second_pivot(pivot_lab):
    holder = json.dumps({"user": "ana", "control_host": "laptop", "pid": 4242, "token": "t"})
    pivot_lab.ssh("ct200", ["bash", "-c", 'cat > /var/lib/ddops/pivot.lock'], input=holder)
    done, report = pivot(pivot_lab)
    assert done.returncode == 2 and "locked by another ddops run" in report["error"]
    assert "ana@laptop pid 4242" in report["error"] and "--break-lock" in report["error"]
    done, report = pivot(pivot_lab, "--break-lock")
    assert done.returncode == 0 and report["outcome"] == "unchanged", report
    assert ct200(pivot_lab, "test -e /var/lib/ddops/pivot.lock && echo held || echo free").strip() == "free"


def test_rollback_brings_back_the_previous_unit(pivot_lab):
    listing = json.loads(ddops(pivot_lab, "rollback", "--host", "ct200", "--list", "--json").stdout)
    assert len(listing) >= 2 and not listing[0]["meta"]["unit_existed"]
    done = ddops(pivot_lab, "rollback", "--host", "ct200", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    newest = [b["id"] for b in listing if b["meta"].get("reason") != "rollback"][-1]   # not one a rollback took
    assert report["backup_id"] == newest and report["health"]["health"]["status"] == "ok"
    # All the way back: before the first pivot there was no unit and training ran.
    done = ddops(pivot_lab, "rollback", "--host", "ct200", "--to", listing[0]["id"], "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout).get("removed")
    assert ct200(pivot_lab, "systemctl is-active dflash-train.service").strip() == "active"
    assert ct200(pivot_lab, "test -e /etc/systemd/system/ddtree.service && echo yes || echo no").strip() == "no"
    kinds = [r["kind"] for r in json.loads(ddops(pivot_lab, "history", "--host", "ct200", "--json").stdout)]
    assert kinds[-2:] == ["rollback", "rollback"]

"""The gates on the way back, on the real lab: a replicated deploy rolled back is held to the health
check and the smoke test of the profile that installed what is restored, on each restored replica; one
that fails its smoke is reported, left drained, and never called healthy.

The fault: a drafter whose weights are noise. Health cannot see it (the runtime loads it and serves);
the smoke test's acceptance floor does. The pivot syncs it, and a rollback cannot take model files back
(it restores units, releases and replicas), so the replica it restarts meets the same drafter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from faultlab import ddops, note, pivot, sh, variant

pytestmark = [pytest.mark.lab, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
REPLICAS = REPO / "playbooks" / "lab-replicas.yaml"
RESET = ("systemctl disable --now ddtree.service ddtree@1.service ddtree@2.service 2>/dev/null; "
         "systemctl stop haproxy.service 2>/dev/null; rm -f /etc/systemd/system/ddtree@.service "
         "/etc/ddops/ddtree@*.env /var/lib/ddops/pivot.lock /var/lib/ddops/pivot.journal.json; rm -rf /var/lib/ddops/replicas "
         "/var/lib/ddops/backups/ddtree@.service; systemctl daemon-reload; systemctl reset-failed; "
         "systemctl start dflash-train.service")


def noisy_drafter(folder: Path) -> Path:
    """A copy of the tiny drafter with every weight replaced by noise of the same shape and scale."""
    import torch
    from safetensors.torch import load_file, save_file

    from ddops.demo import ensure_tiny_models, tiny_dir

    ensure_tiny_models(lambda m: None)
    target = folder / "noisy-draft"
    shutil.copytree(tiny_dir() / "draft", target)
    generator = torch.Generator().manual_seed(7)
    weights = load_file(target / "model.safetensors")
    noisy = {}
    for name, t in weights.items():
        scale = float(t.float().std()) if t.numel() > 1 else 0.0
        noisy[name] = (torch.randn(t.shape, generator=generator) * (scale + 0.02)).to(t.dtype) \
            if t.is_floating_point() else t
    save_file(noisy, target / "model.safetensors")
    return target


@pytest.fixture(scope="module")
def replicated(lab):
    """ct200 serving lab-replicas, freshly deployed; at the end, rolled back to the backup that deploy
    took (Debian's haproxy.cfg back, the replicas removed, training running), and the drafter removed
    (the next pivot of any profile syncs the real one back)."""
    from ddops.demo import seed_drafter
    from ddops.executor import Executor
    from ddops.inventory import load_inventory

    inventory = load_inventory(lab.inventory_path)
    with Executor(inventory) as ex:
        seed_drafter(inventory, ex, lambda m: None)
    sh(lab, "ct200", RESET, timeout=180)
    done, report = pivot(lab, REPLICAS, timeout=900)
    assert done.returncode == 0 and report["outcome"] == "ok", report
    yield lab
    listing = json.loads(ddops(lab, "rollback", "--host", "ct200", "--unit", "ddtree@.service", "--list",
                               "--json").stdout)
    ddops(lab, "rollback", "--host", "ct200", "--unit", "ddtree@.service", "--to", listing[0]["id"], timeout=600)
    sh(lab, "ct200", RESET + "; rm -rf /root/models/tiny-draft", timeout=180)


def main_pid(lab, unit: str) -> str:
    return sh(lab, "ct200", f"systemctl show {unit} -p MainPID --value").strip()


def test_a_rolled_back_replica_passes_the_restored_profile_s_smoke(replicated, tmp_path):
    crash = variant(tmp_path, "crash", {"serve.tree_budget": 8, "serve.extra_args": ["--tree-budget", "0"]},
                    base=REPLICAS)
    done, report = pivot(replicated, crash, timeout=900)
    note("replicas: batch 1 crashes; the restored replica smoked", report)
    assert done.returncode == 2 and report["outcome"] == "rolled-back", report
    rollback = report["rollback"]
    assert rollback["checked"] == {"ddtree@1.service": {"profile": "lab-replicas", "health": "passed",
                                                        "smoke": "passed"}}
    smoke = rollback["replicas"]["ddtree@1.service"]["smoke"]
    assert smoke["ok"] and {r["replica"] for r in smoke["results"]} == {"ddtree@1.service"}
    assert all(r["lossless"] and r["mean_acceptance_length"] >= 1.5 for r in smoke["results"]), smoke
    assert rollback["replicas"]["ddtree@1.service"]["health"]["health"]["tree_budget"] == 16
    assert report["state"].endswith("never stopped serving; smoke passed on ddtree@1.service"), report["state"]


def test_a_restored_replica_that_fails_its_smoke_is_reported_not_called_healthy(replicated, tmp_path):
    broken = variant(tmp_path, "noisy", {"models.draft.from": {"host": "local", "path": str(noisy_drafter(tmp_path))}},
                     base=REPLICAS)
    serving_pid = main_pid(replicated, "ddtree@2.service")
    done, report = pivot(replicated, broken, timeout=900)
    note("replicas: noisy drafter; the restored replica fails smoke", report)
    assert done.returncode == 2 and report["outcome"] == "rollback-failed", report
    batch, = report["rolling"]
    assert batch["failed_at"] == "smoke" and "below the floor" in batch["error"], batch
    rollback = report["rollback"]
    assert rollback["checked"] == {"ddtree@1.service": {"profile": "lab-replicas", "health": "passed",
                                                        "smoke": "failed"}}
    assert not rollback["replicas"]["ddtree@1.service"]["smoke"]["ok"]
    assert "below the floor" in report["rollback_error"] and "ddtree@1.service" in report["rollback_error"]
    assert report["state"].startswith("ROLLBACK FAILED on ct200: needs a human (smoke test failed")
    assert "healthy" not in report["state"] and "smoke failed on ddtree@1.service" in report["state"]
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["rollback"]["status"] == "failed" and "healthy" not in steps["rollback"]["summary"]
    # the replica that failed stays out of the balancer; the one never restarted still serves
    status = json.loads(ddops(replicated, "--limit", "ct200", "status", "--json").stdout)[0]
    servers = {r["unit"]: r["balancer"]["status"] for r in status["replicas"][0]["replicas"]}
    assert servers["ddtree@2.service"] == "UP" and servers["ddtree@1.service"] != "UP", servers
    assert main_pid(replicated, "ddtree@2.service") == serving_pid
    last = json.loads(sh(replicated, "ct200", "tail -n1 /var/lib/ddops/history.jsonl"))
    assert last["outcome"] == "rollback-failed"

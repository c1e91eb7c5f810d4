"""The pivot to a hybrid target on the real lab: ct200 serves the tiny Qwen3.5-style (Gated DeltaNet)
pair through the bundled runtime, gated on health and a lossless smoke test; a target architecture the
runtime does not implement is refused by preflight before anything changes."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from test_pivot import REPO, SNAPSHOT, ct200, pivot

pytestmark = [pytest.mark.lab, pytest.mark.slow]

PROFILE = REPO / "playbooks" / "lab-hybrid-ddtree16.yaml"
RESET = ("systemctl disable --now ddtree.service; rm -f /etc/systemd/system/ddtree.service "
         "/etc/ddops/ddtree.env /var/lib/ddops/pivot.lock /var/lib/ddops/pivot.journal.json; rm -rf /var/lib/ddops/backups; "
         "systemctl daemon-reload; systemctl reset-failed; systemctl start dflash-train.service")


@pytest.fixture(scope="module")
def hybrid_lab(lab, tiny_hybrid_models):
    """ct200 training with no ddtree.service, before and after these tests."""
    ct200(lab, RESET)
    yield lab
    ct200(lab, RESET)


def test_pivot_serves_a_hybrid_target(hybrid_lab):
    done, report = pivot(hybrid_lab, profile=PROFILE)
    assert done.returncode == 0 and report["outcome"] == "ok", report
    health = report["gates"]["health"]["health"]
    assert health["status"] == "ok" and health["target_arch"] == "qwen3_5" and health["model"] == "tiny-hybrid"
    for result in report["gates"]["smoke"]["results"]:
        assert result["ok"] and result["lossless"], result
        assert result["mean_acceptance_length"] >= 3.0, result
    assert ct200(hybrid_lab, "systemctl is-active ddtree.service").strip() == "active"


def test_unsupported_target_architecture_changes_nothing(hybrid_lab, tiny_hybrid_models, tmp_path):
    target = tmp_path / "llama-target"
    shutil.copytree(tiny_hybrid_models / "target", target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "model_type": "llama",
                                                    "architectures": ["LlamaForCausalLM"]}))
    doc = yaml.safe_load(PROFILE.read_text())
    doc["models"]["target"]["from"]["path"] = str(target)
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(doc))
    before = ct200(hybrid_lab, SNAPSHOT)
    done, report = pivot(hybrid_lab, profile=profile)
    assert done.returncode == 2 and report["outcome"] != "ok"
    assert "model_type 'llama'" in report["error"] and "does not implement" in report["error"], report["error"]
    assert ct200(hybrid_lab, SNAPSHOT) == before

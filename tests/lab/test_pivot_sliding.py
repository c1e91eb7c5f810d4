"""The pivot to a drafter laid out as z-lab's Qwen3.6 drafters on the real lab: ct200 serves the tiny
target with the tiny drafter's weights under sliding-window layers (window 16, then a full layer),
gated on health and the lossless smoke test with its acceptance floor; a DFlash2 drafter, which the
runtime does not serve, is refused by preflight before anything changes."""

from __future__ import annotations

import json

import pytest
import yaml
from test_pivot import REPO, SNAPSHOT, ct200, pivot
from test_pivot_hybrid import RESET

from ddops.paths import cache_root
from ddtree_devtools.tiny import relaid_drafter

pytestmark = [pytest.mark.lab, pytest.mark.slow]

PROFILE = REPO / "playbooks" / "lab-sliding-ddtree16.yaml"


@pytest.fixture(scope="module")
def sliding_lab(lab, tiny_models):
    """The sliding drafter where the profile reads it; ct200 training with no ddtree.service, before and
    after these tests."""
    relaid_drafter(tiny_models / "draft", cache_root() / "tiny-draft-sliding16", 16)
    ct200(lab, RESET)
    yield lab
    ct200(lab, RESET)


def test_pivot_serves_a_sliding_window_drafter(sliding_lab):
    done, report = pivot(sliding_lab, profile=PROFILE)
    assert done.returncode == 0 and report["outcome"] == "ok", report
    health = report["gates"]["health"]["health"]
    assert health["status"] == "ok" and health["mode"] == "ddtree"
    for result in report["gates"]["smoke"]["results"]:
        assert result["ok"] and result["lossless"], result
        assert result["mean_acceptance_length"] >= 1.5, result
    config = json.loads(ct200(sliding_lab, "cat /root/models/tiny-draft-sliding16/config.json"))
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 16


def test_dflash2_drafter_changes_nothing(sliding_lab, tmp_path):
    draft = relaid_drafter(cache_root() / "tiny-draft-sliding16", tmp_path / "dflash2", 16)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "architectures": ["DFlash2DraftModel"]}))
    doc = yaml.safe_load(PROFILE.read_text())
    doc["models"]["draft"]["from"]["path"] = str(draft)
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(doc))
    before = ct200(sliding_lab, SNAPSHOT)
    done, report = pivot(sliding_lab, profile=profile)
    assert done.returncode == 2 and report["outcome"] != "ok"
    assert "DFlash2DraftModel" in report["error"] and "not served" in report["error"], report["error"]
    assert ct200(sliding_lab, SNAPSHOT) == before

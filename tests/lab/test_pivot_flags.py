"""Flags checked against the server that will run the unit, on the real lab: a DDTree profile passing a
flag its shipped runtime does not have is refused at preflight, naming the flag, with every file on
ct200 and eval-a6000 byte-identical (the SGLang side, against the host's installed server, is in
test_pivot_sglang.py)."""

from __future__ import annotations

import pytest
from test_pivot import SNAPSHOT, pivot, variant

pytestmark = [pytest.mark.lab, pytest.mark.slow]

# Training runs throughout and keeps writing checkpoints; its unchanged MainPID shows it was left alone.
UNTOUCHED = SNAPSHOT.replace(" /root/train/checkpoints;", ";")


def test_a_flag_the_shipped_runtime_lacks_is_refused_before_anything_changes(lab, tmp_path):
    before = {h: lab.ssh(h, UNTOUCHED).stdout for h in ("ct200", "eval-a6000")}
    bad = variant(tmp_path, serve__extra_args=["--speculative-gamma", "4"])
    done, report = pivot(lab, profile=bad)
    assert done.returncode == 2 and report["outcome"] == "failed" and report["failed_step"] == "preflight", report
    assert "ddtree-serve of the runtime shipped from" in report["error"]
    assert "has no flag --speculative-gamma (from extra_args), which the unit passes" in report["error"]
    assert {h: lab.ssh(h, UNTOUCHED).stdout for h in ("ct200", "eval-a6000")} == before

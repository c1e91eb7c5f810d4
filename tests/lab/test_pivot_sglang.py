"""The SGLang path end to end on the real lab: llm-two's plain sglang-qwen.service gives way to SGLang
with DFLASH over the tiny hybrid pair (the lab's stand-in SGLang checks its flags as SGLang does),
gated, smoked, a no-change re-run, a crash on start rolled back, and a rollback to before the first
pivot. First, a flag the installed SGLang lacks, and more tensor-parallel ranks than llm-two has GPUs,
are refused at preflight with every file untouched.

The tests run in order and share llm-two's state; the module leaves llm-two as `lab up` made it."""

from __future__ import annotations

import json
import urllib.request

import pytest
import yaml
from test_pivot import REPO, ddops, step

pytestmark = [pytest.mark.lab, pytest.mark.slow]

PROFILE = REPO / "playbooks" / "lab-sglang-dflash.yaml"
UNIT = "sglang-dflash.service"
RESET = (f"systemctl disable --now {UNIT}; rm -f /etc/systemd/system/{UNIT} /etc/ddops/sglang-dflash.env "
         "/var/lib/ddops/pivot.lock; rm -rf /var/lib/ddops/backups; systemctl daemon-reload; systemctl reset-failed; "
         "systemctl start sglang-qwen.service")
SNAPSHOT = r"""
for p in /etc/systemd/system /etc/ddops /var/lib/ddops /root/models; do
  [ -e "$p" ] && find "$p" -type f -o -type l | sort | xargs -r sha256sum
done
for u in sglang-dflash.service sglang-qwen.service; do systemctl show "$u" -p ActiveState -p MainPID -p UnitFileState; done
"""


def llm_two(lab, command: str) -> str:
    return lab.ssh("llm-two", command, timeout=120).stdout


def pivot(lab, profile=PROFILE, *extra) -> tuple[int, dict]:
    done = ddops(lab, "pivot", "--deploy", str(profile), "--yes", "--json", *extra)
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"no JSON report (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}")


def variant(tmp_path, **sglang) -> str:
    doc = yaml.safe_load(PROFILE.read_text())
    doc["sglang"].update(sglang)
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.fixture(scope="module")
def sglang_lab(lab, tiny_hybrid_models):
    llm_two(lab, RESET)
    yield lab
    llm_two(lab, RESET)


def test_a_flag_the_installed_sglang_lacks_is_refused_before_anything_changes(sglang_lab, tmp_path):
    before = llm_two(sglang_lab, SNAPSHOT)
    code, report = pivot(sglang_lab, variant(tmp_path, extra_args=["--speculative-gamma", "4"]))
    assert code == 2 and report["failed_step"] == "preflight", report
    assert ("SGLang's launch_server installed on llm-two has no flag --speculative-gamma (from extra_args), "
            "which the unit passes") in report["error"]
    assert llm_two(sglang_lab, SNAPSHOT) == before


def test_more_ranks_than_gpus_are_refused_before_anything_changes(sglang_lab, tmp_path):
    before = llm_two(sglang_lab, SNAPSHOT)
    code, report = pivot(sglang_lab, variant(tmp_path, tp_size=4))   # 4 ranks on llm-two's 2 GPUs
    assert code == 2 and report["failed_step"] == "preflight", report
    assert ("llm-two has 2 GPU(s) and the profile's `gpus: [0, 1]` gives SGLang 2 of them, but the profile's "
            "sglang.tp_size is 4") in report["error"] and "\n" not in report["error"]
    assert llm_two(sglang_lab, SNAPSHOT) == before


def test_pivot_to_sglang_end_to_end(sglang_lab):
    code, report = pivot(sglang_lab)
    assert code == 0 and report["outcome"] == "ok", report
    assert "unit flags checked against SGLang's launch_server installed on llm-two" in step(report, "preflight")["summary"]
    assert "sglang-qwen.service" in report["stopped_units"]
    assert report["gates"]["health"]["seconds"] < 60
    smoke, = report["gates"]["smoke"]["results"]
    assert smoke["ok"] and smoke["text"] == "echo: Say: sglang lab ready" and smoke["finish_reason"] == "stop"
    assert llm_two(sglang_lab, f"systemctl is-active {UNIT}").strip() == "active"
    assert llm_two(sglang_lab, "systemctl is-active sglang-qwen.service").strip() != "active"
    unit = llm_two(sglang_lab, f"cat /etc/systemd/system/{UNIT}")
    assert "--speculative-algorithm DFLASH" in unit and "--mamba-scheduler-strategy extra_buffer" in unit
    assert "CUDA_VISIBLE_DEVICES=0,1" in llm_two(sglang_lab, "cat /etc/ddops/sglang-dflash.env")
    models = json.load(urllib.request.urlopen("http://127.0.0.1:30000/v1/models", timeout=5))  # shared network
    assert models["data"][0]["id"] == "tiny-hybrid"


def test_rerun_changes_nothing(sglang_lab):
    pid = llm_two(sglang_lab, f"systemctl show {UNIT} -p MainPID --value").strip()
    code, report = pivot(sglang_lab)
    assert code == 0 and report["outcome"] == "unchanged", report
    assert llm_two(sglang_lab, f"systemctl show {UNIT} -p MainPID --value").strip() == pid


def test_a_crash_on_start_is_rolled_back(sglang_lab, tmp_path):
    # a flag SGLang has but refuses with DFLASH at start; preflight does not know that rule
    code, report = pivot(sglang_lab, variant(tmp_path, extra_args=["--pp-size", "2"]))
    assert code == 2 and report["outcome"] == "rolled-back", report
    assert step(report, "health")["status"] == "failed"
    assert "DFLASH speculative decoding only supports pp_size == 1" in report["error"], report["error"]
    assert llm_two(sglang_lab, f"systemctl is-active {UNIT}").strip() == "active"
    assert "--pp-size" not in llm_two(sglang_lab, f"cat /etc/systemd/system/{UNIT}")


def test_rollback_to_before_the_first_pivot(sglang_lab):
    listing = json.loads(ddops(sglang_lab, "rollback", "--host", "llm-two", "--unit", UNIT, "--list", "--json").stdout)
    assert not listing[0]["meta"]["unit_existed"]
    done = ddops(sglang_lab, "rollback", "--host", "llm-two", "--unit", UNIT, "--to", listing[0]["id"], "--json")
    assert done.returncode == 0 and json.loads(done.stdout).get("removed"), done.stderr[-2000:]
    assert llm_two(sglang_lab, "systemctl is-active sglang-qwen.service").strip() == "active"
    assert llm_two(sglang_lab, f"test -e /etc/systemd/system/{UNIT} && echo yes || echo no").strip() == "no"

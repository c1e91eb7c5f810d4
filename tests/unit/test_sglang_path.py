"""The SGLang path below the lab: the profile passes the mamba scheduler strategy and preflight refuses a
hybrid target without extra_buffer; the port held by a conflict the pivot stops first is fine; SGLang's
empty /health body is healthy; and the lab's stand-in SGLang takes and refuses flags as SGLang does, its
--help listing every flag the SGLang profiles pass."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ddops.errors import ConfigError
from ddops.facts import Tree
from ddops.gates.health import judge
from ddops.preflight import check_models, check_port
from ddops.profile import load_profile
from ddops.serverflags import parse_help, unit_flags
from ddops.steps.unit import exec_argv

REPO = Path(__file__).resolve().parents[2]
STAND_IN = REPO / "ddops" / "lab" / "assets" / "sglang_stub.py"
FIXTURE = REPO / "fixtures" / "tiny-hybrid-seed0"


def tiny_tree(role: str) -> Tree:
    import json
    return Tree.from_json({"exists": True, "config": json.loads((FIXTURE / role / "config.json").read_text())})


@pytest.fixture(scope="module")
def profile():
    return load_profile(REPO / "playbooks" / "lab-sglang-dflash.yaml", repo_root=REPO)


def test_the_unit_passes_the_mamba_strategy(profile):
    argv = exec_argv(profile)
    assert argv[argv.index("--mamba-scheduler-strategy") + 1] == "extra_buffer"
    real = load_profile(REPO / "playbooks" / "llm-two-sglang-dflash.yaml", repo_root=REPO)
    assert "--mamba-scheduler-strategy" in exec_argv(real)
    plain = replace(profile, sglang=replace(profile.sglang, mamba_scheduler_strategy=None))
    assert "--mamba-scheduler-strategy" not in exec_argv(plain)


def test_a_hybrid_target_without_extra_buffer_is_refused(profile):
    trees = {"target": tiny_tree("target"), "draft": tiny_tree("draft")}
    assert check_models(profile, trees) == []
    problems = check_models(replace(profile, sglang=replace(profile.sglang, mamba_scheduler_strategy="no_buffer")), trees)
    assert problems == [f"target model local:{profile.model('target').source.path} is a hybrid (qwen3_5_text, "
                        "linear-attention layers) and SGLang's DFLASH on it needs `--mamba-scheduler-strategy "
                        "extra_buffer`, but the profile passes no_buffer; set `sglang.mamba_scheduler_strategy: "
                        "extra_buffer`"]


def test_the_strategy_is_one_of_sglangs(tmp_path):
    text = (REPO / "playbooks" / "lab-sglang-dflash.yaml").read_text()
    (tmp_path / "p.yaml").write_text(text.replace("mamba_scheduler_strategy: extra_buffer", "mamba_scheduler_strategy: big"))
    with pytest.raises(ConfigError, match="must be one of auto, no_buffer, extra_buffer, extra_buffer_lazy"):
        load_profile(tmp_path / "p.yaml", repo_root=REPO)


def test_the_port_may_be_held_by_a_conflict_the_pivot_stops(profile):
    assert check_port(profile, {"unit": "sglang-qwen.service", "pid": 3}) == []
    assert check_port(profile, {"unit": "other.service", "pid": 3}) != []


def test_sglangs_empty_health_body_is_healthy():
    poll = {"unit": {"ActiveState": "active", "SubState": "running", "NRestarts": "0", "MainPID": "7"},
            "health": {"http_status": 200, "body": None}}
    assert judge(poll, 7).state == "healthy"
    assert judge(poll, 7, {"mode": "ddtree"}).state != "healthy"   # the ddtree runtime must say its mode


# -- the lab's stand-in SGLang ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def stand_in():
    spec = importlib.util.spec_from_file_location("sglang_stand_in", STAND_IN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse(stand_in, *argv):
    return stand_in.build_parser().parse_args(list(argv))


def test_its_help_lists_every_flag_the_sglang_profiles_pass(stand_in, profile):
    flags = parse_help(stand_in.build_parser().format_help())
    real = load_profile(REPO / "playbooks" / "llm-two-sglang-dflash.yaml", repo_root=REPO)
    for p in (profile, real):
        assert set(unit_flags(exec_argv(p))) <= flags


def test_it_refuses_an_unknown_flag_as_sglangs_parser_does():
    done = subprocess.run([sys.executable, str(STAND_IN), "--model-path", "m", "--speculative-gamma", "4"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "unrecognized arguments: --speculative-gamma" in done.stderr


@pytest.mark.parametrize("extra, message", [
    (["--enable-dp-attention"], "Currently DFLASH speculative decoding does not support dp attention."),
    (["--mamba-scheduler-strategy", "no_buffer"], "needs --mamba-scheduler-strategy extra_buffer"),
    (["--speculative-num-draft-tokens", "32"], "exceeds the DFLASH drafter's block_size 16"),
    (["--tp-size", "4"], "tp_size 4 needs 4 GPUs; 2 visible"),
])
def test_it_checks_its_flags_as_sglang_does(stand_in, monkeypatch, extra, message):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(stand_in, "ddops_lab_gpu", type("Lab", (), {"load_config": staticmethod(lambda: {"count": 2})}))
    ok = ["--model-path", str(FIXTURE / "target"), "--speculative-algorithm", "DFLASH",
          "--speculative-draft-model-path", str(FIXTURE / "draft"), "--speculative-num-draft-tokens", "16",
          "--tp-size", "2", "--mamba-scheduler-strategy", "extra_buffer"]
    stand_in.check(parse(stand_in, *ok))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        stand_in.check(parse(stand_in, *ok, *extra))

"""The SGLang path below the lab: the profile passes the mamba scheduler strategy and preflight refuses a
hybrid target without extra_buffer; the port held by a conflict the pivot stops first is fine; preflight
refuses more tensor-parallel ranks than the host gives SGLang GPUs, in a real run and a dry run, before
any command that changes the host; SGLang's empty /health body is healthy; and the lab's stand-in SGLang
takes and refuses flags as SGLang does, its --help listing every flag the SGLang profiles pass."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

import ddops.preflight as preflight_module
from ddops.errors import ConfigError
from ddops.executor import Outcome
from ddops.facts import HostFacts, ServerFlags, Tree
from ddops.gates.health import judge
from ddops.inventory import load_inventory
from ddops.pivot import Pivot, PivotOptions
from ddops.preflight import check_models, check_port, check_tensor_parallel
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


# -- tensor-parallel ranks against the host's GPUs -----------------------------------------------------

def llm_two_facts(gpus: int, error: str | None = None) -> dict:
    """The facts probe's JSON for llm-two with `gpus` GPUs (or nvidia-smi's error)."""
    listed = [{"index": str(i), "name": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"} for i in range(gpus)]
    return {"hostname": "llm-two", "gpus": {"list": listed, "error": error}, "training": None}


def tp(profile, size: int, gpus: str | None = "0,1"):
    return replace(profile, gpus=gpus, sglang=replace(profile.sglang, tp_size=size))


def test_tensor_parallel_ranks_must_fit_the_hosts_gpus(profile):
    two = HostFacts.from_json(llm_two_facts(2))
    assert check_tensor_parallel(profile, two) == []   # the lab profile: tp 2 on gpus [0, 1]
    assert check_tensor_parallel(tp(profile, 2, gpus=None), two) == []
    assert check_tensor_parallel(tp(profile, 4, gpus=None), two) == [
        "llm-two has 2 GPU(s), but the profile's sglang.tp_size is 4: SGLang needs one GPU per tensor-parallel "
        "rank and would never come up; set `sglang.tp_size` to at most 2, or deploy it to a host with at least "
        "4 GPU(s)"]
    assert check_tensor_parallel(tp(profile, 2, gpus="0"), two) == [
        "llm-two has 2 GPU(s) and the profile's `gpus: [0]` gives SGLang 1 of them, but the profile's "
        "sglang.tp_size is 2: SGLang needs one GPU per tensor-parallel rank and would never come up; set "
        "`sglang.tp_size` to at most 1, or list 2 of its GPUs (0 to 1) in `gpus`"]
    problem, = check_tensor_parallel(tp(profile, 2, gpus="1,2"), two)   # GPU 2 is not on the host
    assert problem.startswith("llm-two has 2 GPU(s) and the profile's `gpus: [1, 2]` gives SGLang 1 of them")
    problem, = check_tensor_parallel(tp(profile, 1, gpus=None), HostFacts.from_json(llm_two_facts(0)))
    assert problem.endswith("would never come up; deploy it to a host with at least 1 GPU(s)")


def test_gpus_the_probe_could_not_list_are_not_taken_for_none(profile):
    unread = HostFacts.from_json(llm_two_facts(0, error="nvidia-smi: command not found"))
    assert unread.gpu_error == "nvidia-smi: command not found" and unread.gpu_count == 0
    assert check_tensor_parallel(tp(profile, 4), unread) == []


def test_a_ddtree_unit_of_one_rank_on_the_cpu_needs_no_gpu():
    ddtree = load_profile(REPO / "playbooks" / "lab-ddtree16.yaml", repo_root=REPO)
    assert check_tensor_parallel(ddtree, HostFacts.from_json(llm_two_facts(0))) == []


class ProbeOnlyExecutor:
    """The executor preflight fans out over (its probes are stubbed): any other command is kept, so a test
    sees that nothing reached the host: no lock, no unit, no history line."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def fan_out(self, hosts, work, *, deadline_s=None):
        outcomes = {}
        for host in hosts:
            outcomes[host.name] = Outcome(host.name, value=work(host))
        return outcomes

    def run(self, host, argv, **kwargs):
        self.commands.append(list(argv))
        raise AssertionError(f"a command reached {host.name}: {argv[:2]}")


def stub_probes(monkeypatch, profile, gpus: int) -> None:
    """llm-two as `lab up` makes it, but with `gpus` GPUs: the models not synced yet, sglang-qwen serving
    on the port (a conflict), SGLang installed with every flag the unit passes."""
    dest = {m.path: {"exists": False} for m in profile.models}
    inspected = {"trees": dest, "free": {p: {"checked": "/root", "free_bytes": 100 * 2**30} for p in dest},
                 "port": {"unit": "sglang-qwen.service", "pid": 7, "cmdline": "python3 -m sglang.launch_server"},
                 "units": {"sglang-qwen.service": {"ActiveState": "active"}}, "lock": None}
    local = {m.source.path: {"exists": True, "bytes": 1000, "config": tiny_tree(m.role).config}
             for m in profile.models}
    flags = ServerFlags(source="SGLang's launch_server installed on llm-two",
                        flags=frozenset(unit_flags(exec_argv(profile))))
    monkeypatch.setattr(preflight_module, "gather", lambda executor, host, **kw: llm_two_facts(gpus))
    monkeypatch.setattr(preflight_module, "run_probe", lambda executor, host, name, args, **kw: inspected)
    monkeypatch.setattr(preflight_module, "inspect_local", lambda args: {"trees": local})
    monkeypatch.setattr(preflight_module, "host_flags", lambda executor, host, profile: flags)


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_pivot_asking_more_ranks_than_gpus_is_refused_at_preflight(monkeypatch, profile, dry_run):
    wide = tp(profile, 4)
    stub_probes(monkeypatch, wide, gpus=2)
    executor = ProbeOnlyExecutor()
    report = Pivot(wide, load_inventory(REPO / "inventories" / "lab.yaml"), executor,
                   Console(file=io.StringIO(), width=160), options=PivotOptions(yes=True, dry_run=dry_run)).execute()
    out = report.as_json()
    assert (out["outcome"], out["failed_step"], out["exit_code"]) == ("failed", "preflight", 2)
    assert out["error"] == (
        "preflight found a problem: llm-two has 2 GPU(s) and the profile's `gpus: [0, 1]` gives SGLang 2 of them, "
        "but the profile's sglang.tp_size is 4: SGLang needs one GPU per tensor-parallel rank and would never come "
        "up; set `sglang.tp_size` to at most 2, or deploy it to a host with at least 4 GPU(s) (nothing was changed)")
    assert executor.commands == []   # no lock taken, no unit written, no history line


def test_the_same_pivot_with_ranks_that_fit_passes_preflight(monkeypatch, profile):
    stub_probes(monkeypatch, profile, gpus=2)
    facts, summary = preflight_module.preflight(profile, load_inventory(REPO / "inventories" / "lab.yaml"),
                                                ProbeOnlyExecutor(), dry_run=True)
    assert summary.startswith("1 host(s) ok; llm-two is llm-two with 2 GPU(s)")


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

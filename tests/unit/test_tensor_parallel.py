"""ddops's side of tensor parallelism (issue 27): `serve.tensor_parallel` reaches the unit's command line;
each replica (or the one unit) gets its own tensor_parallel GPUs in CUDA_VISIBLE_DEVICES; preflight
refuses, in one line and with exit 2 through the CLI, too few GPUs and a size that does not divide the
target's heads; the capacity is one GPU's share of the split target; status shows the size; and the
llm-two profile (in sglang-qwen's place, on its port) dry-runs against the fleet inventory."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console
from test_render_safety import BASE, SGLANG, profile_from

import ddops.preflight as preflight_module
from ddops import capacity
from ddops.errors import ConfigError
from ddops.facts import HostFacts, ServerFlags, Tree
from ddops.preflight import check_heads_split, check_tensor_parallel
from ddops.probes import probe_source
from ddops.profile import load_profile
from ddops.serverflags import parse_help
from ddops.status import _services_cell, replicas_table
from ddops.steps.unit import exec_argv, render
from ddops.top import targets
from ddtree_runtime.capacity import Shape, pool_capacity
from ddtree_runtime.server.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures" / "capacity"
TARGET = json.loads((FIXTURES / "qwen3.6-27b.json").read_text())
DRAFT = json.loads((FIXTURES / "qwen3.6-27b-dflash.json").read_text())
RTX_PRO_6000 = 97887  # MiB
LLM_TWO = REPO / "playbooks" / "llm-two-ddtree16.yaml"
ON_GPUS = {**BASE, "device": "cuda", "dtype": "bfloat16"}


def llm_two(gpus: int = 2) -> HostFacts:
    return HostFacts.from_json(facts_json(gpus))


def facts_json(gpus: int) -> dict:
    listed = [{"index": i, "name": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "memory_used_mib": 500,
               "memory_total_mib": RTX_PRO_6000, "compute_cap": 12.0} for i in range(gpus)]
    return {"hostname": "llm-two", "gpus": {"list": listed, "error": None}, "training": None}


@pytest.fixture(scope="module")
def profile():
    return load_profile(LLM_TWO, repo_root=REPO)


# -- the setting and the GPUs ---------------------------------------------------------------------------

def test_the_setting_reaches_the_units_command_line(tmp_path):
    argv = exec_argv(profile_from(tmp_path, BASE, {"serve.tensor_parallel": 2}))
    assert argv[argv.index("--tensor-parallel") + 1] == "2"
    assert "--tensor-parallel" not in exec_argv(profile_from(tmp_path, BASE))   # 1, the default: not spelt out
    assert "--tensor-parallel" in parse_help(build_parser().format_help())      # and the runtime takes it


def test_one_unit_spans_its_gpus_zero_to_n_or_those_listed(tmp_path):
    two = profile_from(tmp_path, ON_GPUS, {"serve.tensor_parallel": 2})
    assert two.gpus == "0,1" and "CUDA_VISIBLE_DEVICES=0,1\n" in render(two, {}).env_text
    assert capacity.serving_gpus(two) == [0, 1]
    listed = profile_from(tmp_path, {**ON_GPUS, "gpus": [2, 3]}, {"serve.tensor_parallel": 2})
    assert "CUDA_VISIBLE_DEVICES=2,3\n" in render(listed, {}).env_text and capacity.serving_gpus(listed) == [2, 3]
    # at 1 nothing changes: no CUDA_VISIBLE_DEVICES unless the profile lists GPUs
    assert "CUDA_VISIBLE_DEVICES" not in render(profile_from(tmp_path, ON_GPUS), {}).env_text


def replicated(tmp_path, **changes):
    doc = {**ON_GPUS, "unit": "ddtree@.service", "conflicts": []}
    return profile_from(tmp_path, doc, {"serve.tensor_parallel": 2, "serve.replicas": 2, **changes})


def test_each_replica_gets_tensor_parallel_gpus_of_its_own(tmp_path):
    p = replicated(tmp_path)
    assert [(r.unit, r.gpus) for r in p.replicas.members] == [("ddtree@1.service", (0, 1)), ("ddtree@2.service", (2, 3))]
    envs = {f.path: f.text for f in render(p, {}).files}
    assert "CUDA_VISIBLE_DEVICES=0,1\n" in envs["/etc/ddops/ddtree@1.env"]
    assert "CUDA_VISIBLE_DEVICES=2,3\n" in envs["/etc/ddops/ddtree@2.env"]
    assert capacity.serving_gpus(p) == [0, 1, 2, 3]
    # the profile's `gpus`, in its order: replica 1 the first two, replica 2 the next two
    p = replicated(tmp_path, gpus=[3, 1, 2, 0], **{"serve.replicas": {"count": 2, "first_port": 9000}})
    assert [r.gpus for r in p.replicas.members] == [(3, 1), (2, 0)]


@pytest.mark.parametrize("doc, changes, message", [
    ({**ON_GPUS, "gpus": [1]}, {}, "`gpus` lists 1 GPU(s) and serve.tensor_parallel is 2"),
    ({**ON_GPUS, "device": "cuda:1"}, {}, "`device: cuda:1` names one GPU, and serve.tensor_parallel 2 spans 2"),
    ({**ON_GPUS, "gpus": [0, 0]}, {}, "`gpus` lists a GPU twice"),
    ({**ON_GPUS, "unit": "ddtree@.service"}, {"serve.replicas": {"count": 2, "gpus_each": 1}},
     "`serve.replicas.gpus_each: 1` with serve.tensor_parallel 2"),
    ({**ON_GPUS, "unit": "ddtree@.service", "gpus": [0, 1, 2]}, {"serve.replicas": 2},
     "2 replicas x 2 GPU(s) need 4 GPUs, `gpus` lists 3"),
    (SGLANG, {}, "`serve.tensor_parallel` is the bundled runtime's (an SGLang profile sets `sglang.tp_size`)"),
])
def test_gpus_that_cannot_carry_the_split_are_one_line_at_load(tmp_path, doc, changes, message):
    with pytest.raises(ConfigError) as err:
        profile_from(tmp_path, doc, {"serve.tensor_parallel": 2, **changes})
    assert message in err.value.line() and "p.yaml:" in err.value.line() and "\n" not in err.value.line()


# -- preflight ------------------------------------------------------------------------------------------

def test_preflight_refuses_more_gpus_than_the_host_has_in_one_line(tmp_path, profile):
    assert check_tensor_parallel(profile, llm_two(2)) == []
    problem, = check_tensor_parallel(profile, llm_two(1))
    assert problem == (f"llm-two has 1 GPU(s), and one server needs 2 (serve.tensor_parallel 2): ddtree.service on "
                       f"GPU 0,1 ({profile.where('serve')}); lower serve.tensor_parallel, or deploy to a host "
                       "with at least 2 GPUs")
    problem, = check_tensor_parallel(replicated(tmp_path), llm_two(2))
    assert problem.startswith("ct200 has 2 GPU(s), and 2 replica(s) x 2 GPU(s) need 4 (serve.tensor_parallel 2): "
                              "ddtree@1.service on GPU 0,1; ddtree@2.service on GPU 2,3 (")
    assert problem.endswith("); lower serve.replicas or serve.tensor_parallel, or deploy to a host with at least "
                            "4 GPUs")
    # enough GPUs, but the listed ones are not all on the host
    problem, = check_tensor_parallel(replace(profile, gpus="1,2"), llm_two(2))
    assert problem.endswith("list GPUs 0 to 1 only in `gpus`")
    # GPUs the probe could not list are not taken for none
    unread = HostFacts.from_json({**facts_json(0), "gpus": {"list": [], "error": "nvidia-smi: not found"}})
    assert check_tensor_parallel(profile, unread) == []


def test_preflight_refuses_a_size_that_does_not_divide_the_targets_heads(profile):
    assert check_heads_split(profile, TARGET) == []   # 2 divides 24, 4, 17408, 16 and 48
    three = replace(profile, serve=replace(profile.serve, tensor_parallel=3))
    assert check_heads_split(three, TARGET) == [
        f"serve.tensor_parallel 3 ({profile.where('serve')}) does not divide target model "
        "llm-two:/root/models/Qwen3.6-27B's KV heads (4), MLP intermediate size (17408) and linear-attention key "
        "heads (16): each rank takes an equal share of every layer's heads and MLP rows; set "
        "serve.tensor_parallel to 1, 2 or 4"]
    eight = replace(profile, serve=replace(profile.serve, tensor_parallel=8))
    assert "'s KV heads (4): " in check_heads_split(eight, TARGET)[0]
    assert check_heads_split(three, {"model_type": "qwen3"}) == []   # unreadable: the capacity line says why


class FleetProbes:
    """llm-two and eval-a6000 as the fleet inventory names them, answering preflight's probes: llm-two with
    its 2 GPUs, sglang-qwen serving on port 30000, the target on its disk; the drafter on eval-a6000."""

    def __init__(self, monkeypatch, profile, target: dict = TARGET) -> None:
        draft, target_dir = profile.model("draft"), profile.model("target").path
        none = {"exists": False, "sha256": None, "text": None}
        self.inspect = {
            "llm-two": {"trees": {target_dir: {"exists": True, "bytes": 55 * 2**30, "files": {}, "config": target},
                                  draft.path: {"exists": False, "files": {}, "bytes": 0, "config": None}},
                        "free": {p: {"checked": "/root", "free_bytes": 500 * 2**30} for p in (target_dir, draft.path)},
                        "port": {"unit": "sglang-qwen.service", "pid": 7, "cmdline": "python -m sglang.launch_server"},
                        "files": {"/etc/systemd/system/ddtree.service": none, "/etc/ddops/ddtree.env": none,
                                  "/opt/ddtree/venv/ddtree-release.json": none},
                        "imports": {"venv": False, "modules": {}},
                        "units": {"ddtree.service": {"ActiveState": "inactive", "LoadState": "not-found"},
                                  "sglang-qwen.service": {"ActiveState": "active", "UnitFileState": "enabled"}},
                        "lock": None},
            "eval-a6000": {"trees": {draft.source.path: {"exists": True, "bytes": 3 * 2**30, "files": {},
                                                         "config": DRAFT}}}}
        self.facts = {"llm-two": facts_json(2),
                      "eval-a6000": {"hostname": "eval-a6000", "training": None, "gpus": {"error": None, "list": [
                          {"index": i, "name": "NVIDIA RTX A6000", "memory_total_mib": 49140} for i in range(2)]}}}
        flags = ServerFlags(source="ddtree-serve of the runtime shipped from runtime",
                            flags=parse_help(build_parser().format_help()))
        monkeypatch.setattr(preflight_module, "gather", lambda executor, host, **kw: self.facts[host.name])
        monkeypatch.setattr(preflight_module, "run_probe", lambda executor, host, name, args, **kw: self.inspect[host.name])
        monkeypatch.setattr(preflight_module, "shipped_flags", lambda ship, release: flags)


def test_the_llm_two_profile_dry_runs_against_the_fleet(monkeypatch, cli, profile):
    FleetProbes(monkeypatch, profile)
    code, out = cli("-i", "inventories/fleet.yaml", "pivot", "--deploy", "llm-two-ddtree16", "--dry-run", "--json")
    report, _ = json.JSONDecoder().raw_decode(out[out.index("{"):])
    assert (code, report["outcome"]) == (0, "dry-run"), out
    pool = report["pool"]
    assert (pool["tensor_parallel"], pool["requests_8k"], pool["gpu"].split(" ")[:2]) == (2, 16, ["GPU", "0"])
    assert pool["requests_max_context"] >= 2   # one request of 131,072 at TP 1 on this card; several at TP 2


@pytest.mark.parametrize("size, target, message", [
    (4, TARGET, "llm-two has 2 GPU(s), and one server needs 4 (serve.tensor_parallel 4): ddtree.service on GPU 0,1,2,3 ("),
    (2, {**TARGET, "text_config": {**TARGET["text_config"], "num_key_value_heads": 3}},
     "does not divide target model llm-two:/root/models/Qwen3.6-27B's KV heads (3): "),
])
def test_preflight_refusals_are_one_line_and_exit_2_through_the_cli(monkeypatch, cli, tmp_path, profile, size, target,
                                                                     message):
    wide = tmp_path / "llm-two-wide.yaml"
    wide.write_text(LLM_TWO.read_text().replace("gpus: [0, 1] ", f"gpus: {list(range(size))} ")
                    .replace("tensor_parallel: 2 ", f"tensor_parallel: {size} "))
    FleetProbes(monkeypatch, profile, target=target)
    code, out = cli("-i", "inventories/fleet.yaml", "pivot", "--deploy", str(wide), "--dry-run", "--json")
    report, _ = json.JSONDecoder().raw_decode(out[out.index("{"):])
    assert (code, report["outcome"], report["failed_step"]) == (2, "failed", "preflight") and "Traceback" not in out
    assert report["error"].startswith("preflight found a problem: ") and message in report["error"]
    assert "\n" not in report["error"] and report["error"].endswith("(nothing was changed)")


# -- capacity -------------------------------------------------------------------------------------------

def test_two_gpus_each_hold_half_the_targets_layers_and_head_and_its_kv_and_the_whole_drafter():
    one, two = (pool_capacity(RTX_PRO_6000 * 2**20, TARGET, DRAFT, dtype="bfloat16", mem_fraction=0.88,
                              max_running=16, max_context=131072, tensor_parallel=t) for t in (1, 2))
    drafter = Shape.from_config(DRAFT)
    drafter_weights, drafter_kv = drafter.drafter_parameters() * 2, drafter.token_bytes(2)
    # the target's layers and LM head halve; its embeddings (and norms, a few MB) stay whole on each rank,
    # as the runtime's split keeps them (model/parallel.py); the drafter's weights do not split at all
    target_one, target_two = one.weights_bytes - drafter_weights, two.weights_bytes - drafter_weights
    embeddings = 248320 * 5120 * 2
    assert 0 < 2 * target_two - target_one - embeddings < 1e-4 * target_one
    # a token's target KV halves exactly (2 of the 4 KV heads on each GPU); the drafter's KV is whole
    assert 2 * (two.token_bytes - drafter_kv) == one.token_bytes - drafter_kv == 2 * 2 * 16 * 4 * 256
    # a running request's recurrent state halves with the linear-attention heads
    assert 2 * two.request_bytes == one.request_bytes
    assert two.tensor_parallel == 2 and two.requests(131072) > 2 * one.requests(131072)
    assert one.summary().startswith("KV pool of ") and two.pool_tokens > one.pool_tokens


def test_the_plan_line_says_the_gpu_is_one_of_the_split(profile):
    trees = {"target": Tree(exists=True, config=TARGET), "draft": Tree(exists=True, config=DRAFT)}
    pool = capacity.estimate(profile, llm_two(2), trees)
    assert pool.capacity.tensor_parallel == 2 and pool.as_json()["tensor_parallel"] == 2
    assert pool.line.endswith("97,887 MiB), one of the 2 tensor-parallel GPUs of a server (each holds 1/2 of the "
                              "target's layers and KV, and the whole drafter)")
    assert capacity.check_fits(profile, pool) == []
    # on 80 GB cards at TP 2 one 131,072-token request fits too, where at TP 1 it did not
    small = HostFacts.from_json({**facts_json(2), "gpus": {"error": None, "list": [
        {"index": i, "name": "H100", "memory_total_mib": 81559} for i in range(2)]}})
    assert capacity.check_fits(profile, capacity.estimate(profile, small, trees)) == []


# -- status ---------------------------------------------------------------------------------------------

def run_facts_probe(tmp_path, exec_start: str) -> dict:
    """The facts probe, with a stand-in systemctl that shows a unit running `exec_start`."""
    (tmp_path / "systemctl").write_text(
        "#!/bin/sh\nprintf 'ActiveState=active\\nSubState=running\\nLoadState=loaded\\nNRestarts=0\\nMainPID=9\\n"
        f"ExecStart={{ path=/x ; argv[]={exec_start} ; ignore_errors=no ; start_time=[n/a] }}\\n'\n")
    (tmp_path / "systemctl").chmod(0o755)
    args = {"services": [{"unit": "ddtree.service"}], "training": None}
    done = subprocess.run([sys.executable, "-I", "-S", "-c", probe_source("facts"), json.dumps(args)],
                          capture_output=True, text=True, timeout=60, env={"PATH": f"{tmp_path}:/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["services"][0]


@pytest.mark.parametrize("exec_start, size", [
    ("/opt/ddtree/venv/bin/ddtree-serve --target /m --tensor-parallel 2 --port 30000", 2),
    ("/opt/ddtree/venv/bin/ddtree-serve --target /m --port 30000", 1),
    ("/opt/sglang/venv/bin/python -m sglang.launch_server --model-path /m --tp-size 2", 2),
    ("/usr/bin/python3 /root/train.py --tp-size 2", None),
])
def test_the_facts_probe_reads_the_size_from_the_installed_unit(tmp_path, exec_start, size):
    assert run_facts_probe(tmp_path, exec_start).get("tensor_parallel") == size


def test_status_shows_the_size_from_health_else_from_the_unit():
    unit = {"unit": "ddtree.service", "ActiveState": "active", "SubState": "running", "LoadState": "loaded",
            "tensor_parallel": 2}
    health = {"url": "http://127.0.0.1:30000/health", "unit": "ddtree.service", "healthy": True,
              "detail": {"status": "ok", "mode": "ddtree"}}
    assert _services_cell({"services": [unit], "runtime": [health]}).plain == "ddtree.service: active/running TP 2\n"
    reported = copy.deepcopy(health)
    reported["detail"]["tensor_parallel"] = 4      # what the running server says wins over the file
    assert _services_cell({"services": [unit], "runtime": [reported]}).plain.endswith("TP 4\n")
    stopped = {**unit, "ActiveState": "inactive", "SubState": "dead"}   # the port's health is another unit's
    assert _services_cell({"services": [stopped], "runtime": [reported]}).plain.endswith("inactive/dead TP 2\n")
    other = {"unit": "nginx.service", "ActiveState": "active", "SubState": "running", "LoadState": "loaded"}
    assert _services_cell({"services": [other], "runtime": []}).plain == "nginx.service: active/running\n"


def test_a_port_two_units_take_turns_on_is_the_running_ones():
    """llm-two's inventory names sglang-qwen and ddtree.service on port 30000: top (and so monitor's
    scrape targets) keep the one that runs, never the same port twice."""
    units = [{"unit": "sglang-qwen.service", "ActiveState": "inactive", "LoadState": "loaded"},
             {"unit": "ddtree.service", "ActiveState": "active", "LoadState": "loaded"}]
    runtime = [{"url": "http://127.0.0.1:30000/health", "unit": u["unit"], "healthy": True, "detail": {}} for u in units]
    assert [t.unit for t in targets({"services": units, "runtime": runtime})] == ["ddtree.service"]
    down = [{**u, "ActiveState": "inactive"} for u in units]   # neither runs: both shown, both down
    assert [t.unit for t in targets({"services": down, "runtime": runtime})] == ["sglang-qwen.service", "ddtree.service"]


def test_top_shows_each_targets_size():
    from io import StringIO

    from ddops.topview import targets_table

    units = [{"unit": "ddtree.service", "ActiveState": "active", "LoadState": "loaded", "tensor_parallel": 2}]
    runtime = [{"url": "http://127.0.0.1:30000/health", "unit": "ddtree.service", "healthy": True, "detail": {}}]
    target, = targets({"services": units, "runtime": runtime})
    assert target.tensor_parallel == 2
    frame = {"hosts": [{"host": "llm-two", "state": "ok", "targets": [
        {"unit": "ddtree.service", "port": 30000, "tensor_parallel": 2, "active": "active", "healthy": True,
         "health": "ok", "running": None, "capacity": None, "waiting": None, "balancer": None, "window": None}]}]}
    out = StringIO()
    Console(file=out, width=200, force_terminal=False).print(targets_table(frame))
    header, row = out.getvalue().splitlines()[:2]
    assert row[header.index("TP"):].split()[0] == "2"


def test_the_replicas_table_has_each_replicas_size():
    from io import StringIO

    def replica(n: int, state: dict) -> dict:
        return {"unit": f"ddtree@{n}.service", "port": 8200 + n, "gpus": [2 * n - 2, 2 * n - 1],
                "state": {"ActiveState": "active", "SubState": "running", **state},
                "health": {"healthy": True, "detail": {"status": "ok", "mode": "ddtree"}}, "balancer": {"status": "UP"}}

    deployment = {"template": "ddtree@.service", "profile": "p", "balancer": {
        "unit": "haproxy.service", "port": 8200, "state": {"ActiveState": "active"},
        "health": {"healthy": True, "detail": {"status": "ok"}}},
        "replicas": [replica(1, {"tensor_parallel": 2}), replica(2, {})]}
    out = StringIO()
    Console(file=out, width=200, force_terminal=False).print(replicas_table("ct200", deployment))
    header, = [line for line in out.getvalue().splitlines() if "replica" in line and "GPUs" in line]
    rows = [line for line in out.getvalue().splitlines() if "ddtree@" in line and ".service" in line][1:]
    cells = [[c.strip() for c in row.split("│")[1:-1]] for row in rows]
    tp = [c.strip() for c in header.split("┃")[1:-1]].index("TP")
    assert [(c[0], c[2], c[tp]) for c in cells] == [("ddtree@1.service", "0,1", "2"), ("ddtree@2.service", "2,3", "-")]

"""Pivot steps without SSH: {args, facts} -> planned changes and the exact commands (pyinfra style)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

import pytest

from ddops.facts import FileFact, Imports, Inspection, PivotFacts, Training, Tree
from ddops.gates.health import judge
from ddops.history import scrub
from ddops.hostlock import lock_problem
from ddops.inventory import load_inventory
from ddops.preflight import RUNTIME_TARGETS, check_models, check_port
from ddops.profile import load_profile
from ddops.remote import write_file_argv
from ddops.backups import restore_spec
from ddops.steps.deps import pip_argv, plan_deps
from ddops.steps.ship import plan_ship
from ddops.steps.start import plan_start, start_argvs
from ddops.steps.sync import plan_model
from ddops.steps.training import plan_training
from ddops.steps.unit import exec_argv, install_spec, plan_unit, render, systemd_quote
from ddops.transfer import rsync_argv

REPO = Path(__file__).resolve().parents[2]
LAB = load_inventory(REPO / "inventories" / "lab.yaml")


@pytest.fixture(scope="module")
def profile():
    return load_profile(REPO / "playbooks" / "lab-ddtree16.yaml", repo_root=REPO)


# -- unit ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arg, quoted", [
    ("/opt/x", "/opt/x"), ("a b", '"a b"'), ('say "hi"', '"say \\"hi\\""'), ("100%", "100%%"),
    ("$HOME", "\"$$HOME\""), ("; rm -rf /", '"; rm -rf /"'), ("x\ny", '"x\\ny"'),
])
def test_systemd_quote(arg, quoted):
    assert systemd_quote(arg) == quoted


def test_exec_argv_and_render(profile):
    argv = exec_argv(profile)
    assert argv[:3] == ["/opt/ddtree/venv/bin/ddtree-serve", "--target", "/root/models/tiny-target"]
    assert argv[argv.index("--block-size") + 1] == "16" and argv[argv.index("--host") + 1] == "127.0.0.1"
    r = render(profile, {})
    assert "Restart=on-failure" in r.unit_text and "EnvironmentFile=/etc/ddops/ddtree.env" in r.unit_text
    assert "PrivateDevices=" not in r.unit_text  # would hide the GPUs
    assert "OMP_NUM_THREADS=1" in r.env_text


def test_max_context_reaches_the_unit_only_when_set(profile):
    from dataclasses import replace
    assert "--max-context" not in exec_argv(profile)
    longer = replace(profile, serve=replace(profile.serve, max_context=131072))
    argv = exec_argv(longer)
    assert argv[argv.index("--max-context") + 1] == "131072"
    assert " --max-context 131072" in render(longer, {}).unit_text


def test_batching_settings_reach_the_unit_only_when_set(profile):
    from dataclasses import replace
    assert not {"--max-running", "--max-queue", "--mem-fraction"} & set(exec_argv(profile))
    busy = replace(profile, serve=replace(profile.serve, max_running=16, max_queue=64, mem_fraction=0.85,
                                          given=profile.serve.given | {"max_running", "max_queue", "mem_fraction"}))
    argv = exec_argv(busy)
    assert [argv[argv.index(f) + 1] for f in ("--max-running", "--max-queue", "--mem-fraction")] == ["16", "64", "0.85"]
    assert " --max-running 16 --max-queue 64 --mem-fraction 0.85" in render(busy, {}).unit_text
    assert "--no-prefix-cache" not in argv
    cold = replace(profile, serve=replace(profile.serve, prefix_cache=False))
    assert exec_argv(cold)[-1] == "--no-prefix-cache"
    rows = exec_argv(replace(profile, serve=replace(profile.serve, prefix_cache_rows=8)))
    assert rows[rows.index("--prefix-cache-rows") + 1] == "8"


def test_the_runtime_cli_accepts_every_shipped_profile_s_command_line(tmp_path):
    """The unit's ExecStart, parsed by the runtime's own CLI: every flag exists, every value passes
    its checks (model paths swapped for a directory that has a config.json)."""
    from ddops.profile import load_profile, resolve_profile
    from ddtree_runtime.server.cli import build_parser, config_from_args

    (tmp_path / "config.json").write_text("{}")
    for name in ("lab-ddtree16", "lab-hybrid-ddtree16", "zlab-ddtree16"):
        prof = load_profile(resolve_profile(name, REPO / "playbooks"), repo_root=REPO)
        argv = exec_argv(prof)[1:]
        for flag in ("--target", "--draft"):
            argv[argv.index(flag) + 1] = str(tmp_path)
        config = config_from_args(build_parser().parse_args(argv), {"DDTREE_API_KEY": "k"})
        assert config.max_running == (prof.serve.max_running or 16)
        assert config.max_context == prof.serve.max_context


def test_secrets_stay_out_of_unit_and_diff(profile):
    from dataclasses import replace
    p = replace(profile, secrets={"DDTREE_API_KEY": "K"})
    r = render(p, {"DDTREE_API_KEY": "s3cr3t"})
    assert "s3cr3t" not in r.unit_text and "s3cr3t" in r.env_text and "s3cr3t" not in r.env_masked
    changes = plan_unit(p, r, Inspection())
    assert all("s3cr3t" not in c.detail for c in changes)


def files(installed: dict) -> Inspection:
    return Inspection.from_json({"files": installed})


def test_plan_unit_fixtures(profile):
    r = render(profile, {})
    upath, epath = "/etc/systemd/system/ddtree.service", "/etc/ddops/ddtree.env"
    same = {upath: {"exists": True, "sha256": r.unit_sha256, "text": r.unit_text},
            epath: {"exists": True, "sha256": r.env_sha256, "text": r.env_masked}}
    assert plan_unit(profile, r, files(same)) == []  # nothing differs: no change, no restart
    old = dict(same)
    old[upath] = {"exists": True, "sha256": "x", "text": r.unit_text.replace("RestartSec=2", "RestartSec=9")}
    changes = plan_unit(profile, r, files(old))
    assert [c.what for c in changes] == [f"write {upath}"]
    assert "-RestartSec=9" in changes[0].detail and "+RestartSec=2" in changes[0].detail
    new = plan_unit(profile, r, Inspection())
    assert [c.what for c in new] == [f"write {upath} (new)", f"write {epath} (mode 0600) (new)"]


def test_install_and_restore_specs(profile):
    r = render(profile, {})
    spec = install_spec(profile, r, "20250101T000000Z-abcd", {"profile": "lab"})
    assert spec["unit_path"] == "/etc/systemd/system/ddtree.service"
    assert spec["backup_root"] == "/var/lib/ddops/backups/ddtree.service"
    assert restore_spec("ddtree.service", "B")["env_path"] == "/etc/ddops/ddtree.env"


# -- training --------------------------------------------------------------------------------------

@pytest.mark.parametrize("facts, kill, expected", [
    ({"training": {"running": True, "pid": 42, "last_step": 7, "unit": {"unit": "dflash-train.service"}}},
     True, ["stop training pid 42 (dflash-train.service) at step 7"]),
    ({"training": {"running": True, "pid": 42, "last_step": 7}}, False,
     ["stop training pid 42 at step 7 (a real run needs --kill-training)"]),
    ({"training": {"running": False}}, True, []),
    ({"training": None}, True, []),
])
def test_plan_training(facts, kill, expected):
    heads = [c.what.splitlines()[0] for c in plan_training(Training.from_json(facts["training"]), kill, "ct200")]
    assert heads == expected


# -- sync ------------------------------------------------------------------------------------------

def test_rsync_to_pct_host_goes_through_the_node():
    argv = rsync_argv(LAB, "/cache/d", "/root/models/d", dst_host=LAB.host("ct200"))
    assert argv[:5] == ["rsync", "-a", "--delete-after", "--delay-updates", "--timeout=60"]
    assert "--partial" not in argv  # a failed transfer must never leave a truncated file in place
    e = argv[argv.index("-e") + 1]
    assert "-p 2200" in e and "StrictHostKeyChecking=yes" in e and "UserKnownHostsFile=" in e
    assert "ServerAliveInterval=5" in e
    assert argv[argv.index("--rsync-path") + 1] == "pct exec 200 -- rsync"
    assert argv[-3:] == ["--", "/cache/d/", "root@127.0.0.1:/root/models/d/"]


def test_rsync_pull_and_checksum_verify():
    argv = rsync_argv(LAB, "/root/models/d", "/cache/d", src_host=LAB.host("eval-a6000"), checksum_dry_run=True)
    assert "--checksum" in argv and "--dry-run" in argv and "--rsync-path" not in argv
    assert "-p 2203" in argv[argv.index("-e") + 1]
    assert argv[-2:] == ["root@127.0.0.1:/root/models/d/", "/cache/d/"]


def test_plan_model(profile):
    model = profile.model("draft")
    src = {"exists": True, "files": {"config.json": [10, 1, "aa"], "w.bin": [9_000_000, 5, None]}}
    tree = Tree.from_json
    assert plan_model(model, tree(src), tree({"exists": True, "files": dict(src["files"])})) == []
    changed = plan_model(model, tree(src), tree({"exists": True, "files": {"config.json": [10, 1, "bb"], "old": [1, 1, "c"]}}))
    assert len(changed) == 1 and "2 file(s)" in changed[0].what and "1 to delete" in changed[0].what
    assert plan_model(model, tree(src), tree({"exists": False}))[0].data == {"role": "draft"}


# -- preflight -------------------------------------------------------------------------------------

TARGET = {"exists": True, "config": {"model_type": "qwen3", "num_hidden_layers": 4}, "bytes": 1}
DRAFT = {"exists": True, "bytes": 1, "config": {"block_size": 16, "num_target_layers": 4, "num_hidden_layers": 2,
                                                "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2, 3]}}}


@pytest.mark.parametrize("draft_config, problem", [
    ({}, None),
    ({"block_size": 8}, "block_size 8 is smaller than the profile's 16"),
    ({"num_target_layers": 3}, "num_target_layers 3 != target's num_hidden_layers 4"),
    ({"dflash_config": {"mask_token_id": 5}}, "no dflash_config.target_layer_ids"),
    ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 9]}}, "out of range"),
    # z-lab's Qwen3.6 layout is served; what the runtime's loader refuses, preflight refuses in its words
    ({"use_sliding_window": True, "sliding_window": 4096,
      "layer_types": ["sliding_attention", "full_attention"]}, None),
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel (z-lab's DFlash2"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "drafter layer_types"),
    ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2, 3], "block_size": 8}},
     "block_size 8 is smaller"),
])
def test_check_models_drafter_config(profile, draft_config, problem):
    draft = {**DRAFT, "config": {**DRAFT["config"], **draft_config}}
    problems = check_models(profile, {"target": Tree.from_json(TARGET), "draft": Tree.from_json(draft)})
    assert (problem is None and problems == []) or any(problem in p for p in problems), problems


def test_preflight_refuses_what_the_loader_refuses(profile, tiny_models, tmp_path):
    """The same drafter_layout check in both: a drafter config the runtime's loader refuses at load is a
    preflight problem with the loader's line, and one it loads is none."""
    from ddtree_runtime.model.loading import load_drafter

    base = json.loads((tiny_models / "draft" / "config.json").read_text())
    target = {**TARGET, "config": json.loads((tiny_models / "target" / "config.json").read_text())}
    for change in [{}, {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["sliding_attention",
                                                                                         "full_attention"]},
                   {"architectures": ["DFlash2DraftModel"]}, {"hidden_act": "gelu"}, {"is_causal": True}]:
        config = {**base, **change}
        (tmp_path / "model.safetensors").unlink(missing_ok=True)
        (tmp_path / "model.safetensors").symlink_to(tiny_models / "draft" / "model.safetensors")
        (tmp_path / "config.json").write_text(json.dumps(config))
        try:
            load_drafter(tmp_path)
            refused = None
        except ValueError as e:
            refused = str(e)
        problems = check_models(profile, {"target": Tree.from_json(target),
                                          "draft": Tree.from_json({**DRAFT, "config": config})})
        assert [p.split(": ", 1)[1] for p in problems] == ([refused] if refused else []), change


@pytest.mark.parametrize("config, problem", [
    ({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 4}}, None),
    ({"model_type": "qwen3_5_text", "num_hidden_layers": 4}, None),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4},
     "is model_type 'llama' (architectures ['LlamaForCausalLM']), which the bundled DDTree runtime does not"),
    ({"model_type": "qwen3_next", "num_hidden_layers": 4}, "serves qwen3 (Qwen3), qwen3_5 (Qwen3.5/3.6 hybrid)"),
])
def test_check_models_target_architecture(profile, config, problem):
    problems = check_models(profile, {"target": Tree.from_json({**TARGET, "config": config}),
                                      "draft": Tree.from_json(DRAFT)})
    assert (problem is None and problems == []) or (len(problems) == 1 and problem in problems[0]), problems


def test_preflight_knows_exactly_the_runtimes_targets():
    from ddtree_runtime.model.config import TARGET_ARCHS

    assert set(RUNTIME_TARGETS) == set(TARGET_ARCHS)


def test_check_models_missing(profile):
    problems = check_models(profile, {"target": Tree.from_json({"exists": False, "config": None}),
                                      "draft": Tree.from_json(DRAFT)})
    assert "target model dir local:" in problems[0] and "does not exist" in problems[0]


@pytest.mark.parametrize("holder, ok", [
    (None, True), ({"unit": "ddtree.service", "pid": 3}, True),
    ({"unit": "sglang-qwen.service", "pid": 3, "cmdline": "python sglang"}, False), ({"unit": None, "pid": 9}, False),
])
def test_check_port(profile, holder, ok):
    assert (check_port(profile, holder) == []) == ok


def test_lock_problem_names_the_holder():
    text = lock_problem("ct200", {"user": "ana", "control_host": "laptop", "pid": 12})
    assert "ana@laptop pid 12" in text and "--break-lock" in text
    assert lock_problem("ct200", None) is None


# -- deps and ship ---------------------------------------------------------------------------------

def test_plan_deps(profile):
    all_ok = {"venv": True, "modules": {m: {"ok": True} for m in profile.runtime.packages}}
    assert plan_deps(profile, Imports.from_json(all_ok)) == []
    one_missing = {"venv": True, "modules": {**all_ok["modules"], "safetensors": {"ok": False}}}
    assert [c.what for c in plan_deps(profile, Imports.from_json(one_missing))] == [
        "pip install safetensors>=0.4 (from the index)"]
    fresh = plan_deps(profile, Imports.from_json({"venv": False}))
    assert fresh[0].what == "create venv /opt/ddtree/venv" and len(fresh[1].data["modules"]) == 7
    assert pip_argv(profile, ["safetensors"])[-1] == "safetensors>=0.4"


def test_pip_argv_offline(profile):
    from dataclasses import replace
    p = replace(profile, runtime=replace(profile.runtime, index=False, wheelhouse="/w"))
    argv = pip_argv(p, ["torch"])
    assert "--no-index" in argv and argv[argv.index("--find-links") + 1] == "/var/cache/ddops/wheelhouse"

PIP_OUTPUT = """\
Collecting torch>=2.4
  Downloading torch-2.5.1-cp311-cp311-manylinux1_x86_64.whl (906.4 MB)
Collecting safetensors>=0.4
  Downloading https://files.example/safetensors-0.4.5-cp311-none-any.whl (435 kB)
Installing collected packages: safetensors, torch
Successfully installed safetensors-0.4.5 torch-2.5.1
"""


def test_the_pip_note_moves_while_pip_is_silent():
    from ddops.steps.deps import PipProgress

    now = [100.0]
    notes: list[str] = []
    pip = PipProgress(2, notes.append, clock=lambda: now[0])
    lines = PIP_OUTPUT.splitlines(keepends=True)
    pip.feed("".join(lines[:2]))
    assert notes[-1] == ("pip: downloading torch-2.5.1-cp311-cp311-manylinux1_x86_64.whl (906.4 MB), 0s; "
                         "1 requirement(s) collected (2 asked for, with their dependencies)")
    now[0] += 45                       # pip prints nothing while the wheel comes down: the note still moves
    assert pip.line().startswith("pip: downloading torch-2.5.1-cp311-cp311-manylinux1_x86_64.whl (906.4 MB), 45s")
    pip.feed("".join(lines[2:4])[:30])   # a line arrives in two pieces
    pip.feed("".join(lines[2:4])[30:])
    assert notes[-1].startswith("pip: downloading safetensors-0.4.5-cp311-none-any.whl (435 kB), 0s; 2 requirement(s)")
    pip.feed("".join(lines[4:5]))
    assert notes[-1].startswith("pip: installing 2 package(s), 0s")
    pip.feed("".join(lines[5:]))
    assert notes[-1].startswith("pip: installed")


def test_the_pip_note_is_refreshed_without_output(monkeypatch):
    from ddops.steps.deps import PipProgress

    monkeypatch.setattr(PipProgress, "REFRESH_S", 0.05)
    notes: list[str] = []
    with PipProgress(1, notes.append):
        time.sleep(0.3)
    assert len(notes) >= 2 and all(n.startswith("pip: starting") for n in notes)


def test_plan_ship(profile):
    installed = FileFact.from_json
    assert plan_ship(profile, installed({"text": '{"release": "0.1.0+abc"}'}), "0.1.0+abc") == []
    assert "now: 0.1.0+old" in plan_ship(profile, installed({"text": '{"release": "0.1.0+old"}'}), "0.1.0+abc")[0].what
    assert "now: none" in plan_ship(profile, installed({}), "0.1.0+abc")[0].what


# -- start -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("sent, lands", [(b"whole wheel bytes", True), (b"whole wh", False)])
def test_a_pushed_file_lands_only_whole(tmp_path, sent, lands):
    """A sender killed mid-push closes the stream early; what arrived must not replace the file."""
    target = tmp_path / "releases" / "r1" / "x.whl"
    done = subprocess.run(write_file_argv(str(target), len(b"whole wheel bytes")), input=sent, capture_output=True)
    assert (done.returncode == 0) == lands and target.exists() == lands, done.stderr
    assert not (tmp_path / "releases" / "r1" / "x.whl.tmp").exists()
    if lands:
        assert target.read_bytes() == sent
    else:
        assert b"got 8 of 17 bytes" in done.stderr


def test_start_nothing_changed_nothing_restarts(profile):
    units = {"ddtree.service": {"ActiveState": "active", "UnitFileState": "enabled"}}
    assert plan_start(profile, Inspection.from_json({"units": units}), set()) == []


def test_start_commands(profile):
    from dataclasses import replace
    p = replace(profile, conflicts=("sglang-qwen.service",))
    units = {"ddtree.service": {"ActiveState": "inactive", "UnitFileState": "disabled"},
             "sglang-qwen.service": {"ActiveState": "active"}}
    changes = plan_start(p, Inspection.from_json({"units": units}), {"unit"})
    assert start_argvs(changes) == [["systemctl", "stop", "sglang-qwen.service"],
                                       ["systemctl", "enable", "ddtree.service"],
                                       ["systemctl", "reset-failed", "ddtree.service"],
                                       ["systemctl", "restart", "ddtree.service"]]


# -- health gate -----------------------------------------------------------------------------------

def poll(active="active", sub="running", restarts="0", pid="100", status=None, body=None):
    return {"unit": {"ActiveState": active, "SubState": sub, "NRestarts": restarts, "MainPID": pid,
                     "ExecMainStatus": "2", "Result": "exit-code"},
            "health": {"http_status": status, "body": body, "error": None if status else "Connection refused"}}


@pytest.mark.parametrize("p, first_pid, state", [
    (poll(), None, "waiting"),
    (poll(status=503, body={"status": "starting"}), 100, "waiting"),
    (poll(status=200, body={"status": "ok", "block_size": 16}), 100, "healthy"),
    (poll(status=200, body={"status": "ok", "block_size": 8}), 100, "crashed"),
    (poll(active="failed", sub="failed", pid="0"), 100, "crashed"),
    (poll(active="activating", sub="auto-restart", pid="0"), 100, "crashed"),
    (poll(restarts="1", pid="101"), 100, "crashed"),
    (poll(pid="101"), 100, "crashed"),
    (poll(active="inactive", sub="dead", pid="0"), 100, "crashed"),
])
def test_judge(p, first_pid, state):
    assert judge(p, first_pid, {"block_size": 16}).state == state


def test_history_scrub():
    assert scrub({"api_key": "x", "nested": [{"token": "y", "n": 1}]}) == {"api_key": "***",
                                                                          "nested": [{"token": "***", "n": 1}]}


# -- the plan as a log shows it (not a terminal) ---------------------------------------------------

def _log_console():
    import io

    from rich.console import Console

    return Console(file=io.StringIO(), width=160, force_terminal=False, highlight=False)


def test_plan_view_in_a_log_writes_each_change_once_and_no_second_step_list():
    from ddops.plan import Operation as Change
    from ddops.views import PlanView, StepState

    sync = StepState("sync", "Sync model dirs", status="planned", changes=[
        Change("sync target local:/root/.cache/ddops/tiny-models-seed0/target -> /root/models/tiny-target: "
               "9 file(s), 2.8 MiB"),
        Change("sync draft eval-a6000:/root/models/tiny-draft -> /root/models/tiny-draft: 2 file(s), 1.3 MiB")])
    record = StepState("record", "Record", status="planned", summary="append to /var/lib/ddops/history.jsonl")
    console = _log_console()
    with PlanView([sync, record], console) as view:
        sync.status = "running"
        view.refresh()
        for note in ("push draft: 0%", "push draft: 0%", "push draft: 100%"):
            view.progress(note)
        sync.status, sync.summary, sync.seconds = "done", "synced and verified: target, draft", 1.5
        view.refresh()
        record.status, record.summary = "done", "appended to /var/lib/ddops/history.jsonl on ct200"
        view.refresh()
    out = console.file.getvalue()
    lines = [line for line in out.splitlines() if line.strip()]
    assert "pending" not in out and "planned" not in out
    assert all(a != b for a, b in zip(lines, lines[1:])), out
    assert out.count("push draft: 0%") <= 1
    assert lines[-1] == " ✔ Record: done: appended to /var/lib/ddops/history.jsonl on ct200"
    assert sum("Sync model dirs" in line for line in lines) == 2    # started, done: the plan was its one table


def test_a_plan_row_shows_every_change_whole():
    from ddops.plan import Operation as Change
    from ddops.views import PlanView, StepState

    long = "sync draft eval-a6000:/root/models/tiny-draft -> /root/models/tiny-draft: 2 file(s), 1.3 MiB"
    state = StepState("sync", "Sync model dirs", status="planned", changes=[Change("x" * 150), Change(long)])
    console = _log_console()
    console.print(PlanView([state], console).table())
    assert "/root/models/tiny-draft: 2 file(s), 1.3 MiB" in console.file.getvalue()


def test_a_step_that_runs_long_gets_a_heartbeat_in_a_log(monkeypatch):
    import time

    import ddops.views as pivot

    monkeypatch.setattr(pivot, "HEARTBEAT_S", 0.5)
    state = pivot.StepState("health", "Health gate", status="running")
    console = _log_console()
    with pivot.PlanView([state], console) as view:
        view.refresh()
        time.sleep(1.8)
        state.status = "done"
    assert "... health gate, 1s" in console.file.getvalue() or "... health gate, 2s" in console.file.getvalue()


@pytest.mark.parametrize("result, line", [
    ({"prompt": "What is 2+3?", "ok": True, "text": "5", "completion_tokens": 2, "rounds": 1,
      "mean_acceptance_length": 2.0, "lossless": True, "seconds": 0.31},
     "'What is 2+3?' -> '5' ok: 2 token(s), 1 draft-and-verify round(s), 2 tokens accepted per round; "
     "identical to plain decoding; 0.31s"),
    ({"prompt": "What is 2+3?", "ok": True, "text": "5", "completion_tokens": 2, "rounds": 1,
      "mean_acceptance_length": 16.0, "lossless": True, "seconds": 0.04},
     "'What is 2+3?' -> '5' ok: 2 token(s), 1 draft-and-verify round(s), 16 tokens accepted per round "
     "(counted before the answer's end cut the last round); identical to plain decoding; 0.04s"),
    ({"prompt": "Hi", "ok": False, "text": "", "lossless": False},
     "'Hi' -> '' FAILED; DIFFERS from plain decoding"),
])
def test_smoke_line_says_what_was_measured(result, line):
    from ddops.views import smoke_line

    assert smoke_line(result) == line


def test_a_single_wait_in_a_log_says_each_note_once_and_beats(monkeypatch):
    import time

    import ddops.progress as progress

    monkeypatch.setattr(progress, "NOTE_S", 0.0)
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.5)
    console = _log_console()
    with progress.Activity(console, "preflight") as activity:
        for note in ("probing ct200", "probing ct200", "probing eval-a6000"):
            activity.update(note)
        time.sleep(1.8)
    lines = console.file.getvalue().splitlines()
    assert lines[:2] == ["     probing ct200", "     probing eval-a6000"]
    assert any(line.startswith("     ... preflight, ") and line.endswith(": probing eval-a6000") for line in lines[2:])


# -- a stopped sync leaves no holding dirs in the model folder --------------------------------------

def test_clearing_removes_rsync_s_holding_dirs_only(tmp_path):
    import subprocess

    from ddops.steps.sync import HOLDING, clear_holding_argv

    (tmp_path / HOLDING).mkdir()
    (tmp_path / HOLDING / "model.safetensors").write_bytes(b"half")
    (tmp_path / "sub" / HOLDING).mkdir(parents=True)
    (tmp_path / "sub" / HOLDING / "tokenizer.json").write_text("{")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub" / "kept.txt").write_text("x")
    subprocess.run(clear_holding_argv(str(tmp_path)), check=True, timeout=30)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["config.json", "sub", "sub/kept.txt"]


def test_a_failed_sync_clears_the_holding_dirs_before_and_after(profile):
    from ddops.executor import CommandResult
    from ddops.plan import RunContext
    from ddops.steps.sync import SyncStep, clear_holding_argv

    class Recorder:
        def __init__(self):
            self.commands = []

        def run(self, host, argv, **kwargs):
            self.commands.append(list(argv))
            return CommandResult(host.name, "", 0, "", "", 0)

    class Stopped(SyncStep):
        def transfer(self, ctx, model):
            raise KeyboardInterrupt   # Ctrl-C reaching rsync: it stops with its holding dirs in place

    model = profile.model("target")
    for facts, removed in ((None, False), (PivotFacts(serving="ct200", hosts={}, inspections={"ct200": Inspection()}),
                                           True)):
        executor = Recorder()
        with pytest.raises(KeyboardInterrupt):
            Stopped().sync_model(RunContext(profile=profile, inventory=LAB, executor=executor, facts=facts), model)
        assert executor.commands.count(clear_holding_argv(model.path)) == 2
        # a model dir the sync made (none there before) goes again; one that was there stays
        assert (["rmdir", "--", model.path] in executor.commands) is removed

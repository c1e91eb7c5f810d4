"""The training stop that shows its cost: a checkpoint's step read from its name, what a kill would lose
in the plan (and --json), preflight refusing a kill over the limit when nothing can lower it, the profile's
training fields, and the stop_training action run here on real processes: a job that answers the
checkpoint signal loses nothing, one that ignores it is left running, refused, when over the limit."""

from __future__ import annotations

import hashlib
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ddops.errors import ConfigError
from ddops.facts import Training
from ddops.preflight import check_kill_cost
from ddops.probes import probe_source
from ddops.probes.hostlib import checkpoint_step, newest_checkpoint
from ddops.profile import TrainingStop, load_profile
from ddops.steps.training import plan_training, refusal

REPO = Path(__file__).resolve().parents[2]


def training(last_step=1205, step=1180, path="/ck/step_1180.ckpt", folder="/ck") -> Training:
    return Training.from_json({"running": True, "pid": 9, "pids": [9], "unit": {"unit": "dflash-train.service"},
                               "last_step": last_step, "checkpoints": folder,
                               "newest_checkpoint": {"path": path, "step": step} if path else None})


@pytest.mark.parametrize("name, step", [
    ("step_1200.ckpt", 1200), ("step_1200-final.ckpt", 1200), ("checkpoint-1200", 1200), ("ckpt1200.pt", 1200),
    ("epoch_2_step_1200", 1200), ("model_1200.pt", 1200), ("latest", None), ("Step-7", 7)])
def test_a_checkpoints_step_comes_from_its_name(name, step):
    assert checkpoint_step(name) == step


def test_the_newest_checkpoint_is_the_last_written_not_one_being_written(tmp_path):
    (tmp_path / "step_10.ckpt").write_text("a")
    time.sleep(0.01)
    (tmp_path / "step_20.ckpt").write_text("b")
    time.sleep(0.01)
    (tmp_path / ".step_30.ckpt.tmp").write_text("c")
    (tmp_path / "step_30.ckpt.tmp").write_text("c")
    newest = newest_checkpoint(str(tmp_path))
    assert newest["path"].endswith("step_20.ckpt") and newest["step"] == 20
    assert newest_checkpoint(str(tmp_path / "missing")) is None and newest_checkpoint(None) is None


@pytest.mark.parametrize("job, lost, words", [
    (training(), 25, "newest checkpoint step 1180 (/ck/step_1180.ckpt): a kill now loses 25 step(s)"),
    (training(path=None), 1205, "no checkpoint yet in /ck: a kill now loses all 1205 steps"),
    (training(step=None, path="/ck/latest"), None, "newest checkpoint /ck/latest has no step in its name"),
    (training(folder=None, path=None), None, "no checkpoints dir in the inventory"),
    (training(last_step=None), None, "its log shows no `step N`"),
])
def test_what_a_kill_loses(job, lost, words):
    assert job.lost_steps == lost and job.cost().startswith(words)
    assert job.over(None) is False and job.over(10**9) is (lost is None)


def test_the_plan_shows_the_cost_the_request_and_the_limit():
    stop = TrainingStop(checkpoint_signal="SIGUSR1", checkpoint_wait_s=60, max_lost_steps=0)
    op, = plan_training(training(), True, "ct200", stop)
    assert op.what.splitlines() == [
        "stop training pid 9 (dflash-train.service) at step 1205",
        "  newest checkpoint step 1180 (/ck/step_1180.ckpt): a kill now loses 25 step(s); this run allows 0",
        "  first SIGUSR1, then up to 60s for a newer checkpoint; still over 0 lost then: refused before SIGTERM"]
    assert op.requires is None  # with a request, whether it is over is only known after trying it
    assert op.data["limit"] == 0 and op.figures["lost_steps"] == 25 and op.figures["checkpoint_request"] == "SIGUSR1"


def test_without_a_request_a_real_run_over_the_limit_needs_the_flag():
    stop = TrainingStop(max_lost_steps=10)
    op, = plan_training(training(), True, "ct200", stop)
    assert op.requires == "a real run would lose 25 step(s) on ct200, so it needs --accept-lost-steps"
    op, = plan_training(training(), True, "ct200", stop, accepted=25)
    assert op.requires is None and op.data["limit"] == 25
    op, = plan_training(training(), True, "ct200", stop, accepted=math.inf)
    assert op.requires is None and op.data["limit"] is None


def test_preflight_refuses_a_kill_over_the_limit_only_when_nothing_can_lower_it(tmp_path):
    profile = load_profile(REPO / "playbooks" / "lab-ddtree16.yaml", repo_root=REPO)
    from dataclasses import replace
    limited = replace(profile, training_stop=TrainingStop(max_lost_steps=10))
    problem, = check_kill_cost(limited, training(), None)
    assert problem.startswith("stopping training on ct200 costs more than the 10 lost step(s) this run allows")
    assert "at step 1205, newest checkpoint step 1180" in problem and "pass --accept-lost-steps 25" in problem
    assert check_kill_cost(limited, training(), 25) == [] and check_kill_cost(limited, training(), math.inf) == []
    assert check_kill_cost(limited, training(), 24) != []  # the flag is a number of steps, not a yes
    assert "--accept-lost-steps all" in check_kill_cost(limited, training(last_step=None), None)[0]
    asking = replace(profile, training_stop=TrainingStop(checkpoint_signal="SIGUSR1", max_lost_steps=10))
    assert check_kill_cost(asking, training(), None) == []
    assert check_kill_cost(replace(profile, training_stop=TrainingStop()), training(), None) == []


def write_profile(tmp_path, training_yaml: str) -> Path:
    doc = yaml.safe_load((REPO / "playbooks" / "lab-ddtree16.yaml").read_text())
    doc["training"] = yaml.safe_load(training_yaml)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_profile_training_fields(tmp_path):
    p = load_profile(write_profile(tmp_path, "checkpoint_signal: usr1\ncheckpoint_wait_s: 5\nmax_lost_steps: 3\n"),
                     repo_root=REPO)
    assert p.training_stop == TrainingStop(checkpoint_signal="SIGUSR1", checkpoint_wait_s=5.0, max_lost_steps=3)
    p = load_profile(write_profile(tmp_path, "checkpoint_command: [touch, /root/train/SAVE]\n"), repo_root=REPO)
    assert p.training_stop.request == "touch /root/train/SAVE"


@pytest.mark.parametrize("body, message", [
    ("checkpoint_signal: SIGTERM\n", "must be one of SIGUSR1, SIGUSR2, SIGHUP"),
    ("checkpoint_signal: SIGUSR1\ncheckpoint_command: [x]\n", "both a checkpoint_signal and a checkpoint_command"),
    ("max_lost_steps: -1\n", "must be at least 0"),
    ("max_lost_step: 5\n", "unknown key `training.max_lost_step`"),
])
def test_profile_training_fields_refused(tmp_path, body, message):
    with pytest.raises(ConfigError, match=message):
        load_profile(write_profile(tmp_path, body), repo_root=REPO)


# -- the stop_training action on real processes ----------------------------------------------------

JOB = """
import os, signal, sys, time  # MARKER
log, ckpts, answers = sys.argv[1], sys.argv[2], sys.argv[3] == "answers"
step = [25]
def checkpoint(signum, frame):
    if answers:
        open(os.path.join(ckpts, "step_%d.ckpt" % step[0]), "w").close()
signal.signal(signal.SIGUSR1, checkpoint if answers else signal.SIG_IGN)
open(log, "a").write("step 25 loss 1.0\\n")
while True:
    time.sleep(0.05)
"""


def marker(tmp_path) -> str:
    """What the stop finds its job's process by: the test's own (tests on other pytest-xdist workers run
    jobs of their own at the same time, and a shared marker stopped the other's in one run)."""
    return "fake_ckpt_job_" + hashlib.sha1(str(tmp_path).encode()).hexdigest()[:12]


def start_job(tmp_path, answers: bool) -> subprocess.Popen:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step_20.ckpt").write_text("")
    job = subprocess.Popen([sys.executable, "-c", JOB.replace("MARKER", marker(tmp_path)), str(tmp_path / "train.log"),
                            str(tmp_path / "ckpt"), "answers" if answers else "ignores"])
    deadline = time.time() + 10
    while not (tmp_path / "train.log").exists() and time.time() < deadline:
        time.sleep(0.05)
    return job


def stop(tmp_path, **spec) -> tuple[dict, list[str]]:
    args = {"pattern": marker(tmp_path), "unit": None, "log": str(tmp_path / "train.log"),
            "checkpoints": str(tmp_path / "ckpt"), "grace_s": 5, "checkpoint_signal": "SIGUSR1",
            "checkpoint_command": [], "checkpoint_wait_s": 3, **spec}
    done = subprocess.run([sys.executable, "-c", probe_source("stop_training"), json.dumps(args)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    return json.loads(lines[-1]), [line for line in lines[:-1]]


def test_a_job_that_answers_the_checkpoint_signal_loses_nothing(tmp_path):
    job = start_job(tmp_path, answers=True)
    try:
        out, _ = stop(tmp_path, limit=0)
        assert out["request"]["sent"] == "SIGUSR1" and out["request"]["new_checkpoint"]
        assert out["lost_at_kill"] == 0 and out["stopped"] and out["checkpoint"]["step"] == 25
        assert job.wait(timeout=10) == -signal.SIGTERM
    finally:
        job.kill()


def test_a_job_that_ignores_it_is_left_running_refused_when_over_the_limit(tmp_path):
    job = start_job(tmp_path, answers=False)
    try:
        out, progress = stop(tmp_path, limit=4, checkpoint_wait_s=2.5)
        assert out["refused"] and out["lost_at_kill"] == 5 and not out["request"]["new_checkpoint"]
        assert out["signal"] is None and job.poll() is None  # never sent SIGTERM; still running
        assert progress and progress[0].startswith("ddops-progress: SIGUSR1 sent; 2s/2s for a checkpoint newer than")
        assert refusal(out, "ct200").startswith("stopping training on ct200 would lose 5 step(s) (step 25, newest "
                                                "checkpoint step 20), more than the 4 this run allows; SIGUSR1 got "
                                                "no newer checkpoint within")
        out, _ = stop(tmp_path, limit=5, checkpoint_wait_s=1)
        assert not out.get("refused") and out["stopped"] and out["lost_at_kill"] == 5
        assert out["step_after"] - out["checkpoint"]["step"] == 5  # what the kill lost is what it said
    finally:
        job.kill()

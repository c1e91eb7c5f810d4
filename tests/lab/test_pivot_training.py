"""The training stop that shows its cost, on the real lab: ct200's trainer held at step 25 with its
newest checkpoint at step 20 (so every figure holds still while it is read). A trainer that ignores the
checkpoint signal: the plan says a kill loses 5 steps, the pivot refuses without --accept-lost-steps
(training untouched; the history says refused, not failed), and with it the kill loses exactly the 5 the
plan said. A trainer that answers
the signal: it checkpoints at step 25 first, and the kill loses nothing."""

from __future__ import annotations

import json
import time

import pytest
import yaml
from test_pivot import PROFILE, ct200, ddops, pivot, step

pytestmark = [pytest.mark.lab, pytest.mark.slow]

TRAINER_ENV = "/etc/default/dflash-train"
LAB_DEFAULT_ENV = "# DFLASH_IGNORE_SIGTERM=1\n# DFLASH_STEP_SECONDS=0.5\n"   # what `lab up` writes
HELD = ("DFLASH_STEP_SECONDS=0.05\nDFLASH_CKPT_EVERY=10\nDFLASH_STALL_AT_STEP=25\n"
        "DFLASH_FINAL_CHECKPOINT=0\n")   # checkpoints at steps 10 and 20, held at 25, nothing saved on SIGTERM
RESET = ("systemctl disable --now ddtree.service; rm -f /etc/systemd/system/ddtree.service "
         "/etc/ddops/ddtree.env /var/lib/ddops/pivot.lock; systemctl daemon-reload; systemctl reset-failed")
# What a refused pivot must leave as it was (the history, outside these, gains a line saying refused).
FILES = r"""
for p in /etc/systemd/system /etc/ddops /var/lib/ddops/backups /root/models /opt/ddtree/venv/ddtree-release.json /root/train/checkpoints; do
  [ -e "$p" ] && find "$p" -type f -o -type l | sort | xargs -r sha256sum
done
for u in ddtree.service dflash-train.service; do systemctl show "$u" -p ActiveState -p MainPID -p UnitFileState; done
"""


def hold_trainer(lab, extra: str = "") -> None:
    """Restart training from nothing with HELD (+ extra) and wait until it stands at step 25."""
    lab.ssh("ct200", ["bash", "-c", f'cat > {TRAINER_ENV}'], input=HELD + extra, check=True)
    ct200(lab, f"{RESET}; systemctl stop dflash-train.service; rm -rf /root/train/checkpoints/*; "
               ": > /root/train/train.log; systemctl reset-failed; systemctl start dflash-train.service")
    deadline = time.monotonic() + 60
    while "step 25 loss" not in ct200(lab, "tail -n 3 /root/train/train.log"):
        assert time.monotonic() < deadline, ct200(lab, "tail -n 20 /root/train/train.log")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def training_lab(lab):
    from ddops.demo import ensure_tiny_models, seed_drafter
    from ddops.executor import Executor
    from ddops.inventory import load_inventory

    ensure_tiny_models(lambda m: None)
    inventory = load_inventory(lab.inventory_path)
    with Executor(inventory) as ex:
        seed_drafter(inventory, ex, lambda m: None)
    yield lab
    lab.ssh("ct200", ["bash", "-c", f'cat > {TRAINER_ENV}'], input=LAB_DEFAULT_ENV)
    ct200(lab, f"{RESET}; systemctl restart dflash-train.service")


def strict(tmp_path) -> str:
    doc = yaml.safe_load(PROFILE.read_text())
    doc["training"].update(checkpoint_signal="SIGUSR1", checkpoint_wait_s=3, max_lost_steps=0)
    path = tmp_path / "strict.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_a_trainer_that_ignores_the_request_loses_what_the_plan_said(training_lab, tmp_path):
    lab, profile = training_lab, strict(tmp_path)
    hold_trainer(lab, "DFLASH_IGNORE_CHECKPOINT_SIGNAL=1\n")
    dry = ddops(lab, "pivot", "--kill-training", "--deploy", profile, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr[-2000:]
    planned, = step(json.loads(dry.stdout), "training")["figures"]
    assert (planned["step"], planned["checkpoint_step"], planned["lost_steps"]) == (25, 20, 5), planned

    before = ct200(lab, FILES)
    done, report = pivot(lab, profile=profile)   # --kill-training --yes, no --accept-lost-steps
    assert done.returncode == 2 and report["outcome"] == "refused" and report["changed"] == [], report
    assert report["error"].startswith("stopping training on ct200 would lose 5 step(s) (step 25, newest checkpoint "
                                      "step 20), more than the 0 this run allows; SIGUSR1 got no newer checkpoint")
    assert "--accept-lost-steps 5" in report["error"] and "\n" not in report["error"]
    assert ct200(lab, FILES) == before   # training still running, same pid; no file touched
    assert "ignoring it (--ignore-checkpoint-signal)" in ct200(lab, "tail -n 5 /root/train/train.log")
    recorded = json.loads(ddops(lab, "history", "--host", "ct200", "--json").stdout)[-1]
    assert (recorded["kind"], recorded["outcome"], recorded["error"]) == ("pivot", "refused", report["error"])

    done, report = pivot(lab, "--accept-lost-steps", "5", profile=profile)
    assert done.returncode == 0 and report["outcome"] == "ok", report
    stopped = report["training"]
    assert stopped["lost_at_kill"] == stopped["steps_lost"] == planned["lost_steps"] == 5
    assert stopped["request"]["sent"] == "SIGUSR1" and not stopped["request"]["new_checkpoint"]
    assert stopped["checkpoint"]["path"].endswith("/step_20.ckpt")


def test_a_trainer_that_answers_the_request_loses_nothing(training_lab, tmp_path):
    lab = training_lab
    hold_trainer(lab)
    done, report = pivot(lab, profile=strict(tmp_path))
    assert done.returncode == 0 and report["outcome"] == "ok", report
    planned, = step(report, "training")["figures"]
    assert planned["lost_steps"] == 5   # what a kill would have cost without the request
    stopped = report["training"]
    assert stopped["request"]["new_checkpoint"] and stopped["lost_at_kill"] == stopped["steps_lost"] == 0
    assert stopped["checkpoint"]["path"].endswith("/step_25.ckpt") and stopped["graceful"]

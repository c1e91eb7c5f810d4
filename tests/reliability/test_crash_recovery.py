"""Recovery on the real lab (issue 36): after a crash, a full disk or a second operator, ct200 ends in
the state from before the pivot (its units, its runtime release, training running), or the pivot is
refused in one line. And the kill matrix: ddops killed with SIGKILL at each step boundary of a pivot,
and inside sync and pip; then `ddops rollback` brings back the state from before it.

Every case starts from `fresh`: ct200 training, no ddtree.service, the runtime's release record naming
an older release (so the pivot ships, and a rollback must reinstall it), no lock, no journal.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from faultlab import PROFILE, Background, ddops, pivot, sh, variant, wait_for

from ddops.hostlock import LEASE_S, process_start

pytestmark = [pytest.mark.lab, pytest.mark.slow]

STATE = "/var/lib/ddops"
RELEASE = "/opt/ddtree/venv/ddtree-release.json"
OLD = "0.0.0+old"
RESET = (f"systemctl disable --now ddtree.service; rm -f /etc/systemd/system/ddtree.service /etc/ddops/ddtree.env "
         f"{STATE}/pivot.lock {STATE}/pivot.journal.json /usr/local/bin/rsync /usr/local/bin/systemctl; systemctl daemon-reload; "
         "systemctl reset-failed; systemctl start dflash-train.service")


def older_release(wheel: str) -> str:
    """The release in place made an older one, whose wheel is kept as ddops keeps what it shipped: a copy
    of `wheel` (the one this module's first pivot shipped), checked whole, as a rollback reinstalls it."""
    name = wheel.rsplit("/", 1)[1]
    folder = f"/var/cache/ddops/releases/{OLD}"
    record = json.dumps({"release": OLD, "wheel": name, "installed_at": 0})
    return (f"mkdir -p {folder} && cp -f {wheel} {folder}/ && cmp {wheel} {folder}/{name} && "
            f"python3 -m zipfile -t {folder}/{name} >/dev/null && echo '{record}' > {RELEASE}")


# What "the state from before the pivot" is: the unit and env files, the release record, what runs.
SNAPSHOT = (f"for f in /etc/systemd/system/ddtree.service /etc/ddops/ddtree.env {RELEASE}; do "
            "if [ -e $f ]; then echo $f=$(sha256sum < $f | cut -c1-16); else echo $f=absent; fi; done; "
            "echo ddtree=$(systemctl is-active ddtree.service); echo training=$(systemctl is-active dflash-train.service); "
            f"echo lock=$(ls {STATE}/pivot.lock 2>/dev/null); echo journal=$(ls {STATE}/pivot.journal.json 2>/dev/null)")
SLOW_RSYNC = "#!/bin/sh\nsleep 3\nexec /usr/bin/rsync \"$@\"\n"
# the unit step's daemon-reload made 2 s long: its window (0.1 s) is shorter than one look at the journal
SLOW_RELOAD = "#!/bin/sh\n[ \"$1\" = daemon-reload ] && sleep 2\nexec /usr/bin/systemctl \"$@\"\n"
MATRIX: dict[str, dict] = {}


def snapshot(lab) -> dict[str, str]:
    return dict(line.split("=", 1) for line in sh(lab, "ct200", SNAPSHOT).splitlines() if "=" in line)


def journal(lab) -> dict | None:
    text = sh(lab, "ct200", f"cat {STATE}/pivot.journal.json 2>/dev/null").strip()
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None   # read while being replaced


def settle(lab) -> None:
    """What a killed run left running on ct200 (a pip, an action) finishes, as it would before anyone
    looked; nothing of ddops runs there afterwards."""
    assert wait_for(lambda: not sh(lab, "ct200", "pgrep -f '[p]ip install|[d]dops-action|[d]dops-probe|[r]sync' || true").strip(),
                    120, 0.5)


@pytest.fixture(scope="module")
def fresh(lab, tmp_path_factory):
    """A profile whose pivot ships, installs the unit and stops training on ct200; ct200 reset before each."""
    from ddops.demo import ensure_tiny_models, seed_drafter
    from ddops.executor import Executor
    from ddops.inventory import load_inventory

    ensure_tiny_models(lambda m: None)
    inventory = load_inventory(lab.inventory_path)
    with Executor(inventory) as ex:
        seed_drafter(inventory, ex, lambda m: None)
    folder = tmp_path_factory.mktemp("recovery")
    profile = variant(folder, "recovery", {"training.grace_s": 5, "training.checkpoint_wait_s": 5,
                                           "health.deadline_s": 120}, base=PROFILE)
    sh(lab, "ct200", RESET)
    done, report = pivot(lab, profile)   # the wheel, the models and the packages in place once
    assert done.returncode == 0, report
    shipped = json.loads(sh(lab, "ct200", f"cat {RELEASE}"))
    wheel = f"/var/cache/ddops/releases/{shipped['release']}/{shipped['wheel']}"

    def reset() -> dict[str, str]:
        sh(lab, "ct200", RESET)
        made = lab.ssh("ct200", older_release(wheel))
        assert made.returncode == 0, f"the older release could not be put in place: {made.stderr}" + sh(
            lab, "ct200", "df -h /var/cache/ddops")
        assert wait_for(lambda: "active" == sh(lab, "ct200", "systemctl is-active dflash-train.service").strip(), 30)
        state = snapshot(lab)
        assert state["ddtree"] != "active" and state["training"] == "active" and not state["lock"], state
        return state

    yield {"profile": profile, "folder": folder, "reset": reset}
    sh(lab, "ct200", RESET)
    target = os.environ.get("DDOPS_RECOVERY_FIGURES")
    if target and MATRIX:
        with open(target, "w") as fh:
            json.dump(MATRIX, fh, indent=1, sort_keys=True)


def rollback(lab, *extra) -> tuple[int, str]:
    done = ddops(lab, "rollback", "--host", "ct200", *extra)
    return done.returncode, done.stdout + done.stderr


def kill_when(lab, run: Background, ready) -> str:
    """SIGKILL the pivot once `ready(journal)` holds; returns the step its journal names then."""
    seen: dict = {}

    def check() -> bool:
        found = journal(lab)
        if found is not None and ready(found):
            seen.update(found)
            return True
        assert run.proc.poll() is None, f"the pivot ended first:\n{run.err.read_text()[-2000:]}"
        return False

    assert wait_for(check, 300, 0.05), "never reached"
    run.kill()
    return seen.get("step") or "open"


# -- defects 2 and 3 --------------------------------------------------------------------------------

def test_a_pivot_killed_after_it_stopped_training_is_shown_refused_and_rolled_back(lab, fresh, tmp_path):
    before = fresh["reset"]()
    run = Background(lab, fresh["profile"], folder=tmp_path)
    try:
        kill_when(lab, run, lambda j: j.get("step") not in (None, "training"))   # training stopped: sync next
    finally:
        run.kill()
    settle(lab)
    assert snapshot(lab)["training"] != "active"
    status = ddops(lab, "--limit", "ct200", "status")
    assert status.returncode == 2 and "UNFINISHED PIVOT on ct200" in status.stdout, status.stdout
    history = ddops(lab, "history", "--host", "ct200", "--json")
    assert json.loads(history.stdout)[-1]["outcome"] == "unfinished"
    # the re-run that once saw only the wreckage (training already stopped) is refused, with the way out
    done, report = pivot(lab, fresh["profile"], "--break-lock")
    assert done.returncode == 2 and "ct200 has an unfinished pivot" in report["error"], report
    assert "ddops rollback --host ct200" in report["error"]
    code, out = rollback(lab, "--break-lock")
    assert code == 0 and "ROLLED BACK: the unfinished pivot" in out and "dflash-train.service" in out, out
    assert snapshot(lab) == before
    # a second rollback in a row has nothing to do, and claims nothing
    code, out = rollback(lab)
    assert code == 0 and "UNCHANGED" in out and "running again" not in out, out
    assert snapshot(lab) == before


def test_a_full_backups_disk_is_refused_at_preflight_with_training_running(lab, fresh):
    before = fresh["reset"]()
    backups = f"{STATE}/backups"
    sh(lab, "ct200", f"mkdir -p {backups} && mount -t tmpfs -o size=64k tmpfs {backups} && "
                     f"(dd if=/dev/zero of={backups}/fill bs=4k 2>/dev/null; true)")
    try:
        done, report = pivot(lab, fresh["profile"])
    finally:
        sh(lab, "ct200", f"umount {backups}")
    assert done.returncode == 2 and report["outcome"] == "failed" and report["failed_step"] == "preflight", report
    assert (f"not enough disk on ct200:{backups}: need 64 MiB (backups 64 MiB in {backups}), free 0 B"
            in report["error"]), report["error"]
    assert report["changed"] == [] and snapshot(lab) == before   # training still running, nothing written


def test_a_backup_that_cannot_be_written_stops_the_pivot_before_training_stops(lab, fresh):
    """Room by bytes, which preflight counts, but no inode left: the backup the unit step takes before the
    pivot's first change fails, and the pivot stops there, with training running and no backup left."""
    before = fresh["reset"]()
    backups = f"{STATE}/backups"
    sh(lab, "ct200", f"mkdir -p {backups} && mount -t tmpfs -o size=128m,nr_inodes=1 tmpfs {backups}")
    try:
        done, report = pivot(lab, fresh["profile"])
    finally:
        sh(lab, "ct200", f"umount {backups}")
    assert done.returncode == 2 and report["outcome"] == "failed", report
    assert report["failed_step"] == "unit" and "No space left on device" in report["error"], report["error"]
    assert report["state"].startswith("nothing was changed on ct200"), report["state"]
    assert report["steps"][1]["name"] == "training" and report["steps"][1]["status"] == "skipped"
    assert snapshot(lab) == before


# -- defects 4 and 5: locks that mean it --------------------------------------------------------------

def hold_lock(lab, pid: int, control_host: str | None = None) -> None:
    """A lock held by `pid` on this control machine (or by a run on another, with a fresh lease)."""
    holder = {"user": "ana", "control_host": control_host or socket.gethostname(), "pid": pid,
              "pid_start": process_start(pid), "command": "ddops pivot --deploy other", "token": "t-test",
              "lease_s": LEASE_S, "renewed_at": time.time(), "started_at": "now"}
    lab.ssh("ct200", ["bash", "-c", f"cat > {STATE}/pivot.lock"], input=json.dumps(holder), check=True)


def test_break_lock_refuses_a_live_holder_and_rollback_takes_the_lock(lab, fresh):
    before = fresh["reset"]()
    hold_lock(lab, os.getpid())                      # this test process: alive
    done, report = pivot(lab, fresh["profile"], "--break-lock")
    assert done.returncode == 2 and "is locked by a live ddops run: ana@" in (report.get("error") or ""), report
    code, out = rollback(lab)
    assert code == 2 and "locked by another ddops run: ana@" in out, out
    hold_lock(lab, 1, control_host="far-away-laptop")   # another control machine, its lease fresh
    code, out = rollback(lab, "--break-lock")
    assert code == 2 and "lease renewed" in out, out
    assert snapshot(lab)["lock"] and {k: v for k, v in snapshot(lab).items() if k != "lock"} == {
        k: v for k, v in before.items() if k != "lock"}
    sh(lab, "ct200", f"rm -f {STATE}/pivot.lock")


def test_a_run_whose_lock_is_broken_stops_before_its_next_change(lab, fresh, tmp_path):
    before = fresh["reset"]()
    run = Background(lab, fresh["profile"], folder=tmp_path)
    try:
        assert wait_for(lambda: (journal(lab) or {}).get("step") == "training", 120, 0.05)
        hold_lock(lab, 1, control_host="far-away-laptop")      # another run took it (a wrong --break-lock)
        code, report = run.wait(timeout=300)
    finally:
        run.kill()
    assert code == 2 and "was broken (now held by ana@far-away-laptop" in report["error"], report
    assert report["outcome"] == "lock-lost" and report["state"].startswith("LOCK LOST on ct200"), report
    assert report.get("rolled_back") is None and journal(lab) is not None   # it touched nothing more
    sh(lab, "ct200", f"rm -f {STATE}/pivot.lock")
    settle(lab)
    code, out = rollback(lab)
    assert code == 0, out
    assert snapshot(lab) == before


# -- defects 6 and 7: backups checked before use -------------------------------------------------------

def test_damaged_backups_are_listed_refused_by_name_and_a_restore_keeps_what_it_replaces(lab, fresh):
    before = fresh["reset"]()
    done, report = pivot(lab, fresh["profile"])
    assert done.returncode == 0, report
    backup = report["backup_id"]
    folder = f"{STATE}/backups/ddtree.service/{backup}"
    sh(lab, "ct200", f"cp {folder}/meta.json /tmp/meta.json && head -c 40 /tmp/meta.json > {folder}/meta.json")
    listed = {b["id"]: b for b in json.loads(ddops(lab, "rollback", "--host", "ct200", "--list", "--json").stdout)}
    assert listed[backup]["damaged"].startswith("meta.json does not parse"), listed
    code, out = rollback(lab)
    assert code == 2 and f"backup {backup} of ddtree.service on ct200 is damaged" in out, out
    code, out = rollback(lab, "--to", backup)
    assert code == 2 and "meta.json does not parse" in out, out
    # tampered: the unit copy edited, its checksum left as recorded
    sh(lab, "ct200", f"cp /tmp/meta.json {folder}/meta.json; mkdir -p /tmp/unit-copy; "
                     f"if [ -e {folder}/unit ]; then cp {folder}/unit /tmp/unit-copy/; "
                     f"sed -i 's|^ExecStart=.*|ExecStart=/bin/false|' {folder}/unit; else echo x > {folder}/unit; "
                     f"python3 -c \"import json;p='{folder}/meta.json';m=json.load(open(p));m['unit_existed']=True;"
                     f"json.dump(m,open(p,'w'))\"; fi")
    code, out = rollback(lab, "--to", backup)
    assert code == 2 and "does not match the checksum" in out, out
    assert snapshot(lab)["ddtree"] == "active"         # the working unit untouched
    sh(lab, "ct200", f"cp /tmp/meta.json {folder}/meta.json; rm -f {folder}/unit; "
                     f"[ -e /tmp/unit-copy/unit ] && cp /tmp/unit-copy/unit {folder}/; rm -rf /tmp/unit-copy")
    code, out = rollback(lab)
    assert code == 0 and "what it replaced is kept as backup" in out, out
    assert snapshot(lab) == before
    listed = json.loads(ddops(lab, "rollback", "--host", "ct200", "--list", "--json").stdout)
    assert listed[-1]["meta"]["reason"] == "rollback" and listed[-1]["meta"]["replaced_by"] == backup, listed


# -- the kill matrix ---------------------------------------------------------------------------------

def pip_running(lab) -> bool:
    return bool(sh(lab, "ct200", "pgrep -f '[p]ip install' || true").strip())


# (name, when to kill: a predicate on the journal, and on ct200)
BOUNDARIES = {
    # the way back written, the first step about to start (the window is one round trip: the journal
    # names where the kill landed)
    "before the first change": lambda lab, j: bool(j.get("undo")),
    "training": lambda lab, j: j.get("step") == "training",
    "sync": lambda lab, j: j.get("step") == "sync",
    "inside sync": lambda lab, j: j.get("step") == "sync" and bool(sh(lab, "ct200", "pgrep -x sleep || true").strip()),
    "ship": lambda lab, j: j.get("step") == "ship",
    "inside pip": lambda lab, j: j.get("step") == "ship" and pip_running(lab),
    "unit": lambda lab, j: j.get("step") == "unit",
    "start": lambda lab, j: j.get("step") == "start",
    "health": lambda lab, j: j.get("step") == "health",
    "smoke": lambda lab, j: j.get("step") == "smoke",
}
SUITE = os.environ.get("DDOPS_KILL_MATRIX", "inside sync,inside pip,unit,health").split(",")


@pytest.mark.parametrize("boundary", [b for b in BOUNDARIES if b in SUITE or SUITE == ["all"]])
def test_kill_matrix(lab, fresh, tmp_path, boundary):
    before = fresh["reset"]()
    if boundary in ("sync", "inside sync"):   # a sync to do, slow enough to be caught inside
        sh(lab, "ct200", "rm -rf /root/models/tiny-draft")
        lab.ssh("ct200", ["bash", "-c", "cat > /usr/local/bin/rsync && chmod +x /usr/local/bin/rsync"],
                input=SLOW_RSYNC, check=True)
    if boundary == "unit":   # a window the journal's reader cannot miss
        lab.ssh("ct200", ["bash", "-c", "cat > /usr/local/bin/systemctl && chmod +x /usr/local/bin/systemctl"],
                input=SLOW_RELOAD, check=True)
    run = Background(lab, fresh["profile"], folder=tmp_path)
    t0 = time.monotonic()
    try:
        at = kill_when(lab, run, lambda j: BOUNDARIES[boundary](lab, j))
    finally:
        run.kill()
        sh(lab, "ct200", "rm -f /usr/local/bin/rsync /usr/local/bin/systemctl")
    killed = snapshot(lab)
    settle(lab)
    code, out = rollback(lab, "--break-lock")
    after = snapshot(lab)
    MATRIX[boundary] = {"journal_step": at, "killed_state": killed, "rollback_exit": code,
                        "back_to_before": after == before, "seconds": round(time.monotonic() - t0, 1),
                        "rollback": out.strip().splitlines()[-1] if out.strip() else ""}
    assert code == 0, out
    assert after == before, (killed, after, before)

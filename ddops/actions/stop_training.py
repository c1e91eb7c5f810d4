"""ddops-action stop_training: stop the training job, after asking it for a checkpoint, and prove it is gone.

With a checkpoint request (a signal or a command), send it and wait, up to its bound, for a checkpoint
newer than the one there was. Then, at the point of no return, read what a kill loses (the log's last
step past the newest checkpoint's): more than the run's limit and the job is left running, `refused`.
Else SIGTERM (via its unit when it has one), wait up to the grace period for it to checkpoint and exit,
SIGKILL what is left; report last step, newest checkpoint and whether GPU memory was freed.
"""
import json
import os
import signal
import sys
import time
# run, say, matching_pids, last_step and newest_checkpoint come from hostlib.py, which probe_source() prepends.

POLL_S = 0.1


def find(pattern):
    return [pid for pid, _ in matching_pids(pattern)]


def unit_pids(unit):
    code, out, _ = run(["systemctl", "show", unit, "--property=MainPID,ActiveState"], timeout=30)
    props = dict(l.split("=", 1) for l in out.splitlines() if "=" in l)
    pid = int(props.get("MainPID") or 0)
    return ([pid] if pid else []), props.get("ActiveState")


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gpu_pids():
    code, out, _ = run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       timeout=30)
    if code != 0:
        return None
    pids = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if cells and cells[0].isdigit():
            pids.append(int(cells[0]))
    return pids


def is_newer(checkpoint, before):
    """Written after `before` (a trainer that rotates its checkpoints may delete `before` meanwhile)."""
    if checkpoint is None:
        return False
    return before is None or checkpoint["mtime"] > before["mtime"]


def request_checkpoint(spec, pids):
    """Send the checkpoint request; wait, saying so, until a newer checkpoint is there or the bound passes."""
    before = newest_checkpoint(spec.get("checkpoints"))
    wait_s = float(spec.get("checkpoint_wait_s") or 0)
    request = {"sent": None, "new_checkpoint": False, "waited_s": 0.0}
    if spec.get("checkpoint_signal"):
        number = getattr(signal, spec["checkpoint_signal"])
        for pid in pids:
            try:
                os.kill(pid, number)
            except OSError:
                pass
        request["sent"] = spec["checkpoint_signal"]
    else:
        code, out, err = run(spec["checkpoint_command"], timeout=min(wait_s, 300))
        request.update(sent=" ".join(spec["checkpoint_command"]), command_rc=code,
                       command_output=(err or out).strip()[-300:])
    started = time.time()
    said = 0.0
    while time.time() - started < wait_s:
        if is_newer(newest_checkpoint(spec.get("checkpoints")), before):
            request["new_checkpoint"] = True
            break
        if not any(alive(p) for p in pids):
            break   # the job ended meanwhile: nothing left to wait for
        waited = time.time() - started
        if waited - said >= 2:
            say("%s sent; %.0fs/%.0fs for a checkpoint newer than %s"
                % (request["sent"], waited, wait_s, (before or {}).get("path") or "none"))
            said = waited
        time.sleep(POLL_S)
    request["waited_s"] = round(time.time() - started, 2)
    return request


def lost_now(spec):
    """(last step, newest checkpoint, steps a kill now loses or None when unknown)."""
    step = last_step(spec.get("log"))
    checkpoint = newest_checkpoint(spec.get("checkpoints"))
    if step is None or not spec.get("checkpoints"):
        return step, checkpoint, None
    if checkpoint is None:
        return step, checkpoint, step
    if checkpoint["step"] is None:
        return step, checkpoint, None
    return step, checkpoint, max(0, step - checkpoint["step"])


def main():
    spec = json.loads(sys.argv[1])
    unit, pattern, grace = spec.get("unit"), spec.get("pattern"), float(spec.get("grace_s", 30))
    pids = find(pattern) if pattern else []
    unit_state = None
    if unit:
        main_pids, unit_state = unit_pids(unit)
        pids = sorted(set(pids) | set(main_pids))
    out = {"pids": pids, "unit": unit, "step_before": last_step(spec.get("log")), "signal": None,
           "killed": [], "graceful": True, "limit": spec.get("limit"), "request": None}
    if not pids:
        out.update(stopped=True, already_stopped=True, step_after=out["step_before"],
                   checkpoint=newest_checkpoint(spec.get("checkpoints")), gpu_freed=True, left=[])
        json.dump(out, sys.stdout)
        return
    if spec.get("checkpoint_signal") or spec.get("checkpoint_command"):
        out["request"] = request_checkpoint(spec, pids)
    step, checkpoint, lost = lost_now(spec)
    out.update(step_now=step, lost_at_kill=lost)
    limit = spec.get("limit")
    if limit is not None and (lost is None or lost > limit) and any(alive(p) for p in pids):
        out.update(refused=True, stopped=False, checkpoint=checkpoint, left=[p for p in pids if alive(p)])
        json.dump(out, sys.stdout)
        return
    started = time.time()
    out["signal"] = "SIGTERM"
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    while time.time() - started < grace and any(alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    if left:
        out["graceful"] = False
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                out["killed"].append(pid)
            except OSError:
                pass
        deadline = time.time() + 10
        while time.time() < deadline and any(alive(p) for p in left):
            time.sleep(0.1)
    out["stop_s"] = round(time.time() - started, 2)
    if unit:
        # The job is gone; make sure systemd will not bring it back, and forget a failed state.
        run(["systemctl", "stop", unit], timeout=60)
        run(["systemctl", "reset-failed", unit], timeout=30)
    remaining = find(pattern) if pattern else []
    if unit:
        main_pids, _ = unit_pids(unit)
        remaining = sorted(set(remaining) | set(main_pids))
    gp = gpu_pids()
    out.update(stopped=not remaining, left=remaining, already_stopped=False,
               step_after=last_step(spec.get("log")), checkpoint=newest_checkpoint(spec.get("checkpoints")),
               gpu_freed=None if gp is None else not (set(gp) & set(pids)), unit_was=unit_state)
    json.dump(out, sys.stdout)


main()

"""ddops-action stop_training: stop the training job gracefully and prove it is gone.

SIGTERM (via its unit when it has one), wait up to the grace period for it to checkpoint and exit,
then SIGKILL what is left; report last step, newest checkpoint and whether GPU memory was freed.
"""
import json
import os
import re
import signal
import sys
import time
# run, matching_pids and last_step come from hostlib.py, which probe_source() prepends to this script.


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


def newest_checkpoint(folder):
    try:
        entries = [os.path.join(folder, e) for e in os.listdir(folder) if not e.startswith(".")]
    except OSError:
        return None
    if not entries:
        return None
    path = max(entries, key=os.path.getmtime)
    m = re.search(r"(\d+)", os.path.basename(path))
    return {"path": path, "step": int(m.group(1)) if m else None, "mtime": os.path.getmtime(path)}


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


def main():
    spec = json.loads(sys.argv[1])
    unit, pattern, grace = spec.get("unit"), spec.get("pattern"), float(spec.get("grace_s", 30))
    pids = find(pattern) if pattern else []
    unit_state = None
    if unit:
        main_pids, unit_state = unit_pids(unit)
        pids = sorted(set(pids) | set(main_pids))
    out = {"pids": pids, "unit": unit, "step_before": last_step(spec.get("log")), "signal": None,
           "killed": [], "graceful": True}
    if not pids:
        out.update(stopped=True, already_stopped=True, step_after=out["step_before"],
                   checkpoint=newest_checkpoint(spec.get("checkpoints")), gpu_freed=True, left=[])
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

"""Lab GPU bookkeeping, shared by the imitation nvidia-smi and the fixtures.

A process "holds GPU memory" by writing /run/ddops-gpu/<pid>.json:
    {"gpus": [0, 1], "used_mib": 71234, "name": "/usr/bin/python3", "starttime": 123456}
`used_mib` is per GPU. An entry counts only while its pid is alive and, when `starttime`
is recorded, while that pid still has the same start time (so a recycled pid frees nothing
it never held). Installed on lab hosts as /usr/lib/python3/dist-packages/ddops_lab_gpu.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HOLD_DIR = Path(os.environ.get("DDOPS_GPU_HOLD_DIR", "/run/ddops-gpu"))
CONFIG = Path(os.environ.get("DDOPS_GPU_CONFIG", "/etc/ddops-lab/gpus.json"))


def proc_starttime(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks since boot), or None when the pid is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces
    if fields[0] == "Z":
        return None
    return int(fields[19])


def hold(gpus: list[int], used_mib: int, name: str | None = None, pid: int | None = None) -> Path:
    """Register `pid` (default: this process) as holding `used_mib` MiB on each GPU in `gpus`."""
    pid = pid or os.getpid()
    entry = {"gpus": list(gpus), "used_mib": int(used_mib), "name": name or sys.executable,
             "starttime": proc_starttime(pid)}
    HOLD_DIR.mkdir(parents=True, exist_ok=True)
    path = HOLD_DIR / f"{pid}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, path)
    return path


def release(pid: int | None = None) -> None:
    (HOLD_DIR / f"{pid or os.getpid()}.json").unlink(missing_ok=True)


def live_holds() -> list[dict]:
    """The entries whose process is still alive, each with its `pid` added."""
    holds = []
    for path in sorted(HOLD_DIR.glob("*.json")):
        try:
            pid = int(path.stem)
            entry = json.loads(path.read_text())
        except (ValueError, OSError):
            continue
        started = proc_starttime(pid)
        if started is None or entry.get("starttime") not in (None, started):
            continue
        entry["pid"] = pid
        holds.append(entry)
    return holds


def load_config() -> dict:
    return json.loads(CONFIG.read_text())

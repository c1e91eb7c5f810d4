"""Lab GPU bookkeeping, shared by the imitation nvidia-smi and the fixtures.

A process "holds GPU memory" by writing /run/ddops-gpu/<pid>.json:
    {"gpus": [0, 1], "used_mib": 71234, "name": "/usr/bin/python3", "starttime": 123456}
`used_mib` is per GPU. An entry counts only while its pid is alive and, when `starttime`
is recorded, while that pid still has the same start time (so a recycled pid frees nothing
it never held). Installed on lab hosts as /usr/lib/python3/dist-packages/ddops_lab_gpu.py.

A GPU's faults live in gpus.json under `faults` (by index: ecc_volatile, ecc_aggregate, remap_pending,
retired_pending, throttle), the driver under `driver_version` and `cuda_version`. The kernel log is
imitated too: systemd-nspawn gives a container no /dev/kmsg, so the lab makes it a plain file there
(tmpfiles.d) holding records in the kernel's own format, which `xid` appends to. A test (or you) sets
them on a running host:

    python3 -m ddops_lab_gpu set driver_version='"535.104.05"' cuda_version='"12.2"'
    python3 -m ddops_lab_gpu fault 0 ecc_volatile=2 remap_pending=true throttle='["HwSlowdown"]'
    python3 -m ddops_lab_gpu xid 0 79
    python3 -m ddops_lab_gpu clear
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HOLD_DIR = Path(os.environ.get("DDOPS_GPU_HOLD_DIR", "/run/ddops-gpu"))
CONFIG = Path(os.environ.get("DDOPS_GPU_CONFIG", "/etc/ddops-lab/gpus.json"))
KMSG = Path(os.environ.get("DDOPS_KMSG", "/dev/kmsg"))
DRIVER, CUDA = "570.133.20", "12.8"    # the driver the lab's GPUs report unless their spec says otherwise
# What the driver writes for an Xid, by code (NVIDIA's Xid catalogue); others get a generic line.
XID_TEXT = {79: "GPU has fallen off the bus.", 48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.",
            94: "Contained: SM (0x1). RST: No, D-RST: No", 95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
            13: "Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address"}


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


def save_config(cfg: dict) -> None:
    tmp = CONFIG.with_suffix(".tmp")
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    os.replace(tmp, CONFIG)


def gpu_faults(cfg: dict, index: int) -> dict:
    return (cfg.get("faults") or {}).get(str(index)) or {}


def set_fault(index: int, **faults) -> None:
    cfg = load_config()
    cfg.setdefault("faults", {}).setdefault(str(index), {}).update(faults)
    save_config(cfg)


def xid(index: int, code: int, text: str | None = None) -> str:
    """Append the driver's kernel message for Xid `code` on GPU `index` to the imitated kernel log."""
    domain, bus, device = load_config()["bus_ids"][index].split(".")[0].split(":")
    line = f"NVRM: Xid (PCI:{int(domain, 16):04x}:{bus.lower()}:{device.lower()}): {code}, pid=1234, name=python3, " \
           f"{text or XID_TEXT.get(code, 'Xid event.')}"
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    seq = len(KMSG.read_text().splitlines()) if KMSG.exists() else 0
    with KMSG.open("a") as fh:   # the kernel's record format: priority,sequence,microseconds,flags;message
        fh.write(f"3,{seq},{int(uptime * 1e6)},-;{line}\n")
    return line


def clear() -> None:
    """No faults, the default driver, an empty kernel log."""
    cfg = load_config()
    for key in ("faults", "driver_version", "cuda_version"):
        cfg.pop(key, None)
    cfg.update(driver_version=DRIVER, cuda_version=CUDA)
    save_config(cfg)
    if not KMSG.exists() or KMSG.is_file():   # lab up's empty log, made again if anything removed it
        KMSG.write_text("")
        KMSG.chmod(0o600)


def _values(pairs: list[str]) -> dict:
    return {k: json.loads(v) for k, v in (p.split("=", 1) for p in pairs)}


def main(argv: list[str]) -> int:
    """set KEY=JSON... | fault GPU KEY=JSON... | xid GPU CODE [TEXT] | clear"""
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "set":
        cfg = load_config()
        cfg.update(_values(rest))
        save_config(cfg)
    elif command == "fault":
        set_fault(int(rest[0]), **_values(rest[1:]))
    elif command == "xid":
        print(xid(int(rest[0]), int(rest[1]), " ".join(rest[2:]) or None))
    elif command == "clear":
        clear()
    else:
        print(main.__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

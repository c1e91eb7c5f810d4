"""A GPU's health from the facts probe (ddops/probes/gpuhealth.py): the faults that make it unfit to serve
(uncorrectable ECC errors since boot, rows waiting to be remapped or pages to be retired, a fatal Xid since
boot), the warnings that do not (throttling, memory held by a process nobody expects), and one short word
for status and top. Read by status, top (the `gpu` alarm) and preflight (which refuses a faulty GPU the
profile would use, unless --accept-gpu-faults).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

# Xid codes that mean the GPU itself failed (NVIDIA's Xid catalogue, docs.nvidia.com/deploy/xid-errors):
# the card must be drained and reset (or the host rebooted) before it serves again. Others (13, 31, 43, 45:
# an application's fault, a process killed) are shown, not held against the GPU.
FATAL_XIDS = {
    48: "double-bit ECC error",
    64: "row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
# clocks_throttle_reasons that make the status word `throttled`; a power cap under load is the card
# working as configured, so it is listed in the details only.
THROTTLING = ("HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown")


@dataclass(frozen=True)
class GpuHealth:
    index: int
    bus_id: str | None
    faults: tuple[str, ...] = ()      # what refuses a pivot onto it
    warnings: tuple[str, ...] = ()    # what the plan shows
    word: str = "ok"                  # status and top: ok, xid 79, ecc, remap, throttled, held by PID, unknown
    xids: tuple[dict[str, Any], ...] = ()
    processes: tuple[dict[str, Any], ...] | None = None   # what holds its memory (None: unknown)

    def as_json(self) -> dict[str, Any]:
        return {"index": self.index, "bus_id": self.bus_id, "word": self.word, "faults": list(self.faults),
                "warnings": list(self.warnings), "xids": list(self.xids),
                "processes": None if self.processes is None else list(self.processes)}


def known_holders(facts: dict[str, Any], units: Iterable[str] = ()) -> tuple[set[str], set[int]]:
    """The units and pids whose GPU memory is expected: the training job, the inventory's services and
    replicas, and `units` (a pivot's own unit and conflicts)."""
    training = facts.get("training") or {}
    names = set(units) | {s.get("unit") for s in facts.get("services") or []}
    names.add((training.get("unit") or {}).get("unit"))
    for deployment in facts.get("replicas") or []:
        names |= {r.get("unit") for r in deployment.get("replicas") or []}
    return {n for n in names if n}, set(training.get("pids") or ())


def assess(facts: dict[str, Any], units: Iterable[str] = ()) -> list[GpuHealth]:
    """Every listed GPU's health from one facts probe; `units`: more units whose memory is expected."""
    gpus = (facts.get("gpus") or {}).get("list") or []
    xid = (facts.get("gpus") or {}).get("xid") or {}
    events = xid.get("events")
    known_units, known_pids = known_holders(facts, units)
    out = []
    for g in gpus:
        index = g.get("index")
        mine = [e for e in events or () if e.get("bus") and e.get("bus") == g.get("bus")]
        faults = [f"Xid {e['xid']} ({FATAL_XIDS[e['xid']]}) at {e.get('at_s'):g} s since boot"
                  for e in mine if e.get("xid") in FATAL_XIDS]
        if g.get("ecc_volatile"):
            faults.append(f"{g['ecc_volatile']} uncorrectable ECC error(s) since boot")
        if g.get("remap_pending"):
            faults.append("rows waiting to be remapped (reset the GPU)")
        if g.get("retired_pending"):
            faults.append("pages waiting to be retired (reset the GPU)")
        warnings = [f"Xid {e['xid']} at {e.get('at_s'):g} s since boot ({e.get('text')})"
                    for e in mine if e.get("xid") not in FATAL_XIDS]
        if g.get("ecc_aggregate") and not g.get("ecc_volatile"):
            warnings.append(f"{g['ecc_aggregate']} uncorrectable ECC error(s) in its lifetime, none since boot")
        throttled = [r for r in g.get("throttle") or () if r in THROTTLING]
        if throttled:
            warnings.append(f"throttled ({', '.join(throttled)})")
        # a pid this host's /proc lacks is another namespace's (a container's host): not called a stranger
        strangers = [p for p in g.get("processes") or () if p.get("seen", True)
                     and p.get("unit") not in known_units and p.get("pid") not in known_pids]
        warnings += [f"memory held by pid {p['pid']} ({p.get('name')}, {p.get('used_mib')} MiB"
                     f"{', ' + p['unit'] if p.get('unit') else ''})" for p in strangers]
        out.append(GpuHealth(index=index, bus_id=g.get("bus_id"), faults=tuple(faults), warnings=tuple(warnings),
                             word=_word(g, mine, throttled, strangers, events is None), xids=tuple(mine),
                             processes=None if g.get("processes") is None else tuple(g["processes"])))
    return out


def stray_xids(facts: dict[str, Any]) -> list[str]:
    """Fatal Xids on a bus no listed GPU has: a GPU that fell off the bus may no longer be listed at all."""
    buses = {g.get("bus") for g in (facts.get("gpus") or {}).get("list") or []}
    events = ((facts.get("gpus") or {}).get("xid") or {}).get("events") or []
    return [f"Xid {e['xid']} ({FATAL_XIDS[e['xid']]}) on bus {e.get('bus')}, which no listed GPU has, at "
            f"{e.get('at_s'):g} s since boot" for e in events if e.get("xid") in FATAL_XIDS and e.get("bus") not in buses]


def _word(g: dict[str, Any], xids: list[dict], throttled: list[str], strangers: list[dict], blind: bool) -> str:
    fatal = [e["xid"] for e in xids if e.get("xid") in FATAL_XIDS]
    if fatal:
        return f"xid {fatal[-1]}"
    if g.get("ecc_volatile"):
        return "ecc"
    if g.get("remap_pending") or g.get("retired_pending"):
        return "remap"
    if throttled:
        return "throttled"
    if strangers:
        return f"held by {strangers[0]['pid']}"
    if blind and g.get("ecc_volatile") is None and g.get("throttle") is None:
        return "unknown"   # an old driver and no kernel log: nothing about its health could be read
    return "ok"


def driver(facts: dict[str, Any]) -> dict[str, Any]:
    """The driver's version and the CUDA version it supports (None where unknown)."""
    found = (facts.get("gpus") or {}).get("driver") or {}
    return {"version": found.get("version"), "cuda": found.get("cuda")}


def words(health: list[dict[str, Any]]) -> str:
    """All GPUs' words (GpuHealth.as_json's) in a few characters: `ok x8`, or `ok x7, GPU 3 xid 79`."""
    if not health:
        return "-"
    fine = [h for h in health if h["word"] == "ok"]
    rest = [f"GPU {h['index']} {h['word']}" for h in health if h["word"] != "ok"]
    return ", ".join(([f"ok x{len(fine)}"] if fine else []) + rest)


def style(health: list[dict[str, Any]]) -> str:
    """green: all ok; bold red: a fault; yellow: warnings only."""
    if any(h["faults"] for h in health):
        return "bold red"
    return "green" if all(h["word"] == "ok" for h in health) else "yellow"


def summary(facts: dict[str, Any]) -> dict[str, Any]:
    """What status and top's --json add per host: the driver, each GPU's health, the kernel log's source."""
    xid = (facts.get("gpus") or {}).get("xid") or {}
    return {"driver": driver(facts), "gpu_health": [h.as_json() for h in assess(facts)],
            "kernel_log": {"source": xid.get("source"), "error": xid.get("error"), "stray": stray_xids(facts)}}

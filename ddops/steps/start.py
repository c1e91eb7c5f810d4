"""Step 7, start: stop conflicting units, enable and (re)start the unit. Nothing restarts when
nothing changed and the unit is already active."""

from __future__ import annotations

import time

from .base import Change, PivotRun, check

RESTART_TRIGGERS = ("training", "sync", "deps", "ship", "unit")


def active(units: dict, name: str) -> bool:
    return units.get(name, {}).get("ActiveState") in ("active", "activating", "reloading")


def plan_start(profile, units: dict, planned: set[str]) -> list[Change]:
    changes = [Change(f"stop conflicting {c}", data={"stop": c}) for c in profile.conflicts if active(units, c)]
    state = units.get(profile.unit, {})
    if state.get("UnitFileState") != "enabled" or "unit" in planned:
        changes.append(Change(f"enable {profile.unit}", data={"enable": True}))
    triggers = planned & {"sync", "deps", "ship", "unit"}
    if triggers or not active(units, profile.unit):
        why = f"changed: {', '.join(sorted(triggers))}" if triggers else "not running"
        changes.append(Change(f"restart {profile.unit} ({why})", data={"restart": True}))
    return changes


def start_argvs(profile, changes: list[Change]) -> list[list[str]]:
    argvs = [["systemctl", "stop", c.data["stop"]] for c in changes if "stop" in c.data]
    if any(c.data.get("enable") for c in changes):
        argvs.append(["systemctl", "enable", profile.unit])
    if any(c.data.get("restart") for c in changes):
        argvs += [["systemctl", "reset-failed", profile.unit], ["systemctl", "restart", profile.unit]]
    return argvs


class StartStep:
    name = "start"
    title = "Start"

    def __init__(self) -> None:
        self.planned: set[str] = set()

    def plan(self, run: PivotRun) -> list[Change]:
        return plan_start(run.profile, run.inspect[run.profile.host].get("units", {}), self.planned)

    def apply(self, run: PivotRun, changes: list[Change]) -> str:
        for argv in start_argvs(run.profile, changes):
            result = run.executor.run(run.host, argv, timeout=120)
            if argv[1] == "reset-failed":
                continue  # fails harmlessly for a unit that never failed
            check(result, " ".join(argv))
            if argv[1] == "stop":
                run.stopped_units.append(argv[2])
            if argv[1] == "restart":
                run.changed["restarted"] = True
                run.gates["restarted_at"] = time.time()
        return "; ".join(c.what for c in changes)

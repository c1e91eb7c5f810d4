"""Start: stop conflicting units, enable and (re)start the unit. Nothing restarts when nothing changed
and the unit is already active."""

from __future__ import annotations

from ..facts import Inspection
from ..plan import Operation, PlanContext, RunContext, start_again
from ..profile import Profile
from ..remote import check

# Earlier steps whose changes the running unit only picks up when it restarts.
RESTART_AFTER = ("sync", "deps", "ship", "unit")


def plan_start(profile: Profile, units: Inspection, planned: set[str]) -> list[Operation]:
    operations = [Operation(f"stop conflicting {c}", data={"stop": c}, undo=start_again(c))
                  for c in profile.conflicts if units.unit(c).active]
    unit = units.unit(profile.unit)
    if unit.unit_file_state != "enabled" or "unit" in planned:
        operations.append(Operation(f"enable {profile.unit}", data={"enable": True}))
    triggers = planned & set(RESTART_AFTER)
    if triggers or not unit.active:
        why = f"changed: {', '.join(sorted(triggers))}" if triggers else "not running"
        operations.append(Operation(f"restart {profile.unit} ({why})", data={"restart": True}))
    return operations


def start_argvs(profile: Profile, operations: list[Operation]) -> list[list[str]]:
    argvs = [["systemctl", "stop", op.data["stop"]] for op in operations if "stop" in op.data]
    if any(op.data.get("enable") for op in operations):
        argvs.append(["systemctl", "enable", profile.unit])
    if any(op.data.get("restart") for op in operations):
        argvs += [["systemctl", "reset-failed", profile.unit], ["systemctl", "restart", profile.unit]]
    return argvs


class StartStep:
    name = "start"
    title = "Start"

    def plan(self, ctx: PlanContext) -> list[Operation]:
        planned = {name for name, operations in ctx.before.items() if operations}
        return plan_start(ctx.profile, ctx.facts.dest, planned)

    def apply(self, ctx: RunContext, operations: list[Operation]) -> str:
        for argv in start_argvs(ctx.profile, operations):
            result = ctx.executor.run(ctx.host, argv, timeout=120)
            if argv[1] == "reset-failed":
                continue  # fails harmlessly for a unit that never failed
            check(result, " ".join(argv))
            if argv[1] == "stop":
                ctx.journal.stopped_units.append(argv[2])
                ctx.journal.undo.append(start_again(argv[2]))
            if argv[1] == "restart":
                ctx.journal.change("restarted")
        return "; ".join(op.what for op in operations)

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
    unit = profile.unit
    operations = [Operation(f"stop conflicting {c}", commands=(("systemctl", "stop", c),), data={"stop": c},
                            undo=start_again(c))
                  for c in profile.conflicts if units.unit(c).active]
    state = units.unit(unit)
    if state.unit_file_state != "enabled" or "unit" in planned:
        operations.append(Operation(f"enable {unit}", commands=(("systemctl", "enable", unit),)))
    triggers = planned & set(RESTART_AFTER)
    if triggers or not state.active:
        why = f"changed: {', '.join(sorted(triggers))}" if triggers else "not running"
        # reset-failed first: a unit that crash-looped before would otherwise refuse to start
        operations.append(Operation(f"restart {unit} ({why})", data={"restart": True},
                                    commands=(("systemctl", "reset-failed", unit), ("systemctl", "restart", unit))))
    return operations


def start_argvs(operations: list[Operation]) -> list[list[str]]:
    return [list(argv) for op in operations for argv in op.commands]


class StartStep:
    name = "start"
    title = "Start"

    def plan(self, ctx: PlanContext) -> list[Operation]:
        planned = {name for name, operations in ctx.before.items() if operations}
        return plan_start(ctx.profile, ctx.facts.dest, planned)

    def apply(self, ctx: RunContext, operations: list[Operation]) -> str:
        for op in operations:
            for argv in op.commands:
                result = ctx.executor.run(ctx.host, list(argv), timeout=120)
                if argv[1] != "reset-failed":  # which fails harmlessly for a unit that never failed
                    check(result, " ".join(argv))
            if "stop" in op.data:
                ctx.journal.stopped_units.append(op.data["stop"])
                ctx.journal.undo.append(op.undo)
            if op.data.get("restart"):
                ctx.journal.change("restarted")
        return "; ".join(op.what for op in operations)

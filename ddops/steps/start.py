"""Start: stop conflicting units, enable and (re)start the unit. Nothing restarts when nothing changed
and the unit is already active. For replicas: start the ones not running and (re)start or reload the
balancer; replicas already serving are left to the rolling restart (steps.roll), one batch at a time."""

from __future__ import annotations

from ..facts import Inspection
from ..plan import RESTART_AFTER, Operation, PlanContext, RunContext
from ..profile import Profile
from ..remote import check
from ..undo import StartAgain


def plan_start(profile: Profile, units: Inspection, planned: set[str]) -> list[Operation]:
    unit = profile.unit
    operations = [Operation(f"stop conflicting {c}", commands=(("systemctl", "stop", c),), data={"stop": c},
                            undo=StartAgain(c))
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


def plan_start_replicas(profile: Profile, units: Inspection, planned: set[str], unit_writes: list[str]) -> list[Operation]:
    """Conflicts stopped; replicas enabled, the stopped ones started; HAProxy started, or reloaded when its
    config is rewritten (a reload keeps serving: the old worker finishes its connections)."""
    operations = [Operation(f"stop conflicting {c}", commands=(("systemctl", "stop", c),), data={"stop": c},
                            undo=StartAgain(c))
                  for c in profile.conflicts if units.unit(c).active]
    members = {r.unit for r in profile.replicas.members}
    for unit in [u for u in units.installed_replicas(profile.unit) if u not in members]:
        operations.append(Operation(f"stop and disable {unit} (no longer a replica)", data={"stop": unit},
                                    commands=(("systemctl", "disable", "--now", unit),), undo=StartAgain(unit)))
    for replica in profile.replicas.members:
        state = units.unit(replica.unit)
        if state.unit_file_state != "enabled":
            operations.append(Operation(f"enable {replica.unit}", commands=(("systemctl", "enable", replica.unit),)))
        if not state.active:
            gpus = f" on GPU {','.join(map(str, replica.gpus))}" if replica.gpus else ""
            operations.append(Operation(f"start {replica.unit} (port {replica.port}{gpus}; not running)",
                                        data={"restart": True},
                                        commands=(("systemctl", "reset-failed", replica.unit),
                                                  ("systemctl", "restart", replica.unit))))
    balancer = profile.balancer
    state = units.unit(balancer.unit)
    if state.unit_file_state != "enabled":
        operations.append(Operation(f"enable {balancer.unit}", commands=(("systemctl", "enable", balancer.unit),)))
    if not state.active:
        operations.append(Operation(f"start {balancer.unit} (port {profile.port}; not running)", data={"restart": True},
                                    commands=(("systemctl", "reset-failed", balancer.unit),
                                              ("systemctl", "restart", balancer.unit))))
    elif any(balancer.config in what for what in unit_writes):
        operations.append(Operation(f"reload {balancer.unit} ({balancer.config} changed)",
                                    commands=(("systemctl", "reload", balancer.unit),)))
    return operations


def start_argvs(operations: list[Operation]) -> list[list[str]]:
    return [list(argv) for op in operations for argv in op.commands]


class StartStep:
    name = "start"
    title = "Start"

    def plan(self, ctx: PlanContext) -> list[Operation]:
        planned = {name for name, operations in ctx.before.items() if operations}
        if ctx.profile.replicated:
            writes = [op.what for op in ctx.before.get("unit", [])]
            return plan_start_replicas(ctx.profile, ctx.facts.dest, planned, writes)
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

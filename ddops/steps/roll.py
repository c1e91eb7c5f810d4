"""Rolling restart: replicas already serving are replaced in batches (`--batch N`) when the pivot changed
what they run, so clients behind the balancer never see the service go away.

Each batch goes through the replica cycle (ddops.cycle): drain it in HAProxy (no new requests; wait,
bounded, for its sessions to reach 0), restart it, have the flow check it with the run's gates (health,
then smoke, on these replicas only), readmit it and wait until HAProxy sees it UP. The first failed
batch stops the run; the replicas not yet replaced still serve the old release, and the flow's rollback
returns the failed batch to it.
"""

from __future__ import annotations

import time

from .. import balancer
from ..cycle import Balanced, cycle
from ..errors import DdopsError, StepFailed
from ..facts import Inspection
from ..plan import RESTART_AFTER, Interrupted, Operation, PlanContext, RunContext
from ..profile import Profile
from ..undo import RollBackReplicas


def plan_roll(profile: Profile, units: Inspection, planned: set[str], batch: int) -> list[Operation]:
    """One operation per batch of replicas that are up and must restart to pick up a change."""
    triggers = planned & set(RESTART_AFTER)
    if not profile.replicated or not triggers:
        return []
    serving = [r for r in profile.replicas.members if units.unit(r.unit).active]
    batches = [serving[i:i + batch] for i in range(0, len(serving), batch)]
    why = ", ".join(sorted(triggers))
    return [Operation(f"batch {n}/{len(batches)}: {', '.join(r.unit for r in group)} — drain, restart "
                      f"(changed: {why}), health + smoke, readmit",
                      data={"replicas": [r.index for r in group]},
                      undo=RollBackReplicas(profile.unit, tuple(r.unit for r in group)))
            for n, group in enumerate(batches, 1)]


class RollStep:
    name = "roll"
    title = "Rolling restart"

    def plan(self, ctx: PlanContext) -> list[Operation]:
        planned = {name for name, operations in ctx.before.items() if operations}
        return plan_roll(ctx.profile, ctx.facts.dest, planned, ctx.batch)

    def apply(self, ctx: RunContext, operations: list[Operation]) -> str:
        members = {r.index: r for r in ctx.profile.replicas.members}
        for number, op in enumerate(operations, 1):
            ctx.check_interrupt()  # a safe point: between two batches
            self.replace(ctx, [members[i] for i in op.data["replicas"]], number, len(operations))
        slowest = max(b["total_s"] for b in ctx.journal.rolling)
        return f"{len(operations)} batch(es) replaced with no replica out of service at once; slowest {slowest}s"

    def replace(self, ctx: RunContext, batch: list, number: int, total: int) -> None:
        profile = ctx.profile
        units = [r.unit for r in batch]
        others = [r.unit for r in profile.replicas.members if r not in batch]
        record: dict = {"batch": number, "replicas": units, "ok": False}
        ctx.journal.rolling.append(record)
        started = time.monotonic()
        # Recorded before the restart: a batch that fails its gate is returned to the old release too.
        ctx.journal.change("replicas", undo=RollBackReplicas(profile.unit, tuple(units)))
        balanced = Balanced(balancer.as_spec(profile), profile.balancer.drain_timeout_s, profile.balancer.ready_timeout_s)
        try:
            cycle(ctx.executor, ctx.host, batch, balanced=balanced, gate=ctx.check_batch, record=record,
                  progress=ctx.progress, label=f"batch {number}/{total}: ",
                  restarted=lambda: ctx.journal.change("restarted"))
        except Interrupted:  # Ctrl-C: stopped at a safe point inside the batch; rolled back like a failure
            record.update(error="interrupted", total_s=round(time.monotonic() - started, 2))
            raise
        except DdopsError as exc:
            record.update(error=exc.line().split("\n")[0], total_s=round(time.monotonic() - started, 2))
            serving = f"; {', '.join(others)} kept serving the old release" if others else ""
            raise StepFailed(f"rolling restart halted at batch {number}/{total} ({', '.join(units)}): "
                             f"{record['failed_at']} failed: {exc.line()}{serving}",
                             fix="the failed batch is rolled back; the batches not reached were never stopped") from exc
        record.update(ok=True, total_s=round(time.monotonic() - started, 2))

"""Seed the kernel cache: before the unit (re)starts on a host whose Triton cache is missing or empty, push
the store for the host's GPU model into it (ddops.kernels), so the warm-up loads what another host of the
same model compiled and timed; with no store for its model, another model's compile record alone, so the
warm-up compiles what it will need at once. A cache the host has is never touched. A failed push empties
the cache again and is a warning, not a failure: the runtime then compiles its own kernels, as it would
have."""

from __future__ import annotations

from ..errors import DdopsError
from ..kernels import SeedDecision, decide_seed, empty_argv, seed
from ..plan import RESTART_AFTER, Operation, PlanContext, RunContext


def restarting(ctx: PlanContext) -> bool:
    """Whether this pivot (re)starts what serves: an earlier step changed what it runs, or it is not
    running (the start step's and the rolling restart's own rule)."""
    planned = {name for name, operations in ctx.before.items() if operations}
    units = [r.unit for r in ctx.profile.replicas.members] if ctx.profile.replicated else [ctx.profile.unit]
    return bool(planned & set(RESTART_AFTER)) or not all(ctx.facts.dest.unit(u).active for u in units)


def seed_decision(ctx: PlanContext) -> SeedDecision:
    return decide_seed(ctx.profile, ctx.profile.host, ctx.facts.host, ctx.facts.dest, ctx.facts.kernel_store,
                       enabled=ctx.kernel_seed, restarting=restarting(ctx), record=ctx.facts.kernel_record)


class KernelsStep:
    name = "kernels"
    title = "Seed the kernel cache"

    def plan(self, ctx: PlanContext) -> list[Operation]:
        decision = seed_decision(ctx)
        if decision.outcome == "seed":
            what = f"seed {decision.dir} from the kernel store for {decision.gpu_model} ({decision.store.words()})"
        elif decision.outcome == "record":
            what = (f"seed {decision.dir} with the compile record from the kernel store for "
                    f"{decision.store.gpu_model} (no store for {decision.gpu_model} yet)")
        else:
            return []
        return [Operation(what, data={"decision": decision}, figures=decision.as_json())]

    def apply(self, ctx: RunContext, operations: list[Operation]) -> str:
        decision: SeedDecision = operations[0].data["decision"]
        try:
            seed(ctx.executor, ctx.inventory, ctx.host, decision, ctx.progress)
        except (DdopsError, OSError) as exc:
            error = exc.line() if isinstance(exc, DdopsError) else str(exc)
            try:
                ctx.executor.run(ctx.host, empty_argv(decision.dir), timeout=300)
            except DdopsError as again:
                error += f"; emptying {decision.dir} again failed too: {again.line()}"
            ctx.journal.kernels["seed"] = {**decision.as_json(), "outcome": "failed", "error": error}
            return f"not seeded ({error}): the runtime compiles its own kernels"
        ctx.journal.change(self.name)   # nothing to undo: entries only a matching kernel reads
        ctx.journal.kernels["seed"] = {**decision.as_json(), "outcome": "seeded"}
        return decision.words()

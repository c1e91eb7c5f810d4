"""The pivot's steps, in the order they run. Each plans from facts (`plan(ctx) -> [Operation]`, pure)
and applies exactly the operations it planned (`apply(ctx, operations) -> summary`); see ddops.plan.

Steps import what is below them (plan, facts, paths, remote, transfer, release), never each other,
the CLI or the flow.
"""

from __future__ import annotations

from ..plan import Step
from ..profile import Profile
from .deps import DepsStep
from .kernels import KernelsStep
from .roll import RollStep
from .ship import ShipStep
from .start import StartStep
from .sync import SyncStep
from .training import TrainingStep
from .unit import UnitStep


def pivot_steps(profile: Profile | None = None) -> list[Step]:
    """The steps in order; the DDTree runtime's seeds its kernel cache before it starts; a replicated
    profile adds the rolling restart of replicas already serving."""
    steps: list[Step] = [TrainingStep(), SyncStep(), DepsStep(), ShipStep(), UnitStep()]
    if profile is None or profile.engine == "ddtree":
        steps.append(KernelsStep())
    steps.append(StartStep())
    if profile is not None and profile.replicated:
        steps.append(RollStep())
    return steps

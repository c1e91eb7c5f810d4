"""The pivot's steps, in the order they run. Each plans from facts (`plan(ctx) -> [Operation]`, pure)
and applies exactly the operations it planned (`apply(ctx, operations) -> summary`); see ddops.plan.

Steps import what is below them (plan, facts, paths, remote, transfer, release), never each other,
the CLI or the flow.
"""

from __future__ import annotations

from ..plan import Step
from .deps import DepsStep
from .ship import ShipStep
from .start import StartStep
from .sync import SyncStep
from .training import TrainingStep
from .unit import UnitStep


def pivot_steps() -> list[Step]:
    return [TrainingStep(), SyncStep(), DepsStep(), ShipStep(), UnitStep(), StartStep()]

"""Plans as data: what every pivot step plans from, what it plans, and what the run records.

A step turns facts into operations (`plan(ctx) -> [Operation]`, no side effects: the same facts give
the same plan, and an empty plan means no change and nothing restarted). The flow hands those very
operations to the step's `apply`, which runs them over the executor and records, in the `Journal`, what
it changed and how to undo it. Gates (`ddops.gates`) check the result; rollback replays the undos.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from .errors import StepFailed
from .executor import Executor
from .facts import PivotFacts
from .inventory import Host, Inventory
from .profile import Profile, Replica


# Earlier steps whose changes a running unit (or replica) only picks up when it restarts.
RESTART_AFTER = ("sync", "deps", "ship", "unit")


class Interrupted(StepFailed):
    """The operator pressed Ctrl-C (or sent SIGTERM); the pivot stops at the next safe point."""


@dataclass(frozen=True)
class Operation:
    """One thing a step would do: in words, with optional detail (a diff, a file list), the commands it
    runs on the host when they are known at plan time, the data its apply needs, (for a change that can
    be taken back) the operation that undoes it, what a real run would need that this one lacks, and
    the figures the plan read (shown by --json)."""

    what: str
    detail: str = ""
    commands: tuple[tuple[str, ...], ...] = ()
    data: dict[str, Any] = field(default_factory=dict)
    undo: "Operation | None" = None
    requires: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)   # what the plan measured, for --json (no secrets)


# The undo operations rollback knows how to replay (ddops.rollback.undo).

def start_again(unit: str) -> Operation:
    """The undo of stopping a unit."""
    return Operation(f"start {unit} again", data={"start": unit})


def restore_backup(unit: str, backup_id: str, restarts: list[str]) -> Operation:
    """The undo of installing a unit: put the backed-up files (or their absence) back, restart `restarts`."""
    return Operation(f"restore {unit} from backup {backup_id}",
                     data={"restore": backup_id, "unit": unit, "restarts": list(restarts)})


def roll_back_replicas(template: str, units: list[str]) -> Operation:
    """The undo of restarting replicas on a new release: after the backup is restored, restart them on it
    one at a time, each drained first and readmitted once healthy (ddops.rollback)."""
    return Operation(f"return {', '.join(units)} to the previous release", data={"roll_back": list(units),
                                                                                  "template": template})


@dataclass(frozen=True)
class PlanContext:
    """What a plan reads: the profile, the facts preflight gathered, the rendered unit and the flags."""

    profile: Profile
    inventory: Inventory
    facts: PivotFacts
    rendered: Any                   # steps.unit.Rendered: rendered once, before any host is touched
    kill_training: bool = False
    accept_lost_steps: float | None = None   # --accept-lost-steps N (inf: all); None: the profile's limit
    before: dict[str, list[Operation]] = field(default_factory=dict)   # earlier steps' plans, by step name
    batch: int = 1                  # replicas replaced at once by a rolling redeploy (--batch)

    @property
    def host(self) -> Host:
        return self.inventory.host(self.profile.host)


@dataclass
class Journal:
    """What a pivot did, as its steps record it: the steps that changed something, the undo operations
    (in the order their changes were made) and the figures the report shows."""

    changed: list[str] = field(default_factory=list)
    undo: list[Operation] = field(default_factory=list)
    backup_id: str | None = None
    stopped_units: list[str] = field(default_factory=list)
    training: dict[str, Any] | None = None       # the stop_training action's report
    unit_files: dict[str, Any] = field(default_factory=dict)   # checksums before and after the install
    gates: dict[str, Any] = field(default_factory=dict)        # gate name -> its result
    rolling: list[dict[str, Any]] = field(default_factory=list)   # a rolling redeploy's batches, as they ran

    def change(self, what: str, undo: Operation | None = None) -> None:
        """Note that `what` changed on the host, and how to take it back if that can be done."""
        if what not in self.changed:
            self.changed.append(what)
        if undo is not None:
            self.undo.append(undo)


@dataclass
class RunContext:
    """What apply and the gates use: the executor on the serving host, a progress line, the journal,
    and the safe-point check that turns a Ctrl-C into a clean stop."""

    profile: Profile
    inventory: Inventory
    executor: Executor
    secrets: dict[str, str] = field(default_factory=dict)   # unit env var -> value (never printed)
    facts: PivotFacts | None = None
    rendered: Any = None
    journal: Journal = field(default_factory=Journal)
    progress: Callable[[str], None] = lambda message: None
    interrupted: str | None = None    # set by Ctrl-C: the pivot stops at the next safe point
    gates: list[Any] = field(default_factory=list)   # the run's gates: a rolling restart checks each batch with them
    only: tuple[Replica, ...] | None = None          # set while a batch is checked: the gates look at these only

    @property
    def host(self) -> Host:
        return self.inventory.host(self.profile.host)

    def serving(self) -> tuple[Replica, ...]:
        """What the gates check: the batch being replaced, else every replica, else the one unit."""
        if self.only is not None:
            return self.only
        if self.profile.replicated:
            return self.profile.replicas.members
        return (Replica(index=0, unit=self.profile.unit, port=self.profile.port, gpus=()),)

    def check_interrupt(self) -> None:
        """Called at safe points (between steps, between health polls): stop here if asked to."""
        if self.interrupted:
            raise Interrupted(f"interrupted by {self.interrupted}: stopped at a safe point",
                              fix="what the pivot had changed is rolled back")


class Step(Protocol):
    """A pivot step: plans from facts, applies exactly what it planned."""

    name: str
    title: str

    def plan(self, ctx: PlanContext) -> list[Operation]: ...

    def apply(self, ctx: RunContext, operations: list[Operation]) -> str: ...

"""Plans as data: what every pivot step plans from, what it plans, and what the run records.

A step turns facts into operations (`plan(ctx) -> [Operation]`, no side effects: the same facts give
the same plan, and an empty plan means no change and nothing restarted). The flow hands those very
operations to the step's `apply`, which runs them over the executor and records, in the `Journal`, what
it changed and how to undo it (an `Undo`: ddops.undo has the kinds the steps use). Gates
(`ddops.gates`) check the result against the run's `Checks`; rollback applies the undos, newest first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ClassVar, Protocol, Sequence, runtime_checkable

from .errors import StepFailed
from .executor import Executor
from .facts import PivotFacts
from .inventory import Host, Inventory
from .profile import Health, Profile, Replica, Smoke, SmokePrompt


# Earlier steps whose changes a running unit (or replica) only picks up when it restarts.
RESTART_AFTER = ("sync", "deps", "ship", "unit")


class Interrupted(StepFailed):
    """The operator pressed Ctrl-C (or sent SIGTERM); the pivot stops at the next safe point."""


class UndoTarget(Protocol):
    """What an undo applies with (ddops.rollback.UndoContext is the one the rollback gives): the host,
    the report it adds to, and the requests to bring back what must run again once every undo has applied."""

    executor: Executor
    host: Host
    progress: Callable[[str], None]
    report: dict[str, Any]
    restored: dict[str, str | None]    # unit -> sha256 of its restored file

    def restart(self, unit: str) -> None: ...

    def cycle(self, template: str, unit: str) -> None: ...

    def start_again(self, unit: str, checked: bool = False) -> None: ...


class Undo:
    """How to take one change back. Each kind is a small dataclass (ddops.undo) with one `apply(ctx)`:
    it puts back what it can at once (files, a release) and asks `ctx` (an `UndoTarget`) to
    bring back what must run again, which the rollback restarts and gates after every undo has applied.
    Rollback applies a journal's undos newest first without knowing their kinds; an undo that everything
    else stands on (`first`: the runtime release under every unit) is applied before the others."""

    first: ClassVar[bool] = False

    def apply(self, ctx: UndoTarget) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Operation:
    """One thing a step would do: in words, with optional detail (a diff, a file list), the commands it
    runs on the host when they are known at plan time, the data its apply needs, (for a change that can
    be taken back) the undo that takes it back, what a real run would need that this one lacks, and
    the figures the plan read (shown by --json)."""

    what: str
    detail: str = ""
    commands: tuple[tuple[str, ...], ...] = ()
    data: dict[str, Any] = field(default_factory=dict)
    undo: Undo | None = None
    requires: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)   # what the plan measured, for --json (no secrets)


@dataclass
class StepState:
    """One row of the plan: a step or gate, its status, its planned operations and its summary."""

    name: str
    title: str
    status: str = "pending"
    summary: str = ""
    changes: list[Operation] = field(default_factory=list)
    seconds: float | None = None


def serving_shape(profile: Profile) -> dict:
    """What /health must report: the profile's mode, and its block size when it sets one (else the
    drafter's own, which preflight checked)."""
    block = {"block_size": profile.serve.block_size} if profile.serve.block_size is not None else {}
    return {**block, "mode": profile.serve.mode}


@dataclass(frozen=True)
class Checks:
    """What the gates hold a serving unit to: its /health (where, how long, what it must report) and its
    smoke test. The forward path takes them from the profile; each pivot's history record keeps them, so
    a rollback holds what it restores to the checks of the profile that installed it."""

    profile: str | None
    engine: str
    replicated: bool
    port: int | None                 # a plain unit's port (a replica's is its own)
    health: Health
    expect: dict[str, Any]           # what /health must report (a DDTree runtime: mode, block size)
    smoke: Smoke | None              # None: no smoke test is known for what is served
    served_model: str | None = None
    bearer_env: str | None = None    # the control machine's variable holding the API key (its name only)

    @classmethod
    def of(cls, profile: Profile) -> "Checks":
        ddtree = profile.engine == "ddtree"
        return cls(profile=profile.name, engine=profile.engine, replicated=profile.replicated, port=profile.port,
                   health=profile.health, expect=serving_shape(profile) if ddtree else {}, smoke=profile.smoke,
                   served_model=profile.serve.served_model_name,
                   bearer_env=profile.secrets.get("DDTREE_API_KEY"))

    @classmethod
    def health_only(cls, port: int | None, path: str, deadline_s: float) -> "Checks":
        """For a unit no pivot recorded: its /health, expecting nothing in particular, and no smoke."""
        return cls(profile=None, engine="unknown", replicated=False, port=port,
                   health=Health(path=path, deadline_s=deadline_s), expect={}, smoke=None)

    def record(self) -> dict[str, Any]:
        """As the history keeps it (JSON; names, never a secret's value)."""
        return asdict(self)

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> "Checks":
        smoke = data.get("smoke")
        return cls(**{**data, "health": Health(**data["health"]), "smoke": None if smoke is None else Smoke(
            **{**smoke, "prompts": tuple(SmokePrompt(**p) for p in smoke["prompts"])})})


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
    kernel_seed: bool = True        # an empty Triton cache may be seeded from the kernel store (--no-kernel-seed)

    @property
    def host(self) -> Host:
        return self.inventory.host(self.profile.host)


@dataclass
class Journal:
    """What a pivot did, as its steps record it: the steps that changed something, the undos (in the
    order their changes were made) and the figures the report shows."""

    changed: list[str] = field(default_factory=list)
    undo: list[Undo] = field(default_factory=list)
    backup_id: str | None = None
    stopped_units: list[str] = field(default_factory=list)
    training: dict[str, Any] | None = None       # the stop_training action's report
    unit_files: dict[str, Any] = field(default_factory=dict)   # checksums before and after the install
    gates: dict[str, Any] = field(default_factory=dict)        # gate name -> its result
    rolling: list[dict[str, Any]] = field(default_factory=list)   # a rolling redeploy's batches, as they ran
    kernels: dict[str, Any] = field(default_factory=dict)         # the kernel cache's seed, as it ran

    def change(self, what: str, undo: Undo | None = None) -> None:
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
    # set by the flow: check a batch of restarted replicas with the run's gates (calling `at(name, title)`
    # before each one); a rolling restart hands it to the replica cycle
    check_batch: Callable[[Sequence[Replica], Callable[[str, str], None]], None] | None = None
    only: tuple[Replica, ...] | None = None          # set while a batch is checked: the gates look at these only

    @property
    def host(self) -> Host:
        return self.inventory.host(self.profile.host)

    @property
    def checks(self) -> Checks:
        return Checks.of(self.profile)

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


@runtime_checkable
class Prepares(Protocol):
    """A step whose undo needs something made before the pivot changes anything (the unit step: a backup
    of the files it replaces). `prepare` makes it and returns the undos that use it."""

    def prepare(self, ctx: RunContext, operations: list[Operation]) -> list[Undo]: ...


def way_back(ctx: RunContext, steps: Sequence[Step], plans: dict[str, list[Operation]],
             at: Callable[[str], None] = lambda name: None) -> list[Undo]:
    """Every undo the planned operations would need, made ready before the first change, in the order of
    the steps (a rollback applies them newest first): what the pivot's journal of intent records.
    `at(name)` is told which step is preparing (a failure there is that step's)."""
    undos: list[Undo] = []
    for step in steps:
        operations = plans.get(step.name) or []
        if not operations:
            continue
        at(step.name)
        if isinstance(step, Prepares):
            undos += step.prepare(ctx, operations)
        undos += [op.undo for op in operations if op.undo is not None]
    return undos

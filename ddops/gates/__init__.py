"""Gates: checks run after the start, each `check(ctx) -> GateResult`, raising when the host is not
serving as it should. They change nothing; a failed gate makes the flow roll back. The flow runs them
on the way forward (the whole run, and each batch of a rolling restart); the rollback runs the same
ones on what it restored, held to the checks of the profile that installed it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..errors import StepFailed
from ..executor import Executor
from ..inventory import Host
from ..plan import Checks
from ..profile import Replica


@dataclass(frozen=True)
class GateResult:
    summary: str                                     # one line for the plan view
    data: dict[str, Any] = field(default_factory=dict)   # what the report and history keep


class GateFailed(StepFailed):
    """A gate's check failed; `data` is what it measured (the report keeps it)."""

    def __init__(self, what: str, data: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(what, **kwargs)
        self.data = data


class GateContext(Protocol):
    """What a gate's check reads (the pivot's RunContext is one; so is the rollback's view of what it
    restored): where, what to hold it to, the units to look at, and how to report and stop."""

    executor: Executor
    secrets: dict[str, str]
    progress: Callable[[str], None]
    only: tuple[Replica, ...] | None

    @property
    def host(self) -> Host: ...

    @property
    def checks(self) -> Checks: ...

    def serving(self) -> tuple[Replica, ...]: ...

    def check_interrupt(self) -> None: ...


class Gate(Protocol):
    name: str
    title: str

    def describe(self, ctx) -> str: ...

    def check(self, ctx) -> GateResult: ...

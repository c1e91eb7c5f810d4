"""Gates: checks the flow runs after the start, each `check(ctx) -> GateResult`, raising when the
host is not serving as it should. They change nothing; a failed gate makes the flow roll back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import StepFailed


@dataclass(frozen=True)
class GateResult:
    summary: str                                     # one line for the plan view
    data: dict[str, Any] = field(default_factory=dict)   # what the report and history keep


class GateFailed(StepFailed):
    """A gate's check failed; `data` is what it measured (the report keeps it)."""

    def __init__(self, what: str, data: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(what, **kwargs)
        self.data = data


class Gate(Protocol):
    name: str
    title: str

    def describe(self, ctx) -> str: ...

    def check(self, ctx) -> GateResult: ...

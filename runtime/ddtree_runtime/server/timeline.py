"""One request's way through the server, stamped at each stage: where its time goes before its rounds.

A short completion spends a large part of its life before its first decoding round (issue 24: 128
tokens through HTTP took 2.3 s against 1.5 s of rounds), and no single figure said where: reading and
tokenizing, the hand-off to the engine thread, the engine's queue, the prefill step, or the rounds.
Each stage is one `time.perf_counter()` read on a thread that is there anyway (the event loop, the
engine worker), so the cost is nothing a request would notice. The worker turns a finished request's
stamps into /metrics histograms and, at DEBUG, one log line (`summary`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

# (name, earlier stamp, later stamp): the intervals a timeline is read as, in the order they happen
INTERVALS = (
    ("prep", "arrived", "handed"),             # body read, parsed, tokenized; the event loop's turn
    ("handoff", "handed", "submitted"),        # waiting for the engine thread to carry it in (between steps)
    ("queue", "submitted", "admitted"),        # the engine's queue: no free row or pages yet
    ("prefill", "admitted", "first_token"),    # the step that admitted it: its prefill and the others' round
    ("to_round", "first_token", "first_round"),  # the next step: its first decoding round
    ("rounds", "first_round", "finished"),     # the rest of its rounds
)


@dataclass
class Timeline:
    """When one request reached each stage (time.perf_counter() seconds; None: not reached). The
    engine's stages are the worker's step boundaries: it sees the engine only between steps."""
    arrived: float                     # the route began to read the request
    handed: float | None = None        # handed to the engine worker (EngineWorker.submit)
    submitted: float | None = None     # in the engine's queue (Engine.submit, on the engine thread)
    admitted: float | None = None      # the start of the step that admitted it
    first_token: float | None = None   # the end of the step that gave its prefill's token
    first_round: float | None = None   # the end of the step that gave its first decoding round
    finished: float | None = None      # it left the engine
    rounds: int = 0                    # decoding rounds it took

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def intervals(self) -> dict[str, float]:
        """The seconds between the stages it reached, by INTERVALS' names."""
        out = {}
        for name, start, end in INTERVALS:
            a, b = getattr(self, start), getattr(self, end)
            if a is not None and b is not None:
                out[name] = b - a
        return out

    def summary(self) -> str:
        """One line: each interval in milliseconds, and the rounds."""
        parts = [f"{name} {1e3 * s:.1f}" for name, s in self.intervals().items()]
        return f"timeline ms: {', '.join(parts)}; {self.rounds} rounds"

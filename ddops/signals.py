"""Ctrl-C and SIGTERM during a pivot: noted, and obeyed at the next safe point."""

from __future__ import annotations

import os
import signal
import threading

from .plan import RunContext


class InterruptGuard:
    """While a pivot may change hosts, Ctrl-C and SIGTERM ask it to stop at the next safe point.

    The step in flight finishes (a unit is written whole or not at all), the run rolls back what it
    changed and reports the host's state. Further signals are noted, not obeyed: dying during the
    rollback is what would leave a host half-done. SIGKILL remains the way to stop it at once.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self.count = 0
        self.previous: dict = {}

    def handle(self, signum: int, frame) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.run.interrupted is None:
            self.run.interrupted = name
            message = f"\n{name}: stopping at the next safe point, then rolling back what changed\n"
        else:
            message = f"\n{name} again: already stopping; the rollback must finish (SIGKILL aborts it)\n"
        os.write(2, message.encode())  # async-signal-safe; the live view repaints over it

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

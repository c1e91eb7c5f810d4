"""Waits a log can see. In a terminal a spinner shows what is going on; elsewhere (CI, `| tee`) a
spinner prints nothing, so a wait writes its new progress notes as lines (at most one every NOTE_S)
and a heartbeat after HEARTBEAT_S without a line: a log never sits silent for more than ~10 s."""

from __future__ import annotations

import threading
import time

from rich.console import Console
from rich.text import Text

NOTE_S = 3.0
HEARTBEAT_S = 5.0


class Activity:
    """`with Activity(console, "preflight") as act: ... act.update("probing ct200")`."""

    def __init__(self, console: Console, what: str) -> None:
        self.console, self.what = console, what
        self.note = ""
        self.written = ""
        self.started = self.last_line = time.monotonic()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.spinner = console.status(f"{what}...") if console.is_terminal else None

    def update(self, message: str) -> None:
        self.note = message
        if self.spinner is not None:
            self.spinner.update(message)
        elif message != self.written and time.monotonic() - self.last_line >= NOTE_S:
            self.write(f"     {message}")
            self.written = message

    def write(self, line: str) -> None:
        with self.lock:
            self.console.print(Text(line, style="dim"), soft_wrap=True)
            self.last_line = time.monotonic()

    def beat(self) -> None:
        while not self.done.wait(1.0):
            if time.monotonic() - self.last_line >= HEARTBEAT_S:
                self.write(f"     ... {self.what}, {time.monotonic() - self.started:.0f}s"
                           + (f": {self.note}" if self.note else ""))

    def __enter__(self) -> "Activity":
        if self.spinner is not None:
            self.spinner.__enter__()
        else:
            threading.Thread(target=self.beat, name="activity-heartbeat", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self.spinner is not None:
            self.spinner.__exit__(*exc)
        self.done.set()

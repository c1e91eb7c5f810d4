"""uvicorn.Server whose first SIGTERM/SIGINT drains instead of stopping at once.

Draining: new API requests get 503 and /health says ``draining``; in-flight and queued requests run
to completion for up to ``drain_timeout`` seconds, then are cancelled; then uvicorn shuts down as
usual. A second signal cancels them at once: each ends cleanly within a round (a 503, or a stream's
error event and ``[DONE]``), and the process exits. A third stops without waiting for anything.
"""

from __future__ import annotations

import logging
import signal
import time

import uvicorn

from ddtree_runtime.server.context import ServerContext

log = logging.getLogger("ddtree_runtime.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServerContext) -> None:
        super().__init__(config)
        self._ctx = ctx
        self._drain_deadline = 0.0
        self._signals = 0

    def handle_exit(self, sig: int, frame) -> None:
        # Runs as a signal handler: only set flags, on_tick (every 0.1 s) acts on them. Unlike
        # uvicorn's own handler this does not re-raise the signal after shutdown, so the exit code is 0.
        self._signals += 1
        name = signal.Signals(sig).name
        if self._signals == 1:
            self._ctx.draining = True
            self._drain_deadline = time.monotonic() + self._ctx.config.drain_timeout
            log.info("%s: draining, up to %.0fs", name, self._ctx.config.drain_timeout)
        elif self._signals == 2:
            log.info("%s again: cancelling what runs, then exiting", name)
        else:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        ctx = self._ctx
        if ctx.draining:
            ctx.uploads_stopped().set()  # bodies still arriving get a 503 now, not a place in the drain
        if ctx.draining and not self.should_exit:
            if ctx.in_flight == 0 and not ctx.worker.busy():
                self.should_exit = True
            elif self._signals > 1 or time.monotonic() >= self._drain_deadline:
                why = "second signal" if self._signals > 1 else "drain timeout"
                log.warning("%s: cancelling %d in-flight request(s)", why, ctx.in_flight)
                ctx.worker.cancel_all("shutdown")
                self.should_exit = True
        return await super().on_tick(counter)

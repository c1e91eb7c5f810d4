"""Test faults for a real ``ddtree-serve``: an engine wrapper the worker steps like the engine, and the
POST /_test/fault route that flips it. The served runtime knows nothing of either.

Faults (the JSON body's keys):
    kill_worker: the worker thread dies at its next look at the engine (within IDLE_POLL_S when idle).
    engine_errors: the next N submissions raise inside the engine (the worker must survive them).
    round_delay_s: each engine step takes this much longer (makes generations slow enough to observe).
    paused: the engine holds the requests it is given, unstarted, and steps nothing: the first held
        counts as running and the others as its queue (with no free row, so --max-queue of them fill
        it deterministically); on resume they start in the order they came.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from ddtree_runtime.server.app import create_app
from ddtree_runtime.server.config import ServerConfig
from ddtree_runtime.server.errors import APIError
from ddtree_runtime.server.worker import load_engine

WORKER_THREAD = "ddtree-engine"  # the name EngineWorker gives its thread
PAUSED_STEP_S = 0.01


class WorkerKilled(BaseException):
    """Raised on the worker thread by kill_worker; the worker catches only Exception, so it dies."""


@dataclass
class Faults:
    kill_worker: bool = False
    engine_errors: int = 0
    round_delay_s: float = 0.0
    paused: bool = False


@dataclass
class FaultyEngine:
    """Wraps the real engine; request ids it hands out map to the inner engine's once a request starts."""

    inner: Any
    faults: Faults
    _next_id: int = 0
    _held: dict[int, tuple[list[int], Any]] = field(default_factory=dict)  # id -> (prompt, params)
    _started: dict[int, int] = field(default_factory=dict)  # our id -> inner id

    def __getattr__(self, name: str) -> Any:  # tokenizer, stats, can_serve, config, generate, ...
        return getattr(self.inner, name)

    @property
    def slots(self) -> int:
        if self.faults.paused:  # the held one (and what runs already) take every row until resumed
            return max(1, len(self._held) + len(self._started))
        return self.inner.slots

    @property
    def has_work(self) -> bool:
        self._check_kill()
        return bool(self._held) or self.inner.has_work

    @property
    def queue_depth(self) -> int:
        return self.inner.queue_depth + len(self._held_waiting())

    def has_room(self, arriving: int = 0) -> bool:
        if self.faults.paused:  # no row frees up while paused: only the queue's own places
            return self.queue_depth + arriving < self.inner.config.max_queue
        return self.inner.has_room(arriving + len(self._held))

    def queued(self, request_id: int) -> bool:
        if request_id in self._held:
            return request_id in self._held_waiting()
        inner = self._started.get(request_id)
        return inner is not None and self.inner.queued(inner)

    def _held_waiting(self) -> list[int]:
        """The held requests that count as queued: all but the first, when nothing else runs."""
        held = list(self._held)
        return held if self._started else held[1:]

    def submit(self, prompt_ids: list[int], params: Any) -> int:
        self._check_kill()
        if self.faults.engine_errors > 0:
            self.faults.engine_errors -= 1
            raise RuntimeError("injected engine fault")
        self._next_id += 1
        if self.faults.paused:
            self._held[self._next_id] = (prompt_ids, params)
        else:
            self._started[self._next_id] = self.inner.submit(prompt_ids, params)
        return self._next_id

    def step(self) -> list[tuple[int, Any]]:
        self._check_kill()
        if self.faults.paused:
            time.sleep(PAUSED_STEP_S)
            return []
        for request_id, (prompt_ids, params) in list(self._held.items()):
            del self._held[request_id]
            self._started[request_id] = self.inner.submit(prompt_ids, params)
        ours = {inner: request_id for request_id, inner in self._started.items()}
        outputs = [(ours[inner], out) for inner, out in self.inner.step() if inner in ours]
        if self.faults.round_delay_s:
            time.sleep(self.faults.round_delay_s)
        return outputs

    def cancel(self, request_id: int) -> None:
        self._held.pop(request_id, None)
        inner = self._started.pop(request_id, None)
        if inner is not None:
            self.inner.cancel(inner)

    def _check_kill(self) -> None:
        if self.faults.kill_worker and threading.current_thread().name == WORKER_THREAD:
            raise WorkerKilled("killed by test fault")


def create_faulty_app(config: ServerConfig, startup_delay_s: float = 0.0) -> FastAPI:
    """create_app with the engine wrapped in FaultyEngine and POST /_test/fault to set its Faults."""
    faults = Faults()

    def engine_factory(cfg: ServerConfig) -> FaultyEngine:
        time.sleep(startup_delay_s)  # keeps /health at "starting" long enough to observe
        return FaultyEngine(load_engine(cfg), faults)

    app = create_app(config, engine_factory)
    router = APIRouter()

    @router.post("/_test/fault", include_in_schema=False)
    async def set_faults(request: Request) -> JSONResponse:
        body = await request.json()
        if not isinstance(body, dict):
            raise APIError(400, "expected a JSON object of faults")
        for key, value in body.items():
            if not hasattr(faults, key):
                raise APIError(400, f"unknown fault {key!r}", param=key)
            setattr(faults, key, value)
        return JSONResponse({"faults": vars(faults)})

    app.include_router(router)
    return app

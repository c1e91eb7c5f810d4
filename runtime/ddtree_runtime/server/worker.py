"""The engine worker: one thread owns the (not thread-safe) engine and serves jobs in order.

Requests wait in a bounded queue; a full queue is the caller's 429. Results go back to the request's
event loop as events (``RoundEvent`` ... then ``DoneEvent`` or ``ErrorEvent``). A job is cancelled by
setting its flag: the worker checks it between rounds and closes the engine's generator; a job still
waiting is also taken off the queue (``withdraw``), so an abandoned request frees its place at once.

Health is the worker's own word: ``ready`` only after the warm-up generation succeeded, and only
while the thread is alive and the engine can still serve (``Engine.can_serve``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddtree_runtime.server.config import ServerConfig
from ddtree_runtime.server.metrics import Metrics

log = logging.getLogger("ddtree_runtime.server")

STARTING, READY, ERROR = "starting", "ready", "error"
WARMUP_PROMPT = "Hello"
WARMUP_TOKENS = 4
IDLE_POLL_S = 0.1  # how often an idle worker looks at its stop and kill flags
RECENT_JOBS = 32  # job durations kept for the Retry-After estimate


# --- events sent from the worker thread to a request -------------------------------------------


@dataclass
class RoundEvent:
    output: Any  # engine.RoundOutput


@dataclass
class DoneEvent:
    """The engine stopped: finished, or the job was cancelled."""


@dataclass
class ErrorEvent:
    status: int
    message: str


# --- jobs ---------------------------------------------------------------------------------------


@dataclass
class Job:
    prompt_ids: list[int]
    params: Any  # engine.SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str | None = None

    def cancel(self, reason: str) -> None:
        if not self.cancelled.is_set():
            self.cancel_reason = reason
            self.cancelled.set()

    def emit(self, event: RoundEvent | DoneEvent | ErrorEvent) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is gone, nobody is listening
            pass


class QueueFull(Exception):
    pass


class NotReady(Exception):
    def __init__(self, state: str, detail: str) -> None:
        super().__init__(detail)
        self.state = state
        self.detail = detail


# --- test faults ---------------------------------------------------------------------------------


class _WorkerKilled(BaseException):
    """Raised inside the worker thread by the kill fault; nothing catches it, so the thread dies."""


@dataclass
class Faults:
    """Test-only knobs (the app exposes them at POST /_test/fault when DDTREE_TEST_FAULTS=1).

    kill_worker: the worker thread dies at its next job (or within 0.1 s if idle).
    engine_errors: the next N jobs raise inside the engine loop (the worker must survive).
    round_delay_s: sleep this long after each round (makes generations slow enough to observe).
    paused: the worker takes the next job off the queue and holds it there, unstarted (so the queue
        fills deterministically: one held job, then max_queue waiting).
    """

    kill_worker: bool = False
    engine_errors: int = 0
    round_delay_s: float = 0.0
    paused: bool = False


# --- the worker ----------------------------------------------------------------------------------

class EngineWorker:
    def __init__(
        self,
        config: ServerConfig,
        metrics: Metrics,
        engine_factory: Callable[[ServerConfig], Any] | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.faults = Faults()
        self.engine: Any = None
        self._engine_factory = engine_factory or _load_engine
        self._waiting: deque[Job] = deque()
        self._has_work = threading.Condition()  # guards _waiting
        self._state = STARTING
        self._detail = "loading model"
        self._current: Job | None = None
        self._current_since = 0.0
        self._durations: deque[float] = deque(maxlen=RECENT_JOBS)  # seconds each recent job held the engine
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ddtree-engine", daemon=True)

    # -- called from the event loop --

    def start(self) -> None:
        self._thread.start()

    def health(self) -> tuple[str, str]:
        """(state, detail). A ready worker whose thread is gone, or whose engine lost what it needs to
        serve, is an error, whatever it last said."""
        state, detail = self._state, self._detail
        if state != ERROR and self._thread.ident is not None and not self._thread.is_alive():
            return ERROR, "engine worker thread is not running"
        if state == READY and not getattr(self.engine, "can_serve", True):
            return ERROR, "the engine cannot serve: a cache re-allocation failed (restart the service)"
        return state, detail

    def submit(self, job: Job) -> None:
        state, detail = self.health()
        if state != READY:
            raise NotReady(state, detail)
        with self._has_work:
            if len(self._waiting) >= self.config.max_queue:
                raise QueueFull
            self._waiting.append(job)
            self._has_work.notify()

    def withdraw(self, job: Job) -> None:
        """Take a job that has not started off the queue (its client left, or gave up)."""
        with self._has_work:
            try:
                self._waiting.remove(job)
            except ValueError:  # already started, or finished
                pass

    def queue_depth(self) -> int:
        return len(self._waiting)

    def retry_after_s(self) -> int:
        """Seconds until the work already admitted is done, from recent jobs' durations: the running
        job's expected remainder plus one mean duration per waiting job (at least 1)."""
        durations = list(self._durations)
        if not durations:
            return 1
        mean = sum(durations) / len(durations)
        remaining = max(mean - (time.monotonic() - self._current_since), 0.0) if self._current else 0.0
        return max(1, math.ceil(remaining + mean * self.queue_depth()))

    def working(self) -> bool:
        """A job is on the engine right now."""
        return self._current is not None

    def busy(self) -> bool:
        return self._current is not None or bool(self._waiting)

    def cancel_all(self, reason: str) -> None:
        current = self._current
        if current is not None:
            current.cancel(reason)
        with self._has_work:
            for job in self._waiting:
                job.cancel(reason)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel everything and let the thread end (it is a daemon: a stuck engine cannot hold the exit)."""
        self.cancel_all("shutdown")
        self._stopping = True
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the worker thread --

    def _run(self) -> None:
        try:
            self._load()
        except Exception as exc:  # a load failure is reported by /health, not raised
            log.exception("engine failed to start")
            self._set(ERROR, f"engine failed to start: {type(exc).__name__}: {exc}")
            return
        self._set(READY, "")
        log.info("engine ready")
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the thread is dying; say so and fail waiting jobs
            log.error("engine worker died: %r", exc)
            self._set(ERROR, f"engine worker died: {type(exc).__name__}: {exc}")
            self._fail_pending("the engine worker died")

    def _set(self, state: str, detail: str) -> None:
        self._state, self._detail = state, detail

    def _load(self) -> None:
        if self.config.test_startup_delay_s:
            time.sleep(self.config.test_startup_delay_s)
        c = self.config
        log.info("--> loading target %s, drafter %s (mode %s, %s, %s)", c.target_dir, c.draft_dir, c.mode,
                 c.device, c.dtype)
        started = time.perf_counter()
        self._detail = "loading model"
        self.engine = self._engine_factory(self.config)
        self.metrics.set_max_acceptance_length(engine_block_size(self.engine) or 1)
        log.info("--> loaded in %.1fs; warm-up generation", time.perf_counter() - started)
        self._detail = "warming up"
        from ddtree_runtime.engine import SamplingParams

        prompt = self.engine.tokenizer.encode(WARMUP_PROMPT, add_special_tokens=False)
        params = SamplingParams(max_new_tokens=WARMUP_TOKENS, temperature=0.0)
        produced = sum(len(out.token_ids) for out in self.engine.generate(prompt, params))
        if produced == 0:
            raise RuntimeError("warm-up generation produced no tokens")

    def _next_job(self) -> Job | None:
        with self._has_work:
            if not self._waiting:
                self._has_work.wait(IDLE_POLL_S)
            if not self._waiting:
                return None
            job = self._waiting.popleft()
            self._current, self._current_since = job, time.monotonic()
            return job

    def _serve(self) -> None:
        while True:
            job = self._next_job()
            if job is None:
                if self._stopping:
                    return
                if self.faults.kill_worker:
                    raise _WorkerKilled("killed by test fault")
                continue
            while self.faults.paused and not self.faults.kill_worker and not job.cancelled.is_set():
                time.sleep(0.01)
            if job.cancelled.is_set():
                self._current = None
                job.emit(DoneEvent())
                continue
            state, detail = self.health()
            if state != READY:  # queued before the engine broke
                self._current = None
                job.emit(ErrorEvent(503, f"the engine is not ready ({state}): {detail}"))
                continue
            self._current_since = time.monotonic()  # a paused (test fault) hold is not engine time
            try:
                self._run_job(job)
            except BaseException:  # the thread is dying: this request must not wait forever
                job.emit(ErrorEvent(503, "the engine worker died"))
                raise
            finally:
                self._durations.append(time.monotonic() - self._current_since)
                self._current = None

    def _run_job(self, job: Job) -> None:
        if self.faults.kill_worker:
            raise _WorkerKilled("killed by test fault")
        rounds = 0
        generator = None
        try:
            if self.faults.engine_errors > 0:
                self.faults.engine_errors -= 1
                raise RuntimeError("injected engine fault")
            generator = self.engine.generate(job.prompt_ids, job.params)
            started = time.perf_counter()
            for out in generator:
                elapsed = time.perf_counter() - started
                if rounds == 0:  # the engine's first output is the prefill, not a speculative round
                    self.metrics.observe_prefill(elapsed, len(out.token_ids))
                else:
                    self.metrics.observe_round(elapsed, out.accepted + 1, len(out.token_ids))
                rounds += 1
                job.emit(RoundEvent(out))
                if out.finished:
                    break
                if job.cancelled.is_set():
                    log.info("generation cancelled after %d round(s): %s", rounds, job.cancel_reason)
                    break
                if self.faults.round_delay_s:
                    time.sleep(self.faults.round_delay_s)
                started = time.perf_counter()
        except ValueError as exc:
            if rounds == 0:  # the engine rejected the parameters before doing anything
                job.emit(ErrorEvent(400, str(exc)))
            else:
                log.exception("engine error during generation")
                job.emit(ErrorEvent(500, f"engine error: {type(exc).__name__}: {exc}"))
            return
        except Exception as exc:  # the request fails, the worker carries on
            log.exception("engine error during generation")
            job.emit(ErrorEvent(500, f"engine error: {type(exc).__name__}: {exc}"))
            return
        finally:
            if generator is not None:
                generator.close()
        job.emit(DoneEvent())

    def _fail_pending(self, message: str) -> None:
        with self._has_work:
            while self._waiting:
                self._waiting.popleft().emit(ErrorEvent(503, message))


def _load_engine(config: ServerConfig) -> Any:
    from ddtree_runtime.engine import Engine, EngineConfig

    return Engine(EngineConfig(**config.engine_kwargs()))


def engine_block_size(engine: Any) -> int | None:
    """The block size the engine really uses (the drafter's default when none was configured)."""
    for source in (engine, getattr(engine, "config", None)):
        value = getattr(source, "block_size", None)
        if isinstance(value, int):
            return value
    return None

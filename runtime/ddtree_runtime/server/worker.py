"""The engine worker: one thread owns the (not thread-safe) engine and steps it for every running job.

Requests wait in a bounded queue; a full queue is the caller's 429. The worker moves jobs from the
queue into the engine while it has a free slot (up to --max-running, or fewer if memory allowed fewer)
and steps the engine: each step is one round for every running job. Results go back to each request's
event loop as events (``RoundEvent`` ... then ``DoneEvent`` or ``ErrorEvent``). A job is cancelled by
setting its flag: the worker checks it between steps and takes the request out of the engine; a job
still waiting is also taken off the queue (``withdraw``), so an abandoned request frees its place at once.

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
IDLE_POLL_S = 0.1  # how often an idle worker looks at its stop flag
RECENT_JOBS = 32  # job durations kept for the Retry-After estimate
TOKEN_RATE_WINDOW_S = 10.0  # /metrics' tokens per second: over this many seconds


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


@dataclass
class _Running:
    """A job the engine holds: its request id there, and what the metrics need."""
    job: Job
    request_id: int
    admitted: float          # time.monotonic() at admission
    outputs: int = 0


class QueueFull(Exception):
    pass


class NotReady(Exception):
    def __init__(self, state: str, detail: str) -> None:
        super().__init__(detail)
        self.state = state
        self.detail = detail


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
        self.engine: Any = None
        self._engine_factory = engine_factory or load_engine
        self._waiting: deque[Job] = deque()
        self._has_work = threading.Condition()  # guards _waiting
        self._state = STARTING
        self._detail = "loading model"
        self._running: dict[int, _Running] = {}  # by engine request id
        self._durations: deque[float] = deque(maxlen=RECENT_JOBS)  # seconds each recent job held the engine
        self._committed: deque[tuple[float, int]] = deque()  # (time, tokens) over the last rate window
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
            # the queue is max_queue places behind the running jobs: jobs for free slots pass through it
            if len(self._waiting) >= self.config.max_queue + self._free_slots():
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

    def running(self) -> int:
        """Jobs in the engine now."""
        return len(self._running)

    def _free_slots(self) -> int:
        """Slots the worker fills at its next step."""
        return max(0, self.capacity() - len(self._running))

    def capacity(self) -> int:
        """Jobs the engine runs at once: --max-running, or the slots its memory allowed."""
        return getattr(self.engine, "slots", self.config.max_running)

    def engine_stats(self, name: str) -> float:
        """A field of the engine's BatchStats (0 before the engine is loaded)."""
        return getattr(getattr(self.engine, "stats", None), name, 0)

    def tokens_per_second(self) -> float:
        """Tokens committed per second over the last TOKEN_RATE_WINDOW_S seconds."""
        cutoff = time.monotonic() - TOKEN_RATE_WINDOW_S
        return sum(n for t, n in list(self._committed) if t >= cutoff) / TOKEN_RATE_WINDOW_S

    def retry_after_s(self) -> int:
        """Seconds until the work already admitted is done, from recent jobs' durations: the longest
        expected remainder of the running jobs, plus one mean duration for each batch of waiting jobs
        the engine's slots take at once (at least 1)."""
        durations = list(self._durations)
        if not durations:
            return 1
        mean = sum(durations) / len(durations)
        now = time.monotonic()
        remaining = max((max(mean - (now - r.admitted), 0.0) for r in list(self._running.values())), default=0.0)
        return max(1, math.ceil(remaining + mean * math.ceil(self.queue_depth() / self.capacity())))

    def working(self) -> bool:
        """A job is on the engine right now."""
        return bool(self._running)

    def busy(self) -> bool:
        return self.working() or bool(self._waiting)

    def cancel_all(self, reason: str) -> None:
        for r in list(self._running.values()):
            r.job.cancel(reason)
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
            return self._waiting.popleft() if self._waiting else None

    def _serve(self) -> None:
        try:
            while True:
                self._admit()
                if not self._running:
                    if self._stopping:
                        return
                    with self._has_work:
                        if not self._waiting:
                            self._has_work.wait(IDLE_POLL_S)
                    continue
                self._step()
        except BaseException:  # the thread is dying: no request may wait forever
            for r in self._running.values():
                r.job.emit(ErrorEvent(503, "the engine worker died"))
            raise

    def _admit(self) -> None:
        """Move waiting jobs into the engine while it has a free slot."""
        while len(self._running) < self.capacity():
            job = self._next_job()
            if job is None:
                return
            self._start(job)

    def _start(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.emit(DoneEvent())
            return
        state, detail = self.health()
        if state != READY:  # queued before the engine broke
            job.emit(ErrorEvent(503, f"the engine is not ready ({state}): {detail}"))
            return
        try:
            request_id = self.engine.submit(job.prompt_ids, job.params)
        except ValueError as exc:  # the engine rejected the parameters before doing anything
            job.emit(ErrorEvent(400, str(exc)))
            return
        except Exception as exc:  # the request fails, the worker carries on
            log.exception("engine error at admission")
            job.emit(ErrorEvent(500, f"engine error: {type(exc).__name__}: {exc}"))
            return
        self._running[request_id] = _Running(job, request_id, time.monotonic())

    def _step(self) -> None:
        """One engine step for every running job: cancellations first, then the round, then each
        job's output (and its end)."""
        for r in list(self._running.values()):
            if r.job.cancelled.is_set():
                log.info("generation cancelled after %d round(s): %s", r.outputs, r.job.cancel_reason)
                self._finish(r, DoneEvent())
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # every running job fails; the engine drops them and serves the next
            log.exception("engine error during generation")
            for r in list(self._running.values()):
                self._finish(r, ErrorEvent(500, f"engine error: {type(exc).__name__}: {exc}"))
            return
        elapsed = time.perf_counter() - started
        now = time.monotonic()
        for request_id, out in outputs:
            r = self._running.get(request_id)
            if r is None:
                continue
            if out.error is not None:
                status = 400 if isinstance(out.error, ValueError) else 500
                self._finish(r, ErrorEvent(status, f"{out.error}" if status == 400 else
                                           f"engine error: {type(out.error).__name__}: {out.error}"))
                continue
            if r.outputs == 0:  # the engine's first output is the prefill, not a speculative round
                self.metrics.observe_prefill(now - r.admitted, len(out.token_ids))
            else:
                self.metrics.observe_round(elapsed, out.accepted + 1, len(out.token_ids))
            r.outputs += 1
            self._committed.append((now, len(out.token_ids)))
            r.job.emit(RoundEvent(out))
            if out.finished:
                self._finish(r, DoneEvent())
        while self._committed and self._committed[0][0] < now - TOKEN_RATE_WINDOW_S:
            self._committed.popleft()

    def _finish(self, r: _Running, event: DoneEvent | ErrorEvent) -> None:
        """The job leaves the engine (a no-op there if it already finished) with its last event."""
        del self._running[r.request_id]
        self.engine.cancel(r.request_id)
        self._durations.append(time.monotonic() - r.admitted)
        r.job.emit(event)

    def _fail_pending(self, message: str) -> None:
        with self._has_work:
            while self._waiting:
                self._waiting.popleft().emit(ErrorEvent(503, message))


def load_engine(config: ServerConfig) -> Any:
    """The engine the worker builds unless the app is given another factory."""
    from ddtree_runtime.engine import Engine, EngineConfig

    if config.tensor_parallel > 1:  # rank 0 of several: its engine's calls go to every rank
        from ddtree_runtime.server.ranks import lead

        return lead(config)
    return Engine(EngineConfig(**config.engine_kwargs()))


def engine_block_size(engine: Any) -> int | None:
    """The block size the engine really uses (the drafter's default when none was configured)."""
    for source in (engine, getattr(engine, "config", None)):
        value = getattr(source, "block_size", None)
        if isinstance(value, int):
            return value
    return None

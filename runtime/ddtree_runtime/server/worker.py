"""The engine worker: one thread owns the (not thread-safe) engine, and this is the bridge to it.

The engine's scheduler holds every request: the waiting queue (bounded by --max-queue: a full queue
is the caller's 429), admission and the running batch. The worker has no queue of its own: it carries
each submission into the engine thread (``submit`` puts it in a hand-off that the thread empties
before each step, checking the engine's queue for room first) and each step's results back to the
requests' event loops as events (``RoundEvent`` ... then ``DoneEvent`` or ``ErrorEvent``). A job is
cancelled by setting its flag: the thread takes the request out of the engine before its next step,
wherever it is there, waiting or running (``withdraw`` wakes the thread for it at once).

The worker knows the engine only through ``engine.api.ServedEngine``. Health is the worker's own word:
``ready`` only after the warm-up (``Engine.warm_up``: every batch size's kernels compiled and graphs
captured, so the first users do not wait for them; it leaves the pool, the prefix cache and the counters
as it found them), and only while the thread is alive and the engine can still serve
(``Engine.can_serve``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from ddtree_runtime.engine.api import ServedEngine
from ddtree_runtime.engine.types import BatchStats, RoundOutput, SamplingParams
from ddtree_runtime.server.config import ServerConfig
from ddtree_runtime.server.metrics import Metrics
from ddtree_runtime.server.timeline import Timeline

log = logging.getLogger("ddtree_runtime.server")

STARTING, READY, ERROR = "starting", "ready", "error"
IDLE_POLL_S = 0.1  # how often an idle worker looks at its stop flag
RECENT_JOBS = 32  # job durations kept for the Retry-After estimate
TOKEN_RATE_WINDOW_S = 10.0  # /metrics' tokens per second: over this many seconds


# --- events sent from the worker thread to a request -------------------------------------------


@dataclass
class RoundEvent:
    output: RoundOutput


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
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str | None = None
    timeline: Timeline = field(default_factory=lambda: Timeline(Timeline.now()))  # its stages' times

    def cancel(self, reason: str) -> None:
        if not self.cancelled.is_set():
            self.cancel_reason = reason
            self.cancelled.set()

    def emit(self, event: RoundEvent | DoneEvent | ErrorEvent) -> None:
        _post(self.loop, [(self, event)])


def _post(loop: asyncio.AbstractEventLoop, events: list[tuple[Job, RoundEvent | DoneEvent | ErrorEvent]]) -> None:
    """Put jobs' events on their queues, on their event loop, in one call: a wake-up of the loop
    (and a turn of the GIL away from the engine thread) per step, not per job."""
    try:
        loop.call_soon_threadsafe(_deliver, events)
    except RuntimeError:  # the event loop is closed: the server is gone, nobody is listening
        pass


def _deliver(events: list[tuple[Job, RoundEvent | DoneEvent | ErrorEvent]]) -> None:
    for job, event in events:
        job.events.put_nowait(event)


class _Outbox:
    """A step's events, grouped by event loop and sent at the end of the step (`send`)."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, RoundEvent | DoneEvent | ErrorEvent]]] = {}

    def add(self, job: Job, event: RoundEvent | DoneEvent | ErrorEvent) -> None:
        self._by_loop.setdefault(job.loop, []).append((job, event))

    def send(self) -> None:
        for loop, events in self._by_loop.items():
            _post(loop, events)
        self._by_loop = {}


@dataclass
class _Tracked:
    """A job the engine holds: its request id there, and what the metrics need."""
    job: Job
    request_id: int
    outputs: int = 0

    @property
    def admitted(self) -> float | None:
        """When the step that admitted it started (its timeline's clock); None while it waits."""
        return self.job.timeline.admitted


_NO_STATS = BatchStats()  # what the metrics read before the engine is loaded


class QueueFull(Exception):
    pass


class NotReady(Exception):
    def __init__(self, state: str, detail: str) -> None:
        super().__init__(detail)
        self.state = state
        self.detail = detail


def _freeze_startup_heap() -> None:
    """What is alive once the engine is warm (modules, the model, the compiled kernels) lives as long as
    the process: it is moved out of the cyclic collector's sight. A request of many small objects (a
    chat of 70,000 messages) sets off full collections, and each walked this startup heap (0.3 s and
    more, holding the GIL: the event loop's /health and the engine's rounds stalled with it); now it
    walks the requests' own objects."""
    gc.collect()
    gc.freeze()


# --- the worker ----------------------------------------------------------------------------------

class EngineWorker:
    def __init__(
        self,
        config: ServerConfig,
        metrics: Metrics,
        engine_factory: Callable[[ServerConfig], ServedEngine] | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.engine: ServedEngine | None = None  # once loaded
        self._engine_factory = engine_factory or load_engine
        self._handoff: deque[Job] = deque()  # submitted, not yet carried into the engine
        self._wake = threading.Condition()  # guards _handoff; notified by submit, withdraw and cancel_all
        self._state = STARTING
        self._detail = "loading model"
        self._jobs: dict[int, _Tracked] = {}  # every job the engine holds, by its request id there
        self._durations: deque[float] = deque(maxlen=RECENT_JOBS)  # seconds each recent job held a row
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
        if state == READY and self.engine is not None and not self.engine.can_serve:
            return ERROR, "the engine cannot serve: a cache re-allocation failed (restart the service)"
        return state, detail

    def submit(self, job: Job) -> None:
        """Hand the job to the engine thread; QueueFull when the engine's queue has no room for it (with
        the jobs handed over and not yet carried counted in)."""
        state, detail = self.health()
        if state != READY:
            raise NotReady(state, detail)
        with self._wake:
            if self.engine is None or not self.engine.has_room(len(self._handoff)):
                raise QueueFull
            job.timeline.handed = Timeline.now()
            self._handoff.append(job)
            self._wake.notify()

    def withdraw(self, job: Job) -> None:
        """A job given up (its flag set): off the hand-off if not yet carried, and the engine thread
        woken to take it out of the engine, so an abandoned request frees its place at once."""
        with self._wake:
            try:
                self._handoff.remove(job)
            except ValueError:  # carried already, or finished
                pass
            self._wake.notify()

    def queue_depth(self) -> int:
        """Requests waiting for a row: the engine's queue, and those on their way to it."""
        return len(self._handoff) + (self.engine.queue_depth if self.engine is not None else 0)

    def running(self) -> int:
        """Jobs the engine has admitted (prefilling or decoding)."""
        return sum(t.admitted is not None for t in list(self._jobs.values()))

    def capacity(self) -> int:
        """Jobs the engine runs at once: --max-running, or the slots its memory allowed."""
        return self.config.max_running if self.engine is None else self.engine.slots

    def stats(self) -> BatchStats:
        """The engine's counters (all 0 before it is loaded)."""
        return _NO_STATS if self.engine is None else self.engine.stats

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
        now = Timeline.now()
        remaining = max((max(mean - (now - t.admitted), 0.0) for t in list(self._jobs.values())
                         if t.admitted is not None), default=0.0)
        return max(1, math.ceil(remaining + mean * math.ceil(self.queue_depth() / self.capacity())))

    def working(self) -> bool:
        """A job is on the engine right now (admitted, not waiting)."""
        return self.running() > 0

    def busy(self) -> bool:
        """Jobs anywhere: handed over, waiting in the engine or running (draining waits for none)."""
        return bool(self._jobs) or bool(self._handoff)

    def cancel_all(self, reason: str) -> None:
        for t in list(self._jobs.values()):
            t.job.cancel(reason)
        with self._wake:
            for job in self._handoff:
                job.cancel(reason)
            self._wake.notify()

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
            self._fail_handed_over("the engine worker died")

    @property
    def _loaded(self) -> ServedEngine:
        """The engine, on the worker thread once it is loaded (the thread serves only then)."""
        if self.engine is None:
            raise RuntimeError("the engine is not loaded")
        return self.engine

    def _set(self, state: str, detail: str) -> None:
        self._state, self._detail = state, detail

    def _load(self) -> None:
        c = self.config
        log.info("--> loading target %s, drafter %s (mode %s, %s, %s)", c.target_dir, c.draft_dir, c.mode,
                 c.device, c.dtype)
        started = time.perf_counter()
        self._detail = "loading model"
        engine = self._engine_factory(self.config)
        self.metrics.set_max_acceptance_length(engine.info.limits.block_size)
        log.info("--> loaded in %.1fs; warm-up", time.perf_counter() - started)
        self._detail = "warming up"
        engine.warm_up()  # the engine logs what it ran and how long it took
        _freeze_startup_heap()
        self.engine = engine

    def _serve(self) -> None:
        try:
            while True:
                self._carry()
                if not self._loaded.has_work:
                    if self._stopping:
                        return
                    with self._wake:
                        if not self._handoff:
                            self._wake.wait(IDLE_POLL_S)
                    continue
                self._step()
        except BaseException:  # the thread is dying: no request may wait forever
            for t in self._jobs.values():
                t.job.emit(ErrorEvent(503, "the engine worker died"))
            raise

    def _carry(self) -> None:
        """Into the engine: the jobs handed over (under the lock, so that `submit`'s look at the
        engine's queue counts each job once, handed over or queued), then the cancellations."""
        with self._wake:
            while self._handoff:
                self._start(self._handoff.popleft())
        for t in list(self._jobs.values()):
            if t.job.cancelled.is_set():
                log.info("generation cancelled after %d round(s): %s", t.outputs, t.job.cancel_reason)
                self._finish(t, DoneEvent())

    def _start(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.emit(DoneEvent())
            return
        state, detail = self.health()
        if state != READY:  # handed over before the engine broke
            job.emit(ErrorEvent(503, f"the engine is not ready ({state}): {detail}"))
            return
        try:
            request_id = self._loaded.submit(job.prompt_ids, job.params)
        except ValueError as exc:  # the engine rejected the parameters before doing anything
            job.emit(ErrorEvent(400, str(exc)))
            return
        except Exception as exc:  # the request fails, the worker carries on
            log.exception("engine error at submission")
            job.emit(ErrorEvent(500, f"engine error: {type(exc).__name__}: {exc}"))
            return
        job.timeline.submitted = Timeline.now()
        self._jobs[request_id] = _Tracked(job, request_id)

    def _step(self) -> None:
        """One engine step (admissions, then one round for every running job), then each job's output
        (and its end), and which waiting jobs this step admitted."""
        started = Timeline.now()
        try:
            outputs = self._loaded.step()
        except Exception as exc:  # every job fails; the engine drops them and serves the next
            log.exception("engine error during generation")
            for t in list(self._jobs.values()):
                self._finish(t, ErrorEvent(500, f"engine error: {type(exc).__name__}: {exc}"))
            return
        ended = Timeline.now()
        elapsed = ended - started
        now = time.monotonic()  # the token-rate window's clock
        for t in self._jobs.values():  # in the order they came, which is the order of first admission
            if t.admitted is None:
                if self._loaded.queued(t.request_id):
                    break  # and every job after it waits too
                t.job.timeline.admitted = started
        outbox = _Outbox()
        for request_id, out in outputs:
            t = self._jobs.get(request_id)
            if t is None:
                continue
            if out.error is not None:
                status = 400 if isinstance(out.error, ValueError) else 500
                self._finish(t, ErrorEvent(status, f"{out.error}" if status == 400 else
                                           f"engine error: {type(out.error).__name__}: {out.error}"), outbox)
                continue
            timeline = t.job.timeline
            if t.outputs == 0:  # the engine's first output is the prefill, not a speculative round
                self.metrics.observe_prefill(ended - t.admitted, len(out.token_ids))
                timeline.first_token = ended
            else:
                self.metrics.observe_round(elapsed, out.accepted + 1, len(out.token_ids))
                if t.outputs == 1:
                    timeline.first_round = ended
                timeline.rounds += 1
            t.outputs += 1
            self._committed.append((now, len(out.token_ids)))
            outbox.add(t.job, RoundEvent(out))
            if out.finished:
                self._finish(t, DoneEvent(), outbox)
        outbox.send()
        while self._committed and self._committed[0][0] < now - TOKEN_RATE_WINDOW_S:
            self._committed.popleft()

    def _finish(self, t: _Tracked, event: DoneEvent | ErrorEvent, outbox: _Outbox | None = None) -> None:
        """The job leaves the engine (a no-op there if it already finished) with its last event (sent
        with the step's others when an outbox is given); a job that ran to its end has its timeline
        observed (one that was cancelled or failed would skew it)."""
        del self._jobs[t.request_id]
        self._loaded.cancel(t.request_id)
        if t.admitted is not None:
            self._durations.append(Timeline.now() - t.admitted)
        timeline = t.job.timeline
        timeline.finished = Timeline.now()
        if isinstance(event, DoneEvent) and not t.job.cancelled.is_set() and t.outputs:
            self.metrics.observe_timeline(timeline)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("request %d %s", t.request_id, timeline.summary())
        if outbox is None:
            t.job.emit(event)
        else:
            outbox.add(t.job, event)

    def _fail_handed_over(self, message: str) -> None:
        with self._wake:
            while self._handoff:
                self._handoff.popleft().emit(ErrorEvent(503, message))


def load_engine(config: ServerConfig) -> ServedEngine:
    """The engine the worker builds unless the app is given another factory."""
    from ddtree_runtime.engine import Engine, EngineConfig

    if config.tensor_parallel > 1:  # rank 0 of several: its engine's calls go to every rank
        from ddtree_runtime.server.ranks import lead

        return lead(config)
    return Engine(EngineConfig(**config.engine_kwargs()))

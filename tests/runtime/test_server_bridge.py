"""The server's worker is a bridge to the engine thread with no queue of its own: a request waiting
for a row waits in the engine's scheduler, the 429 is that queue's bound, and cancelling a waiting
request takes it out there."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from ddtree_devtools.faults import Faults, FaultyEngine
from ddtree_runtime.engine import SamplingParams
from ddtree_runtime.server.config import ServerConfig
from ddtree_runtime.server.metrics import Metrics
from ddtree_runtime.server.worker import READY, EngineWorker, Job, QueueFull, load_engine

pytestmark = pytest.mark.slow


def _until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.01)


def test_a_waiting_request_waits_in_the_engines_queue(tiny_models):
    config = ServerConfig(target_dir=str(tiny_models / "target"), draft_dir=str(tiny_models / "draft"),
                          max_running=1, max_queue=1)
    faults = Faults()
    worker = EngineWorker(config, Metrics(), lambda c: FaultyEngine(load_engine(c), faults))
    loop = asyncio.new_event_loop()  # events are queued on it, never read: the engine's side is what counts

    def job() -> Job:
        params = SamplingParams(max_new_tokens=200, mode="ar", ignore_eos=True)
        return Job(prompt_ids=[1, 2, 3], params=params, loop=loop)

    worker.start()
    try:
        _until(lambda: worker.health()[0] == READY)
        faults.round_delay_s = 0.05  # the first job holds the one row for seconds
        engine = worker.engine.inner
        running, waiting = job(), job()
        worker.submit(running)
        _until(lambda: worker.running() == 1)
        worker.submit(waiting)
        _until(lambda: len(engine.scheduler.waiting) == 1)
        assert worker.queue_depth() == 1 and worker.running() == 1
        with pytest.raises(QueueFull):  # --max-queue 1, no free row
            worker.submit(job())
        waiting.cancel("client gone")
        worker.withdraw(waiting)
        _until(lambda: not engine.scheduler.waiting)
        assert worker.queue_depth() == 0 and worker.running() == 1
        worker.submit(job())  # its place is free again
    finally:
        worker.stop()
        loop.close()


def test_a_finished_jobs_timeline_is_in_order_and_observed(tiny_models):
    config = ServerConfig(target_dir=str(tiny_models / "target"), draft_dir=str(tiny_models / "draft"), max_running=2)
    metrics = Metrics()
    worker = EngineWorker(config, metrics)
    loop = asyncio.new_event_loop()
    job = Job(prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=12, ignore_eos=True), loop=loop)
    gc.unfreeze()  # whatever an earlier worker in this process froze
    worker.start()
    try:
        _until(lambda: worker.health()[0] == READY)
        assert gc.get_freeze_count() > 0  # the warm engine's heap is out of the full collections' walk
        worker.submit(job)
        _until(lambda: job.timeline.finished is not None)
    finally:
        worker.stop()
        loop.close()
    t = job.timeline
    stages = [t.arrived, t.handed, t.submitted, t.admitted, t.first_token, t.first_round, t.finished]
    assert None not in stages and stages == sorted(stages)
    assert 1 <= t.rounds <= 11  # 12 tokens: one from the prefill, at least one a round
    assert "ddtree_time_to_first_round_seconds_count 1.0" in metrics.render()

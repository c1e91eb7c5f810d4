"""Tensor-parallel engines in lockstep: every rank runs its own Engine over its shard of the target
(model/parallel.py), and every rank must make the same calls in the same order, since each forward pass
is a series of collectives. Rank 0 (the server) holds a `Leader`: each `submit`, `cancel` and `step` is
broadcast over the gloo control group before rank 0 runs it; the followers (`follow`) receive and run the
same calls on their engines. Decisions that could differ between ranks are made once: free memory is the
least of every rank's (`parallel.agreed_minimum`), an unseeded sampling request gets rank 0's seed. After
each submit and step the ranks compare what they did (a digest of its result); a mismatch, like a lost
rank, calls the leader's `on_lost`, which must stop the whole server (server/ranks.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from ..model import parallel
from ..model.config import target_config
from ..model.parallel import TensorParallel
from ..settings import resolve_device
from .api import EngineInfo
from .engine import Engine
from .types import BatchStats, EngineConfig, RoundOutput, SamplingParams, WarmUp

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

FAILED = -1  # a call's digest when it raised


def join(config: EngineConfig, rank: int, port: int) -> tuple[TensorParallel, EngineConfig]:
    """Join the ranks (rendezvous on 127.0.0.1:port) and return this rank's engine config: on CUDA its
    own GPU, cuda:rank of CUDA_VISIBLE_DEVICES."""
    device = resolve_device(config.device, config.dtype)[0]
    if device.startswith("cuda"):
        if torch.cuda.device_count() < config.tensor_parallel:
            raise ValueError(f"--tensor-parallel {config.tensor_parallel} needs {config.tensor_parallel} GPUs, "
                             f"{torch.cuda.device_count()} are visible (CUDA_VISIBLE_DEVICES)")
        device = f"cuda:{rank}"
    tp = parallel.init(rank, config.tensor_parallel, port, torch.device(device))
    return tp, dataclasses.replace(config, device=device)


def split_problem(target_dir: str, world: int) -> str | None:
    """Why the target in `target_dir` does not split over `world` ranks (model/parallel.py); None when it
    does, or when its config.json cannot be read (the engine's load then says why, as with one rank)."""
    try:
        cfg = target_config(json.loads(Path(target_dir, "config.json").read_text()))
    except (OSError, ValueError, KeyError):
        return None
    return parallel.split_problem(cfg, world)


def digest(outputs: list[tuple[int, RoundOutput]]) -> int:
    """What a step did, as a number every rank must agree on: each request's tokens and whether it ended."""
    return zlib.crc32(repr([(rid, out.token_ids, out.finished) for rid, out in outputs]).encode())


def _agree(tp: TensorParallel, value: int) -> list[int]:
    """Every rank's value, gathered over the control group."""
    mine = torch.tensor([value], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(tp.world)]
    dist.all_gather(every, mine, group=tp.control)
    return [int(t.item()) for t in every]


class Leader:
    """Rank 0's engine: the server's engine interface (api.ServedEngine), each mutating call sent to the
    followers first. The reads (the tokenizer, stats, capacity...) are rank 0's engine's own."""

    def __init__(self, engine: Engine, tp: TensorParallel, on_lost: Callable[[str], NoReturn]) -> None:
        self.engine, self.tp, self.on_lost = engine, tp, on_lost
        # the serving call the ranks are in now (its name, and when it began on time.monotonic()), None
        # between calls: a watchdog (server/ranks.py) gives it a deadline, since a rank that stalls
        # (stopped, or hung on its device) blocks the others' collectives without failing them. The
        # warm-up is not watched: it takes minutes on a large model, and while it runs the server is not
        # ready (a stall there leaves /health "starting", which no request waits behind).
        self.in_call: tuple[str, float] | None = None

    def __getattr__(self, name: str) -> Any:
        """What the interface does not name (a benchmark's look inside rank 0's engine) is its engine's."""
        return getattr(self.engine, name)

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    @property
    def stats(self) -> BatchStats:
        return self.engine.stats

    @property
    def slots(self) -> int:
        return self.engine.slots

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    @property
    def can_serve(self) -> bool:
        return self.engine.can_serve

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    @property
    def queue_depth(self) -> int:
        return self.engine.queue_depth

    def capacity(self) -> dict[str, int]:
        return self.engine.capacity()

    def has_room(self, arriving: int = 0) -> bool:
        return self.engine.has_room(arriving)

    def queued(self, request_id: int) -> bool:
        return self.engine.queued(request_id)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> int:
        if params.temperature > 0 and params.seed is None:  # each rank would draw its own seed
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        return self._replayed(("submit", list(prompt_ids), params), lambda: self.engine.submit(prompt_ids, params),
                              lambda request_id: request_id)

    def cancel(self, request_id: int) -> None:
        with self._call("cancel"):
            self._send(("cancel", request_id))
            self.engine.cancel(request_id)

    def step(self) -> list[tuple[int, RoundOutput]]:
        return self._replayed(("step",), self.engine.step, digest)

    def warm_up(self) -> WarmUp:
        """Engine.warm_up on every rank (its passes are collectives)."""
        return self._replayed(("warm_up",), self.engine.warm_up, lambda done: done.requests, watched=False)

    def _replayed(self, call: tuple, run: Callable[[], Any], summary: Callable[[Any], int],
                  watched: bool = True) -> Any:
        """Send `call` to the followers, run it here, then compare every rank's summary of its result
        (FAILED where it raised): a rank that went another way ends the server."""
        with self._call(call[0]) if watched else contextlib.nullcontext():
            self._send(call)
            try:
                result = run()
            except Exception:
                self._check(call[0], FAILED)
                raise
            self._check(call[0], summary(result))
            return result

    @contextlib.contextmanager
    def _call(self, name: str) -> Iterator[None]:
        self.in_call = (name, time.monotonic())
        try:
            yield
        finally:
            self.in_call = None

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[RoundOutput]:
        """Engine.generate through the broadcast calls (the server's warm-up)."""
        if self.engine.has_work:
            raise RuntimeError("generate() needs an idle engine: use submit() and step() to batch")
        request_id = self.submit(prompt_ids, params)
        return self._follow(request_id)

    def close(self) -> None:
        """End the followers' loops (their engines stay theirs to drop): a benchmark or test that runs
        several engines over the same ranks, one after another."""
        self._send(("stop",))

    def _follow(self, request_id: int) -> Iterator[RoundOutput]:
        try:
            finished = False
            while not finished:
                for rid, out in self.step():
                    if rid == request_id:
                        finished = out.finished
                        yield out
        finally:
            self.cancel(request_id)

    def _send(self, call: tuple) -> None:
        try:
            dist.broadcast_object_list([call], src=0, group=self.tp.control)
        except Exception as exc:  # a rank is gone: the control group is broken for good
            self.on_lost(f"cannot reach the other tensor-parallel ranks: {type(exc).__name__}: {exc}")

    def _check(self, what: str, value: int) -> None:
        try:
            every = _agree(self.tp, value)
        except Exception as exc:
            self.on_lost(f"cannot reach the other tensor-parallel ranks: {type(exc).__name__}: {exc}")
        if len(set(every)) > 1:
            self.on_lost(f"the tensor-parallel ranks disagree after a {what} ({every}): their engines diverged")


def follow(engine: Engine, tp: TensorParallel) -> None:
    """A follower's life: run rank 0's calls on this rank's engine until rank 0 closes its Leader. An
    error in a call is rank 0's too (it runs the same call on the same state) and is left to it; a broken
    control group (rank 0 gone) raises."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=tp.control)
        name, *args = box[0]
        if name == "stop":
            return
        if name == "cancel":
            engine.cancel(*args)
            continue
        try:
            if name == "submit":
                value = engine.submit(*args)
            elif name == "warm_up":
                value = engine.warm_up().requests
            else:
                value = digest(engine.step())
        except Exception as exc:  # noqa: BLE001 - rank 0 reports it to its client
            log.debug("rank %d: %s failed as on rank 0: %r", tp.rank, name, exc)
            value = FAILED
        _agree(tp, value)

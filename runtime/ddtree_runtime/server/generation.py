"""One request's generation: submit a job, turn engine rounds into text, watch for the client leaving.

``Generation.pieces()`` yields text as it becomes safe to show (one item per engine round, possibly
empty) and records the finish reason, token counts, the returned tokens' log-probabilities (when asked
for) and speculative stats as it goes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request

from ddtree_runtime.engine.types import SamplingParams

from ddtree_runtime.server.detok import IncrementalDecoder, StopMatcher
from ddtree_runtime.server.errors import APIError
from ddtree_runtime.server.logprobs import ReturnedToken
from ddtree_runtime.server.timeline import Timeline
from ddtree_runtime.server.worker import DoneEvent, EngineWorker, ErrorEvent, Job, NotReady, QueueFull

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ClientGone(Exception):
    """The client disconnected; nobody reads the answer."""


@dataclass
class _Disconnected:
    pass


@dataclass
class SpeculativeStats:
    mode: str
    tree_budget: int
    rounds: int = 0
    accepted: int = 0

    def as_dict(self) -> dict:
        # Acceptance length of a round = accepted draft tokens + 1 (the target's own token).
        mean = (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0
        return {
            "mode": self.mode,
            "tree_budget": self.tree_budget,
            "rounds": self.rounds,
            "mean_acceptance_length": round(mean, 4),
        }


class Generation:
    def __init__(
        self,
        worker: EngineWorker,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int],
        params: SamplingParams,
        stops: list[str],
        stats: SpeculativeStats,
        hidden_ids: frozenset[int] = frozenset(),
        arrived: float | None = None,
    ) -> None:
        """`arrived`: when the route began to read the request (its timeline's start; now if None)."""
        self._worker = worker
        self._decoder = IncrementalDecoder(tokenizer, hidden_ids)
        self._stops = StopMatcher(stops)
        self._min_tokens = params.min_tokens  # the text of this many tokens cannot end a stop string
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.returned: list[ReturnedToken] = []  # with logprobs asked for: one per counted token
        self._taken = 0  # returned tokens already handed to a stream
        self._offset = 0  # characters decoded so far: where the next token's text starts
        self.finish_reason: str | None = None
        self.stats = stats
        self._job = Job(prompt_ids=prompt_ids, params=params, loop=asyncio.get_running_loop(),
                        timeline=Timeline(Timeline.now() if arrived is None else arrived))
        self._watcher: asyncio.Task | None = None
        self._prefilled = False

    def submit(self, request: Request) -> None:
        """Queue the job (429 when the queue is full, 503 when the engine is not ready)."""
        try:
            self._worker.submit(self._job)
        except QueueFull:
            raise APIError(
                429,
                "the server is busy: the request queue is full, retry later",
                code="queue_full",
                headers={"Retry-After": str(self._worker.retry_after_s())},
            ) from None
        except NotReady as exc:
            raise APIError(503, f"the engine is not ready ({exc.state}): {exc.detail}", code="engine_unavailable") from None
        self._watcher = asyncio.create_task(self._watch_disconnect(request))

    async def _watch_disconnect(self, request: Request) -> None:
        # The body is already read, so the next ASGI message is http.disconnect: the client left, or
        # (harmlessly) the response was completed.
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                break
        self.cancel("client disconnected")
        self._job.events.put_nowait(_Disconnected())

    def cancel(self, reason: str) -> None:
        """Stop the job: between rounds if it runs, at once (off the queue) if it still waits."""
        self._job.cancel(reason)
        self._worker.withdraw(self._job)

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "speculative": self.stats.as_dict(),
        }

    async def pieces(self):
        """Async iterator of text pieces; raises APIError (engine failure) or ClientGone."""
        try:
            while True:
                event = await self._job.events.get()
                if isinstance(event, _Disconnected):
                    raise ClientGone()
                if isinstance(event, ErrorEvent):
                    raise APIError(event.status, event.message, code="engine_error" if event.status >= 500 else None)
                if isinstance(event, DoneEvent):
                    # The engine stopped without saying it finished: we cancelled it.
                    if self._job.cancel_reason == "shutdown":
                        raise APIError(503, "the server is shutting down", code="shutting_down")
                    yield self._finish(self.finish_reason or "stop")
                    return
                out = event.output
                if self._prefilled:  # the first output is the prefill's token, not a speculative round
                    self.stats.rounds += 1
                    self.stats.accepted += out.accepted
                self._prefilled = True
                text = self._release(out.token_ids, out.logprobs)
                if self._stops.stopped:
                    self._job.cancel("stop string")
                    self.finish_reason = "stop"
                    yield text
                    return
                if out.finished:
                    yield text + self._finish(out.finish_reason or "stop")
                    return
                yield text
        finally:
            self.cancel("request finished")
            if self._watcher is not None:
                self._watcher.cancel()

    def take_returned(self) -> list[ReturnedToken]:
        """The returned tokens (with log-probabilities) not yet taken: a stream's next chunk carries them."""
        new, self._taken = self.returned[self._taken:], len(self.returned)
        return new

    def _release(self, token_ids: list[int], logprobs: list | None) -> str:
        """The text of a round's tokens, decoded one token at a time: tokens after the one that
        completes a stop string are neither shown nor counted (nor their log-probabilities returned),
        so a reply's usage is the same in every mode (an AR step ends at that token; a speculative
        round may have committed more past it)."""
        pieces = []
        for i, token in enumerate(token_ids):
            self.completion_tokens += 1
            text = self._decoder.push([token])
            if logprobs is not None:
                self.returned.append(ReturnedToken(token, logprobs[i], self._offset))
            self._offset += len(text)
            pieces.append(self._stops.push(text, armed=self.completion_tokens > self._min_tokens))
            if self._stops.stopped:
                break
        return "".join(pieces)

    def _finish(self, reason: str) -> str:
        text = self._stops.push(self._decoder.flush(), armed=self.completion_tokens > self._min_tokens)
        if self._stops.stopped:
            self.finish_reason = "stop"
            return text
        self.finish_reason = reason
        return text + self._stops.flush()

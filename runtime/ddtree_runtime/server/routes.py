"""The OpenAI-compatible endpoints, /health and /metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from ddtree_runtime.engine.api import ServedEngine
from ddtree_runtime.server.context import Prepared, ServerContext
from ddtree_runtime.server.errors import APIError, error_body
from ddtree_runtime.server.generation import ClientGone, Generation
from ddtree_runtime.server.logprobs import ReturnedToken, TokenTexts, chat_content, completion_logprobs
from ddtree_runtime.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ddtree_runtime.server.output_parsers import ReplyPiece, ReplySplitter
from ddtree_runtime.server.schemas import ChatCompletionRequest, CompletionRequest
from ddtree_runtime.server.timeline import Timeline
from ddtree_runtime.server.worker import READY

router = APIRouter()
log = logging.getLogger("ddtree_runtime.server")

# Status for a request whose client left before the answer (nginx's convention; never sent).
CLIENT_CLOSED = 499


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ddtree


# What /health tells a caller without the API key, when one is set: the state a balancer or probe acts
# on, and the serving shape ddops's health gate checks. Model and drafter names, architecture, budget,
# uptime and error details (paths, exception text) need the key.
PUBLIC_HEALTH = ("status", "mode", "block_size")


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    ctx = _ctx(request)
    state, detail = ctx.worker.health()
    engine = ctx.worker.engine
    uptime = round(time.monotonic() - ctx.started, 3)
    if state == READY and ctx.draining:
        body, code = {"status": "draining", "detail": "shutting down", "uptime_s": uptime}, 503
    elif state != READY or engine is None:
        body, code = {"status": state, "detail": detail, "uptime_s": uptime}, 503
    else:
        body, code = {"status": "ok", **ctx.describe(engine), "uptime_s": uptime}, 200
    if not ctx.authorized(request):
        body = {key: value for key, value in body.items() if key in PUBLIC_HEALTH}
    return JSONResponse(body, status_code=code)


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    ctx = _ctx(request)
    ctx.authorize(request)  # a scraper sends the key (Prometheus: `authorization: {credentials: ...}`)
    return PlainTextResponse(ctx.metrics.render(), media_type=METRICS_CONTENT_TYPE)


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    ctx = _ctx(request)
    ctx.authorize(request)
    name = ctx.model_name()
    return JSONResponse(
        {"object": "list", "data": [{"id": name, "object": "model", "created": ctx.created, "owned_by": "ddtree"}]}
    )


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _generate(request, _ctx(request).prepare_chat)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _generate(request, _ctx(request).prepare_completion)


async def _generate(request: Request, prepare: Callable[[ServedEngine, bytes], Prepared]) -> Response:
    """Chat and text completions alike, once `prepare` has parsed the body its own way (on the prep
    thread): the request's generation, answered in its shape (a chat reply when it has a splitter)."""
    arrived = Timeline.now()
    ctx = _ctx(request)
    ctx.authorize(request)
    engine = ctx.engine_for_requests()
    raw = await _read_body(request, ctx)
    prepared = await ctx.off_loop(prepare, engine, raw)
    gen = ctx.start_generation(engine, request, prepared, arrived)
    chat = prepared.splitter is not None
    shape = _Shape(prepared.splitter, ctx.model_name(), chat and bool(ctx.config.reasoning_parser),
                   ctx.token_texts(engine, prepared.req))
    return await _respond(request, gen, prepared.req, shape)


async def _read_body(request: Request, ctx: ServerContext) -> bytes:
    """The body, or a 413 as soon as it is known to exceed --max-body: from Content-Length before
    reading anything, else while the chunks arrive (nothing past the limit is kept). A body still
    arriving when the server starts to drain is refused like a new request (503): an upload that may
    never finish is not work in flight, and must not hold the shutdown."""
    limit = ctx.config.max_body
    too_large = APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                         code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    draining = asyncio.ensure_future(ctx.uploads_stopped().wait())
    try:
        while True:
            message = asyncio.ensure_future(request.receive())
            await asyncio.wait({message, draining}, return_when=asyncio.FIRST_COMPLETED)
            if not message.done():
                message.cancel()
                raise APIError(503, "the server is shutting down", code="shutting_down",
                               headers={"Connection": "close"})
            message = message.result()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            size += len(message.get("body", b""))
            if size > limit:
                raise too_large
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)
    finally:
        draining.cancel()


async def _respond(request: Request, gen: Generation, req: ChatCompletionRequest | CompletionRequest,
                   shape: "_Shape") -> Response:
    """The answer to a chat request or a text completion, in `shape`'s form."""
    pieces = gen.pieces()
    if not req.stream:
        try:
            text = "".join([piece async for piece in pieces])
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(shape.full(text, gen))
    # Wait for the first round before answering, so a request that fails before generating anything
    # gets a proper HTTP error status instead of an error inside a 200 stream.
    try:
        first = await anext(pieces)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(
        _sse(shape, gen, first, pieces, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _sse(shape: "_Shape", gen: Generation, first: str, rest: AsyncIterator[str], include_usage: bool):
    """The stream's events. Once the headers are sent an error can only travel as an event: every
    failure, a bug's too, ends the stream with an error event and [DONE], never a cut connection."""
    try:
        if shape.chat:
            yield _event(shape.chunk({"role": "assistant", "content": ""}))
        shape.carry(gen.take_returned())
        for delta in shape.deltas(first):
            yield _event(shape.chunk(delta))
        async for piece in rest:
            shape.carry(gen.take_returned())
            for delta in shape.deltas(piece):
                yield _event(shape.chunk(delta))
        shape.carry(gen.take_returned())
        for delta in shape.deltas("", final=True):
            yield _event(shape.chunk(delta))
        final = shape.chunk({}, finish=shape.finish_reason(gen))
        final["speculative"] = gen.stats.as_dict()
        yield _event(final)
        if include_usage:
            yield _event({**shape.envelope(), "choices": [], "usage": gen.usage()})
        yield "data: [DONE]\n\n"
    except ClientGone:
        return
    except APIError as exc:
        yield _event(exc.body())
        yield "data: [DONE]\n\n"
    except Exception as exc:  # a server bug: logged as one, and the client still told the stream is over
        log.exception("unexpected error while streaming")
        yield _event(error_body(500, f"internal error: {type(exc).__name__}"))
        yield "data: [DONE]\n\n"
    finally:
        gen.cancel("stream closed")


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Shape:
    """The OpenAI response and chunk objects for chat (the reply split into reasoning, content and
    tool calls) or text completions, with the returned tokens' log-probabilities when `texts` is set
    (the request asked for them). A stream's tokens ride on the next chunk it sends (text held back
    for a stop string or an unfinished character waits, so its tokens wait too); all the chunks'
    entries together are the unstreamed reply's."""

    def __init__(self, splitter: ReplySplitter | None, model: str, reasoning: bool,
                 texts: TokenTexts | None = None) -> None:
        self.splitter = splitter
        self.chat = splitter is not None
        self.reasoning = reasoning
        self.model = model
        self.texts = texts
        self._carried: list[ReturnedToken] = []  # streamed tokens not yet sent in a chunk
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def envelope(self, stream: bool = True) -> dict:
        if self.chat:
            obj = "chat.completion.chunk" if stream else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def finish_reason(self, gen: Generation) -> str | None:
        """The generation's, but "tool_calls" when a reply that ended by itself called tools."""
        if self.chat and self.splitter.calls and gen.finish_reason == "stop":
            return "tool_calls"
        return gen.finish_reason

    def carry(self, tokens: list[ReturnedToken]) -> None:
        self._carried += tokens

    def logprobs(self, tokens: list[ReturnedToken]) -> dict | None:
        """The choice's logprobs object for these tokens (None when not asked for)."""
        if self.texts is None:
            return None
        if self.chat:
            return {"content": chat_content(self.texts, tokens), "refusal": None}
        return completion_logprobs(self.texts, tokens)

    def full(self, text: str, gen: Generation) -> dict:
        logprobs = self.logprobs(gen.returned)
        if not self.chat:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": gen.finish_reason}
            return {**self.envelope(stream=False), "choices": [choice], "usage": gen.usage()}
        head, tail = self.splitter.push(text), self.splitter.finish()
        calls = head.calls + tail.calls
        content = head.content + tail.content
        message: dict = {"role": "assistant", "content": content if content or not calls else None}
        if self.reasoning:
            message["reasoning_content"] = (head.reasoning + tail.reasoning) or None
        if calls:
            message["tool_calls"] = [call.as_dict() for call in calls]
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": self.finish_reason(gen)}
        return {**self.envelope(stream=False), "choices": [choice], "usage": gen.usage()}

    def deltas(self, text: str, final: bool = False) -> list[dict]:
        """The chunk deltas (chat) or texts (completions) a piece of the reply makes; none if it adds
        nothing showable yet. A tool call streams as two deltas: its id and name, then its arguments."""
        if not self.chat:
            return [{"text": text}] if text else []
        piece: ReplyPiece = self.splitter.finish() if final else self.splitter.push(text)
        out: list[dict] = []
        if piece.reasoning:
            out.append({"reasoning_content": piece.reasoning})
        if piece.content:
            out.append({"content": piece.content})
        for call in piece.calls:
            out.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": call.index, "function": {"arguments": call.arguments}}]})
        return out

    def chunk(self, delta: dict, finish: str | None = None) -> dict:
        """A chunk with this delta, carrying the tokens that came since the last chunk."""
        logprobs = self.logprobs(self._carried) if self._carried else None
        self._carried = []
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta.get("text", ""), "logprobs": logprobs, "finish_reason": finish}
        return {**self.envelope(), "choices": [choice]}

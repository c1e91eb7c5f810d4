"""Server-wide state shared by the routes: config, worker, metrics, drain flag; request preparation."""

from __future__ import annotations

import asyncio
import hmac
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request

from ddtree_runtime.engine.api import CONTEXT_LENGTH_EXCEEDED, RequestRefused, ServedEngine
from ddtree_runtime.engine.modes import mode_named
from ddtree_runtime.engine.types import SamplingParams
from ddtree_runtime.server.config import ServerConfig
from ddtree_runtime.server.errors import APIError
from ddtree_runtime.server.generation import Generation, SpeculativeStats
from ddtree_runtime.server.logprobs import TokenTexts
from ddtree_runtime.server.metrics import Metrics
from ddtree_runtime.server.output_parsers import (
    CALL_END,
    CALL_START,
    THINK_END,
    THINK_START,
    TOOL_PARSERS,
    ReasoningParser,
    ReplySplitter,
    ToolCallParser,
    tool_schemas,
)
from ddtree_runtime.server.prompts import ChatPrompt, ControlTokens, render_chat
from ddtree_runtime.server.schemas import ChatCompletionRequest, CompletionRequest, parse_body, validate
from ddtree_runtime.server.worker import READY, EngineWorker

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send temperature=0 for greedy decoding
# How each target architecture's chat template writes tool calls (SGLang's parser names).
TOOL_PARSER_FOR_ARCH = {"qwen3": "hermes", "qwen3_5": "qwen3_coder"}
# Tags the reply parsers read: decoded into the text even where the tokenizer calls them special.
PARSER_TAGS = (THINK_START, THINK_END, CALL_START, CALL_END)
# The API's names of the engine's request fields where they differ (RequestRefused.field -> param).
FIELD_PARAMS = {"max_new_tokens": "max_tokens", "mode": "speculative.mode", "tree_budget": "speculative.tree_budget"}
T = TypeVar("T")


@dataclass
class Prepared:
    """A chat or completion request after its own parsing: from here both take one path."""
    req: ChatCompletionRequest | CompletionRequest
    prompt_ids: list[int]
    params: SamplingParams  # checked against the engine's limits
    stats: SpeculativeStats
    splitter: ReplySplitter | None  # how a chat reply is split (reasoning, content, tool calls); None: text


class ServerContext:
    def __init__(self, config: ServerConfig, worker: EngineWorker, metrics: Metrics) -> None:
        self.config = config
        self.worker = worker
        self.metrics = metrics
        self.started = time.monotonic()
        self.created = int(time.time())
        self.draining = False
        self._uploads_stopped: asyncio.Event | None = None  # set once draining: bodies still arriving are refused
        self.in_flight = 0  # API requests between arrival and last byte (kept by the app's middleware)
        # Parsing, validation, chat templates and tokenization run here, never on the event loop, so
        # /health and /metrics answer at once whatever a client sends. One thread: the engine serves
        # one request at a time anyway, and a tokenizer is not safe to use from several at once.
        self.prep_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddtree-prep")
        self._preparing = 0  # requests on the prep thread or waiting for it (bounded like the engine's queue)
        self._controls: ControlTokens | None = None  # the engine's tokenizer's, made on first use
        self._token_texts: TokenTexts | None = None  # likewise

    def uploads_stopped(self) -> asyncio.Event:
        """Set when the drain starts (by the server's tick, on the event loop)."""
        if self._uploads_stopped is None:
            self._uploads_stopped = asyncio.Event()
        return self._uploads_stopped

    # -- identity --

    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        engine = self.worker.engine
        if engine is not None:
            return engine.info.model_name
        return os.path.basename(os.path.normpath(self.config.target_dir))

    def describe(self, engine: ServedEngine) -> dict:
        """/health's account of a ready server and its engine."""
        info, mode = engine.info, self.config.mode
        block = info.limits.block_size
        return {
            "mode": mode,
            "block_size": block,
            "max_draft_len": block - 1 if mode_named(mode).drafts else 0,
            "tree_budget": self.config.tree_budget,
            "model": self.model_name(),
            "target_arch": info.arch,
            "draft_model": info.draft_name,
            **({"draft_vocab": info.draft_vocab} if info.draft_vocab else {}),
            "quantization": info.quantization,
            **({"fp8_gemm": info.fp8_gemm} if info.fp8_gemm else {}),
            "tensor_parallel": self.config.tensor_parallel,  # GPUs (processes) this server spans
            "max_running": self.worker.capacity(),
            "running": self.worker.running(),
            "waiting": self.worker.queue_depth(),
            # the KV pool (engine.capacity()): tokens, pages, requests of 8K and of the full context
            "kv_pool": engine.capacity(),
        }

    # -- gates --

    def authorize(self, request: Request) -> None:
        """401 (with the challenge RFC 6750 asks for) unless the request carries the API key, if one is set."""
        problem = self._key_problem(request)
        if problem:
            raise APIError(401, problem, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def authorized(self, request: Request) -> bool:
        return self._key_problem(request) is None

    def _key_problem(self, request: Request) -> str | None:
        key = self.config.api_key
        if not key:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return "missing API key: send 'Authorization: Bearer <key>'"
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            return "incorrect API key"
        return None

    def engine_for_requests(self) -> ServedEngine:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        state, detail = self.worker.health()
        engine = self.worker.engine
        if state != READY or engine is None:
            raise APIError(503, f"the engine is not ready ({state}): {detail}", code="engine_unavailable")
        return engine

    def max_tree_budget(self) -> int:
        """The largest tree budget a request may ask for: --max-tree-budget, or the server's own budget
        if that is larger (a request may always ask for what the server runs by default)."""
        return max(self.config.max_tree_budget, self.config.tree_budget)

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name():
            raise APIError(
                404,
                f"the model '{requested}' does not exist; this server serves '{self.model_name()}'",
                param="model",
                code="model_not_found",
            )

    # -- prompts (on the prep thread) --

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """`work` on the prep thread. Its wait is bounded like the engine's queue: past as many requests
        waiting for it as the server takes at once (the running ones and --max-queue behind them; one
        more is being prepared), a 429 at once. A burst no bigger than that is never refused here."""
        if self._preparing > self.config.max_queue + self.worker.capacity():
            raise APIError(429, "the server is busy: too many requests are being prepared, retry later",
                           code="queue_full", headers={"Retry-After": str(self.worker.retry_after_s())})
        self._preparing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.prep_pool, work, *args)
        finally:
            self._preparing -= 1

    def prepare_chat(self, engine: ServedEngine, raw: bytes) -> Prepared:
        req = validate(ChatCompletionRequest, parse_body(raw))
        self.check_model(req.model)
        prompt = render_chat(engine.tokenizer, self.control_tokens(engine), req, self.config.chat_template_kwargs,
                             self.tool_parser(engine) if req.offered_tools() else None,
                             max_tokens=engine.info.limits.max_context - 1)
        return self._checked(engine, req, prompt.ids, "messages", self.reply_splitter(engine, req, prompt))

    def prepare_completion(self, engine: ServedEngine, raw: bytes) -> Prepared:
        req = validate(CompletionRequest, parse_body(raw))
        self.check_model(req.model)
        return self._checked(engine, req, self.completion_prompt_ids(engine, req), "prompt", None)

    def _checked(self, engine: ServedEngine, req: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int],
                 prompt_param: str, splitter: ReplySplitter | None) -> Prepared:
        """The request's engine parameters, checked against the engine's limits (the one check the engine
        publishes, run here so that a refusal is a 400 before the request is queued)."""
        limits = engine.info.limits
        max_tokens = req.requested_max_tokens()
        if max_tokens is None:  # the rest of the context
            max_tokens = limits.max_context - len(prompt_ids)
            if req.min_tokens and 0 < max_tokens < req.min_tokens:
                raise APIError(
                    400,
                    f"min_tokens: {req.min_tokens} is more than the {max_tokens} tokens left in this model's "
                    f"{limits.max_context}-token context after {len(prompt_ids)} prompt tokens (the most "
                    "max_tokens can be)", param="min_tokens", code=CONTEXT_LENGTH_EXCEEDED)
        spec = req.speculative
        mode = (spec.mode if spec else None) or self.config.mode
        budget = (spec.tree_budget if spec else None) or self.config.tree_budget
        cap = self.max_tree_budget()
        if budget > cap:
            raise APIError(400, f"speculative.tree_budget: {budget} is more than this server's limit of {cap} "
                           "(its --max-tree-budget)", param="speculative.tree_budget")
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            top_k=max(req.top_k or 0, 0),
            min_p=req.min_p or 0.0,
            logit_bias=req.token_bias(),
            stop_token_ids=frozenset(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens or 0,
            logprobs=req.requested_logprobs(),
            mode=spec.mode if spec else None,
            tree_budget=spec.tree_budget if spec else None,
        )
        try:
            limits.check(prompt_ids, params)
        except RequestRefused as exc:
            param = prompt_param if exc.field == "prompt" else FIELD_PARAMS.get(exc.field, exc.field)
            raise APIError(400, str(exc), param=param, code=exc.code) from None
        return Prepared(req, prompt_ids, params, SpeculativeStats(mode, budget), splitter)

    def token_texts(self, engine: ServedEngine, req: ChatCompletionRequest | CompletionRequest) -> TokenTexts | None:
        """How returned tokens are shown beside their log-probabilities; None unless the request asked."""
        if req.requested_logprobs() is None:
            return None
        if self._token_texts is None:
            self._token_texts = TokenTexts(engine.tokenizer)
        return self._token_texts

    def control_tokens(self, engine: ServedEngine) -> ControlTokens:
        if self._controls is None:
            self._controls = ControlTokens(engine.tokenizer)
        return self._controls

    def tool_parser(self, engine: ServedEngine) -> type[ToolCallParser]:
        name = self.config.tool_call_parser or TOOL_PARSER_FOR_ARCH.get(engine.info.arch, "hermes")
        return TOOL_PARSERS[name]

    def reply_splitter(self, engine: ServedEngine, req: ChatCompletionRequest, prompt: ChatPrompt) -> ReplySplitter:
        """How the chat reply's text is split into reasoning, content and tool calls for this request."""
        reasoning = ReasoningParser(prompt.opens_thinking) if self.config.reasoning_parser else None
        offered = req.offered_tools()
        tools = None
        if offered:
            tools = self.tool_parser(engine)(tool_schemas(t.as_template_dict() for t in offered))
        return ReplySplitter(reasoning, tools, prompt.opening)

    def hidden_ids(self, engine: ServedEngine, skip_special_tokens: bool) -> frozenset[int]:
        """The control tokens left out of the text: all special ones but the tags the parsers read."""
        if not skip_special_tokens:
            return frozenset()
        tok = engine.tokenizer
        tags = {tok.convert_tokens_to_ids(tag) for tag in PARSER_TAGS}
        return frozenset(tok.all_special_ids) - tags

    def completion_prompt_ids(self, engine: ServedEngine, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            self.control_tokens(engine).check_fits(req.prompt, engine.info.limits.max_context - 1, "prompt")
            return list(engine.tokenizer.encode(req.prompt, add_special_tokens=False))
        return list(req.prompt)

    # -- generation --

    def start_generation(self, engine: ServedEngine, request: Request, prepared: Prepared,
                         arrived: float | None = None) -> Generation:
        req = prepared.req
        gen = Generation(self.worker, engine.tokenizer, prepared.prompt_ids, prepared.params, req.stop_strings(),
                         prepared.stats, self.hidden_ids(engine, req.skip_special_tokens), arrived)
        gen.submit(request)
        return gen

"""Server-wide state shared by the routes: config, worker, metrics, drain flag; request preparation."""

from __future__ import annotations

import asyncio
import hmac
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from starlette.requests import Request

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
from ddtree_runtime.server.worker import READY, EngineWorker, engine_block_size

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send temperature=0 for greedy decoding
# How each target architecture's chat template writes tool calls (SGLang's parser names).
TOOL_PARSER_FOR_ARCH = {"qwen3": "hermes", "qwen3_5": "qwen3_coder"}
# Tags the reply parsers read: decoded into the text even where the tokenizer calls them special.
PARSER_TAGS = (THINK_START, THINK_END, CALL_START, CALL_END)
T = TypeVar("T")


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
        name = getattr(engine, "model_name", None) if engine is not None else None
        return name or os.path.basename(os.path.normpath(self.config.target_dir))

    def describe(self) -> dict:
        from ddtree_runtime.engine.modes import mode_named

        engine = self.worker.engine
        mode = self.config.mode
        block = engine_block_size(engine)
        return {
            "mode": mode,
            "block_size": block,
            "max_draft_len": block - 1 if mode_named(mode).drafts and block is not None else 0,
            "tree_budget": self.config.tree_budget,
            "model": self.model_name(),
            "target_arch": getattr(engine, "arch", None),
            "draft_model": getattr(engine, "draft_name", None),
            "quantization": getattr(engine, "quantization", None),
            **({"fp8_gemm": engine.fp8_gemm} if getattr(engine, "fp8_gemm", None) else {}),
            "tensor_parallel": self.config.tensor_parallel,  # GPUs (processes) this server spans
            "max_running": self.worker.capacity(),
            "running": self.worker.running(),
            "waiting": self.worker.queue_depth(),
            # the KV pool (engine.capacity()): tokens, pages, requests of 8K and of the full context
            "kv_pool": engine.capacity() if hasattr(engine, "capacity") else None,
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

    def engine_for_requests(self) -> Any:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        state, detail = self.worker.health()
        if state != READY:
            raise APIError(503, f"the engine is not ready ({state}): {detail}", code="engine_unavailable")
        return self.worker.engine

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

    def prepare_chat(self, engine: Any, raw: bytes) -> tuple[ChatCompletionRequest, ChatPrompt]:
        req = validate(ChatCompletionRequest, parse_body(raw))
        self.check_model(req.model)
        self.check_token_ids(engine, req)
        prompt = render_chat(engine.tokenizer, self.control_tokens(engine), req, self.config.chat_template_kwargs,
                             self.tool_parser(engine) if req.offered_tools() else None,
                             max_tokens=engine.max_context - 1)
        return req, prompt

    def prepare_completion(self, engine: Any, raw: bytes) -> tuple[CompletionRequest, list[int]]:
        req = validate(CompletionRequest, parse_body(raw))
        self.check_model(req.model)
        self.check_token_ids(engine, req)
        return req, self.completion_prompt_ids(engine, req)

    def check_token_ids(self, engine: Any, req: Any) -> None:
        vocab = len(engine.tokenizer)
        for field, ids in (("logit_bias", req.token_bias()), ("stop_token_ids", req.stop_token_ids or ())):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"{field}: token id {bad} is outside the vocabulary (0..{vocab - 1})",
                               param=field)

    def token_texts(self, engine: Any, req: Any) -> TokenTexts | None:
        """How returned tokens are shown beside their log-probabilities; None unless the request asked."""
        if req.requested_logprobs() is None:
            return None
        if self._token_texts is None:
            self._token_texts = TokenTexts(engine.tokenizer)
        return self._token_texts

    def control_tokens(self, engine: Any) -> ControlTokens:
        if self._controls is None:
            self._controls = ControlTokens(engine.tokenizer)
        return self._controls

    def tool_parser(self, engine: Any) -> type[ToolCallParser]:
        name = self.config.tool_call_parser or TOOL_PARSER_FOR_ARCH.get(getattr(engine, "arch", None), "hermes")
        return TOOL_PARSERS[name]

    def reply_splitter(self, engine: Any, req: ChatCompletionRequest, prompt: ChatPrompt) -> ReplySplitter:
        """How the chat reply's text is split into reasoning, content and tool calls for this request."""
        reasoning = ReasoningParser(prompt.opens_thinking) if self.config.reasoning_parser else None
        offered = req.offered_tools()
        tools = None
        if offered:
            tools = self.tool_parser(engine)(tool_schemas(t.as_template_dict() for t in offered))
        return ReplySplitter(reasoning, tools, prompt.opening)

    def hidden_ids(self, engine: Any, skip_special_tokens: bool) -> frozenset[int]:
        """The control tokens left out of the text: all special ones but the tags the parsers read."""
        if not skip_special_tokens:
            return frozenset()
        tok = engine.tokenizer
        tags = {tok.convert_tokens_to_ids(tag) for tag in PARSER_TAGS}
        return frozenset(tok.all_special_ids) - tags

    def completion_prompt_ids(self, engine: Any, req: Any) -> list[int]:
        if isinstance(req.prompt, str):
            self.control_tokens(engine).check_fits(req.prompt, engine.max_context - 1, "prompt")
            ids = list(engine.tokenizer.encode(req.prompt, add_special_tokens=False))
            if not ids:
                raise APIError(400, "prompt: encodes to no tokens", param="prompt")
            return ids
        vocab = len(engine.tokenizer)
        bad = [t for t in req.prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        return list(req.prompt)

    # -- generation --

    def start_generation(
        self, engine: Any, request: Request, prompt_ids: list[int], req: Any, max_tokens: int | None,
        arrived: float | None = None,
    ) -> Generation:
        from ddtree_runtime.engine import SamplingParams
        from ddtree_runtime.engine.modes import mode_named

        limit = engine.max_context
        if len(prompt_ids) >= limit:
            raise APIError(
                400,
                f"the prompt is {len(prompt_ids)} tokens; this model's context is {limit} tokens",
                param="messages" if hasattr(req, "messages") else "prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = limit - len(prompt_ids)
            if req.min_tokens and req.min_tokens > max_tokens:
                raise APIError(
                    400,
                    f"min_tokens: {req.min_tokens} is more than the {max_tokens} tokens left in this model's "
                    f"{limit}-token context after {len(prompt_ids)} prompt tokens (the most max_tokens can be)",
                    param="min_tokens",
                    code="context_length_exceeded",
                )
        elif len(prompt_ids) + max_tokens > limit:
            raise APIError(
                400,
                f"this model's context is {limit} tokens, but {len(prompt_ids)} prompt tokens + "
                f"max_tokens {max_tokens} = {len(prompt_ids) + max_tokens}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        spec = req.speculative
        mode = (spec.mode if spec else None) or self.config.mode
        budget = (spec.tree_budget if spec else None) or self.config.tree_budget
        cap = self.max_tree_budget()
        if budget > cap:
            raise APIError(400, f"speculative.tree_budget: {budget} is more than this server's limit of {cap} "
                           "(its --max-tree-budget)", param="speculative.tree_budget")
        if mode_named(mode).drafts and getattr(engine, "draft_name", None) is None and not self.config.draft_dir:
            raise APIError(400, f"speculative.mode: '{mode}' needs a draft model; this server has none", param="speculative.mode")
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
        gen = Generation(
            self.worker, engine.tokenizer, prompt_ids, params, req.stop_strings(), SpeculativeStats(mode, budget),
            self.hidden_ids(engine, req.skip_special_tokens), arrived,
        )
        gen.submit(request)
        return gen

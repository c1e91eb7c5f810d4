"""The engine as the server sees it: the seam between them, typed.

`ServedEngine` is everything the server (server/) calls on an engine: `Engine`, the tensor-parallel
`Leader` (engine/distributed.py) and the test faults' wrapper all are one. `EngineInfo` is what an
engine is once loaded (its names and shape, for /health), and `RequestLimits` the limits every request
is checked against: the server checks a request with them on its prep thread, before it is queued, and
`Engine.submit` runs the same check for callers that come to it directly, so a request's validity is
written once, here. A refusal is a `RequestRefused` (a ValueError) naming the field at fault."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..capacity import round_reserve
from ..limits import MAX_LOGPROBS, MAX_TREE_BUDGET, MIN_TREE_BUDGET
from .modes import mode_named
from .types import BatchStats, RoundOutput, SamplingParams, WarmUp

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the OpenAI code for a request over the context


class RequestRefused(ValueError):
    """A request this engine can never serve. `field` is the SamplingParams field at fault ("prompt"
    for the prompt, None for the whole request), `code` a machine-readable reason where there is one."""

    def __init__(self, message: str, field: str | None, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.code = code


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of this engine: its context, its vocabulary, the modes its models run,
    the tree budgets and what its KV pool holds."""
    max_context: int
    vocab_size: int            # token ids a request may name: 0..vocab_size-1 (the target's)
    has_drafter: bool
    mode: str                  # the engine's default mode and tree budget
    tree_budget: int
    block_size: int            # the drafter's block (1 with none)
    page_size: int             # the pool's pages: how many, of how many tokens
    pool_pages: int

    def tree_slots(self, params: SamplingParams) -> int:
        """Nodes (root included) of the request's round: what the pool reserves for it each round."""
        return mode_named(params.mode or self.mode).tree_slots(self.budget(params), self.block_size)

    def budget(self, params: SamplingParams) -> int:
        return self.tree_budget if params.tree_budget is None else params.tree_budget

    def check(self, prompt_ids: Sequence[int], p: SamplingParams) -> None:
        """RequestRefused unless a request of this prompt and these parameters can be served."""
        try:
            mode = mode_named(p.mode or self.mode)
        except ValueError as exc:
            raise RequestRefused(str(exc), "mode") from None
        if mode.drafts and not self.has_drafter:
            raise RequestRefused(f"mode {mode.name!r} needs a draft model; this engine has none", "mode")
        budget = self.budget(p)
        if not MIN_TREE_BUDGET <= budget <= MAX_TREE_BUDGET:
            raise RequestRefused(f"tree_budget must be in [{MIN_TREE_BUDGET}, {MAX_TREE_BUDGET}], got {budget}",
                                 "tree_budget")
        if not prompt_ids:
            raise RequestRefused("prompt is empty", "prompt")
        self.check_ids("prompt", prompt_ids)
        length, limit = len(prompt_ids), self.max_context
        if length >= limit:
            raise RequestRefused(f"the prompt is {length} tokens; this model's context is {limit} tokens", "prompt",
                                 CONTEXT_LENGTH_EXCEEDED)
        if p.max_new_tokens < 1:
            raise RequestRefused("max_new_tokens must be >= 1", "max_new_tokens")
        if length + p.max_new_tokens > limit:
            raise RequestRefused(f"this model's context is {limit} tokens, but {length} prompt tokens + "
                                 f"{p.max_new_tokens} new tokens = {length + p.max_new_tokens}", "max_new_tokens",
                                 CONTEXT_LENGTH_EXCEEDED)
        if p.temperature < 0:
            raise RequestRefused("temperature must be >= 0", "temperature")
        if not 0 < p.top_p <= 1:
            raise RequestRefused("top_p must be in (0, 1]", "top_p")
        if not 0 <= p.min_tokens <= p.max_new_tokens:
            raise RequestRefused(f"min_tokens must be in [0, max_new_tokens = {p.max_new_tokens}], got "
                                 f"{p.min_tokens}", "min_tokens")
        if p.logprobs is not None and not 0 <= p.logprobs <= MAX_LOGPROBS:
            raise RequestRefused(f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}", "logprobs")
        self.check_ids("logit_bias", p.logit_bias)
        self.check_ids("stop_token_ids", p.stop_token_ids)
        tree_slots = mode.tree_slots(budget, self.block_size)
        need = self.request_pages(length + p.max_new_tokens - 1, tree_slots)
        if need > self.pool_pages:
            raise RequestRefused(f"prompt ({length}) + max_new_tokens ({p.max_new_tokens}) needs {need} KV pages "
                                 f"of {self.page_size} tokens, the pool holds {self.pool_pages}: shorten the "
                                 f"prompt or lower max_tokens", None)

    def check_ids(self, field: str, ids: Sequence[int] | dict[int, float] | frozenset[int]) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRefused(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})", field)

    def request_pages(self, tokens: int, tree_slots: int) -> int:
        """Pages a request of `tokens` tokens holds with one round's reservation (memory.PoolSizing's)."""
        return -(-(tokens + round_reserve(tree_slots, self.block_size)) // self.page_size)


@dataclass(frozen=True)
class EngineInfo:
    """What a loaded engine is, for /health and the request checks; fixed for its life."""
    model_name: str
    arch: str                  # "qwen3" or "qwen3_5"
    draft_name: str | None
    quantization: str          # what the target's projections are: "fp8" or "none"
    limits: RequestLimits
    fp8_gemm: str | None = None  # with FP8, the GEMM path chosen for this GPU at load (model/fp8.py)
    draft_vocab: int | None = None  # tokens the drafter may propose (--draft-vocab); None: the whole vocabulary


class ServedEngine(Protocol):
    """The engine's calls the server makes, on its one engine thread (submit, cancel, step, warm_up) or
    from any thread (the reads: info, stats, capacity, has_room, queue_depth, queued, can_serve)."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def stats(self) -> BatchStats: ...

    @property
    def slots(self) -> int: ...  # requests run at once

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def can_serve(self) -> bool: ...

    @property
    def has_work(self) -> bool: ...

    @property
    def queue_depth(self) -> int: ...

    def capacity(self) -> dict[str, int]: ...

    def has_room(self, arriving: int = 0) -> bool: ...

    def queued(self, request_id: int) -> bool: ...

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> int: ...

    def cancel(self, request_id: int) -> None: ...

    def step(self) -> list[tuple[int, RoundOutput]]: ...

    def warm_up(self) -> WarmUp: ...

"""Plain dataclasses the server codes against."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..settings import ENGINE_SETTINGS, config_class

if TYPE_CHECKING:
    from .modes import Mode
    from .policy import Acceptance
    from .sampling import PendingLogprobs

# What the engine loads and how it serves: the engine settings of the serve table (settings.py), with
# the same names and defaults as the server's flags; draft_dir None only for mode "ar", block_size None:
# the drafter's, max_context None: the target's positions as far as memory holds.
EngineConfig = config_class("EngineConfig", __name__, ENGINE_SETTINGS, "The engine's settings (settings.py).",
                            frozen=False)


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # Position-independent changes to the target's distribution, applied at every tree node alike, so
    # speculative decoding stays exact with them (the same tokens as AR for the same seed).
    top_k: int = 0                  # keep the k most likely tokens; 0: all
    min_p: float = 0.0              # drop tokens below min_p x the most likely one's probability
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    stop_token_ids: frozenset[int] = frozenset()  # the engine adds the tokenizer's eos ids itself
    ignore_eos: bool = False        # ... unless this is set: then only stop_token_ids end the generation
    # Depth-dependent, and still exact: a tree node knows which output token it chooses (the tokens
    # emitted so far + its depth), so the stop tokens are masked at the nodes that choose one of the first
    # min_tokens tokens, and nowhere else.
    min_tokens: int = 0             # no stop token (stop_token_ids, and eos unless ignore_eos) before this many
    # The target's own log-probabilities of the tokens it commits, from the verify pass: of its raw
    # distribution (before logit_bias, min_tokens, temperature, top-k/p, min-p), as vLLM returns them by
    # default. None: none are computed; k: the chosen token's and the k most likely tokens' (0..MAX_LOGPROBS).
    logprobs: int | None = None
    mode: str | None = None         # per-request override of mode
    tree_budget: int | None = None  # per-request override of budget


@dataclass
class TokenLogprob:
    """One committed token's log-probability under the target's raw distribution, and the most likely
    tokens' (token id, log-probability), most likely first."""
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RoundOutput:
    token_ids: list[int]        # newly committed this round, truncated at a stop token / max_new_tokens
    accepted: int               # draft tokens accepted by verification (0 for ar and the prefill round)
    finished: bool
    finish_reason: str | None   # "stop" | "length" | "error" | None
    error: Exception | None = None  # with "error": why the request failed (ValueError: the request's fault)
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked for them


@dataclass(eq=False)  # compared by identity: the scheduler finds a request in its queues
class RequestState:
    """Everything one generation carries between rounds."""
    id: int
    prompt_ids: list[int]
    mode: "Mode"
    budget: int
    params: SamplingParams
    stop_ids: frozenset[int]
    uniforms: torch.Tensor | None  # [max_new_tokens + block] one draw per output position (T > 0), sampling.py
    slot: int = -1            # the cache pool row it holds while prefilling or running
    prefilled: int = 0        # prompt tokens already in the cache
    n_ctx: int = 0            # tokens whose KV sits in the target cache (all committed but the bonus)
    bonus: int = -1           # last committed token: next round's tree root
    generated: int = 0        # tokens emitted so far
    produced: list[int] = field(default_factory=list)  # every token committed (the cache holds prompt +
    #                           produced[:-1]; a round cut at a stop may commit more than it emits)
    reused: int = 0           # prompt tokens whose cache came from a cached sequence
    draft_ctx: int = 0        # positions of the drafter's context inherited with them (AR requests)
    placed: bool = False      # its row has been set up for it (a cached prefix looked for)
    snapshot_at: int = 0      # where a hybrid's prompt state is kept for later reuse (prefix_cache.py)
    drafted: torch.Tensor | None = None  # [block-1, V] draft logits for the next round, queued on the device
    ahead: torch.Tensor | None = None    # [1, 1] a lone AR step run ahead: its token, chosen, not yet read
    ahead_logprobs: "PendingLogprobs | None" = None  # its log-probabilities, on their way to the host
    # a drafting row's pass run ahead: its drafter features [1, F] and position [1], copied out, staged
    # for the drafter's context once the pass is committed (never, if the request ends before)
    ahead_context: tuple[torch.Tensor, torch.Tensor] | None = None
    stop_tensor: torch.Tensor | None = None  # stop_ids on the device, while min_tokens masks them
    rounds: int = 0
    accepted_total: int = 0
    finished: bool = False
    # the tokens a prefill computes: the prompt, or after a preemption the prompt and all it produced
    # but the last token (which is then the next round's root again: resume_bonus)
    context: list[int] = field(default_factory=list)
    resume_bonus: int | None = None
    admitted: int = -1        # admission order (preemption takes the newest first)
    preempted: int = 0        # times it was preempted (its pages given back, recomputed later)
    acceptance: "Acceptance" = field(default_factory=lambda: _acceptance())  # its outlook (policy.py)

    def __post_init__(self) -> None:
        if not self.context:
            self.context = self.prompt_ids

    def emits(self, tokens: list[int]) -> int:
        """How many of a round's tokens the request emits: up to the first stop token or
        max_new_tokens. A round that finishes the request commits only those, so the cache it leaves
        behind ends where the client's text does, which is where a next turn can continue it (a
        hybrid's state cannot be wound back to there later)."""
        for i, t in enumerate(tokens):
            if t in self.stop_ids or self.generated + i + 1 >= self.params.max_new_tokens:
                return i + 1
        return len(tokens)


@dataclass(frozen=True)
class Piece:
    """Prompt tokens start..start+length-1 of a request, to prefill in one target pass. `keep_at`: a
    hybrid keeps its state that many tokens in, for the prefix cache (None: nowhere in this piece)."""
    req: RequestState
    start: int
    length: int
    keep_at: int | None = None

    @property
    def ends_prompt(self) -> bool:
        return self.start + self.length == len(self.req.context)


@dataclass
class Batch:
    """What one step computes, as the scheduler decided it (scheduler.py), for the runner to run
    (model_runner.py): the prompt passes, in order, then one round for the requests decoding."""
    prefills: list[list[Piece]] = field(default_factory=list)  # a pass: one piece, or last pieces of
    #                                               prompts in consecutive rows (attention-only targets)
    decoding: list[RequestState] = field(default_factory=list)  # rows 0..B-1, one round each
    budgets: list[int] = field(default_factory=list)  # each decoding request's tree budget this round
    resize: int | None = None  # the target pool re-sized for trees of this many nodes first (the engine idle)
    # requests whose prompts complete this step and whose first draft waits for their first tree round
    # (policy.BudgetPolicy.drafts_with_prompt: the round they join is predicted plain AR)
    drafts_later: frozenset[int] = frozenset()


# A round's result for one request: the tokens it committed, the draft tokens accepted among them, and
# their log-probabilities (None unless the request asked for them).
Round = tuple[list[int], int, "list[TokenLogprob] | None"]


@dataclass
class StepResult:
    """What the runner computed for a Batch: each prompt it completed, with its first token (None: a
    recomputed request's, already known) and that token's log-probabilities; each decoding request's
    round; or why the pool could not be re-sized."""
    firsts: list[tuple[RequestState, int | None, "list[TokenLogprob] | None"]] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    # each decoding row's drafter forecast (policy.py: accepted tokens at each candidate budget, then at
    # the budget run), None where no tree was forecast
    forecasts: list[list[float] | None] = field(default_factory=list)
    error: Exception | None = None


@dataclass(frozen=True)
class WarmUp:
    """What Engine.warm_up ran (the server's start-up line, the benchmarks)."""
    seconds: float
    batches: tuple[int, ...]  # the batch sizes its rounds ran at, one prefill group each
    requests: int
    graph_captures: int
    per_batch_s: tuple[float, ...] = ()  # seconds each of `batches` took, in order (the first pays the compiles)
    compile_workers: dict = field(default_factory=dict)  # what compile_pool's workers did (CompilePool.summary)


@dataclass
class BatchStats:
    """The last step's shape, for /metrics."""
    running: int = 0          # requests in the batch (decoding)
    waiting: int = 0          # requests queued, not yet admitted (prefilling one excluded)
    batch_size: int = 0       # rows of the last verify pass (0: no round ran)
    tree_nodes: int = 0       # real tree nodes (roots included) verified in the last round
    prefill_tokens: int = 0   # prompt tokens prefilled in the last step
    prefill_passes: int = 0   # ... in this many target passes (a burst of short prompts shares one)
    rounds: int = 0           # steps that ran a round, since start
    prefix_lookups: int = 0   # since start: admissions that looked for a cached prefix
    prefix_hits: int = 0      # ... that reused one
    prefix_tokens_saved: int = 0  # prompt tokens reused instead of prefilled
    prefix_evictions: int = 0     # cached sequences dropped for room
    prefix_cached: int = 0        # cached sequences held now
    pages_total: int = 0          # the KV pool's pages (page_size tokens each, target and drafter)
    pages_used: int = 0           # ... held by running, prefilling and cached sequences now
    pages_shared: int = 0         # ... held by more than one sequence (shared prompt prefixes)
    preemptions: int = 0          # since start: requests whose pages were taken back (recomputed later)
    graph_captures: int = 0       # since start, the warm-up's left out: CUDA graphs captured while serving
    round_budget: int = 0         # the largest tree budget of the last round (0: plain AR)
    predicted_tokens_per_s: float = 0.0  # what the cost policy predicted for it (0: not chosen by cost)
    budget_rounds: dict[int, int] = field(default_factory=dict)  # since start: rounds by round_budget


def _acceptance() -> "Acceptance":
    from .policy import Acceptance  # policy.py imports the runner, which imports these types
    return Acceptance()

"""The DDTree engine: prefill, then rounds of draft -> build tree -> verify -> accept & commit.

One request at a time (batch size 1). Both KV caches are allocated once at start-up for the worst case
(max_context plus the largest tree) and reused by every request."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from ..model import DFlashDrafter, Qwen35Config, Qwen3ForCausalLM, load_drafter, load_target
from ..model.layers import fuse_projections
from .context import prefill_workspace_bytes, serving_context
from .prefill import prefill
from .kv_cache import KVCache, target_cache, target_cache_bytes
from .runner import DraftRunner, TargetRunner, tree_bucket
from .sampling import choose_tokens
from .graphs import HostRead
from .tree import TreeBuilder, Walk, build_chain, walk
from ..limits import DTYPE_NAMES, MAX_TREE_BUDGET, MIN_BLOCK_SIZE, MIN_TREE_BUDGET, MODES
from .types import EngineConfig, RequestState, RoundOutput, SamplingParams


def _eos_ids(tokenizer, target_dir: str) -> set[int]:
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_cfg = Path(target_dir) / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


def _free_bytes(device: torch.device) -> int:
    """Memory a new allocation can take: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # blocks the caching allocator holds but nothing uses
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Engine:
    def __init__(self, config: EngineConfig, *, target: Qwen3ForCausalLM | None = None,
                 drafter: DFlashDrafter | None = None, tokenizer=None) -> None:
        """Load the models named by `config`, or take ready ones (the GPU benchmark builds randomly
        initialised models of real shapes: there are no weights to load and `tokenizer` may be None)."""
        from transformers import AutoTokenizer

        if config.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {config.mode!r}")
        if config.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {config.dtype!r}")
        if config.draft_dir is None and drafter is None and config.mode != "ar":
            raise ValueError(f"mode {config.mode!r} needs a draft_dir")
        if not MIN_TREE_BUDGET <= config.tree_budget <= MAX_TREE_BUDGET:
            raise ValueError(f"tree_budget must be in [{MIN_TREE_BUDGET}, {MAX_TREE_BUDGET}]")
        self.config = config
        self.device = torch.device(config.device)
        self.tokenizer = AutoTokenizer.from_pretrained(config.target_dir) if target is None else tokenizer
        self.model_name = Path(config.target_dir).resolve().name
        self.draft_name = Path(config.draft_dir).resolve().name if config.draft_dir else None
        # phase_hook(name) is called as each phase of a round starts ("draft", "tree", "verify",
        # "commit", "step" for AR) and with "end" after it: the benchmark's instrumented mode times
        # phases with it; None (the default) costs nothing
        self.phase_hook = None

        self.target: Qwen3ForCausalLM = (load_target(config.target_dir, config.device, config.dtype)
                                         if target is None else target)
        fuse_projections(self.target)
        tcfg = self.target.config
        self.arch = "qwen3_5" if isinstance(tcfg, Qwen35Config) else "qwen3"  # reported by /health
        self.eos_ids = _eos_ids(self.tokenizer, config.target_dir)

        self.drafter: DFlashDrafter | None = drafter
        self.block_size = 1
        if config.draft_dir and drafter is None:
            self.drafter = load_drafter(config.draft_dir, config.device, config.dtype)
        if self.drafter is not None:
            fuse_projections(self.drafter)
            dcfg = self.drafter.config
            if dcfg.hidden_size != tcfg.hidden_size:
                raise ValueError("drafter hidden_size differs from the target's")
            self.block_size = config.block_size or dcfg.block_size
            if self.block_size < MIN_BLOCK_SIZE:
                raise ValueError(f"block_size must be >= {MIN_BLOCK_SIZE} (the root plus at least one draft position)")
            self.mask_token_id = dcfg.mask_token_id
            self.target.feature_layers = list(dcfg.target_layer_ids)
        # sized with both models' weights in place, before any cache
        self.max_context = serving_context(config.max_context, tcfg.max_position_embeddings, self._needed_bytes,
                                           _free_bytes(self.device), str(self.device))
        if self.drafter is not None:
            dcfg = self.drafter.config
            draft_capacity = DraftRunner.capacity_for(self.max_context, self.block_size)
            # refuse before allocating anything: both caches must fit together
            self._refuse_unless_fits(max(config.tree_budget, self.block_size) + 1, extra=target_cache_bytes(
                dcfg, draft_capacity, 1, self.target.lm_head.weight.element_size()))
            self.draft_cache = KVCache(dcfg.num_hidden_layers, dcfg.num_key_value_heads, dcfg.head_dim,
                                       draft_capacity, self.device, self.target.lm_head.weight.dtype)
            self.draft_runner = DraftRunner(self.target, self.drafter, self.draft_cache, self.block_size,
                                            self.mask_token_id, self.device)
        self.target_cache: KVCache | None = None
        self.runner: TargetRunner | None = None
        self._target_slots = 0  # the tree size the target cache was sized for
        self._alloc_target_cache(max(config.tree_budget, self.block_size) + 1)
        self.trees = TreeBuilder(self.device)
        self.readback = HostRead(Walk.size(self.block_size - 1), self.device)  # the round's one read
        self.root_node = torch.zeros(1, dtype=torch.long, device=self.device)  # an AR step's path, [0]

    @property
    def can_serve(self) -> bool:
        """False only if a re-allocation failed after the old cache was dropped and the old one could
        not be put back (the server's /health reports it)."""
        return self.target_cache is not None and self.runner is not None

    def _alloc_target_cache(self, tree_slots: int) -> None:
        """Size the target cache for the context and a tree of tree_slots nodes; ValueError when the
        device cannot hold it, raised before anything is dropped, so a budget too big fails at start,
        plainly, and a request refused for one leaves the engine exactly as it was."""
        previous = self._target_slots
        self._refuse_unless_fits(tree_slots, reclaimable=self._target_cache_bytes(previous) if previous else 0)
        # drop the old cache and the graphs captured over it (and their memory pool) before sizing anew
        self.target_cache = self.runner = None
        self._target_slots = 0
        try:
            self._build_target_cache(tree_slots)
        except BaseException:
            if previous:  # put back what served before (if this fails too, can_serve stays False)
                self._build_target_cache(previous)
            raise

    def _build_target_cache(self, tree_slots: int) -> None:
        cfg, dtype = self.target.config, self.target.lm_head.weight.dtype
        capacity, nodes = TargetRunner.capacity_for(self.max_context, tree_slots), tree_bucket(tree_slots)
        self.target_cache = target_cache(cfg, capacity, self.device, dtype, nodes=nodes)
        self.runner = TargetRunner(self.target, self.target_cache, self.device, max_depth=self.block_size - 1)
        self._target_slots = tree_slots

    def _target_cache_bytes(self, tree_slots: int) -> int:
        return target_cache_bytes(self.target.config, TargetRunner.capacity_for(self.max_context, tree_slots),
                                  tree_bucket(tree_slots), self.target.lm_head.weight.element_size())

    def _needed_bytes(self, context: int) -> int:
        """What serving `context` tokens takes: both caches at the configured tree size and a prefill's
        activations."""
        elem = self.target.lm_head.weight.element_size()
        tree_slots = max(self.config.tree_budget, self.block_size) + 1
        need = target_cache_bytes(self.target.config, TargetRunner.capacity_for(context, tree_slots),
                                  tree_bucket(tree_slots), elem)
        if self.drafter is not None:
            need += target_cache_bytes(self.drafter.config, DraftRunner.capacity_for(context, self.block_size), 1, elem)
        return need + prefill_workspace_bytes(self.target.config, context, len(self.target.feature_layers), elem)

    def _refuse_unless_fits(self, tree_slots: int, extra: int = 0, reclaimable: int = 0) -> None:
        """ValueError unless the caches for tree_slots (+ extra bytes) fit in what is free, counting
        the `reclaimable` bytes the current target cache gives back when it is replaced."""
        cfg = self.target.config
        need = extra + self._target_cache_bytes(tree_slots)
        free = _free_bytes(self.device) + reclaimable
        if need > free:
            what = " and recurrent-state scratch" if isinstance(cfg, Qwen35Config) else ""
            raise ValueError(
                f"tree budget {tree_slots - 1} at context {self.max_context} needs {need / 2**30:.1f} GiB "
                f"for the caches{what}, but {free / 2**30:.1f} GiB of {self.device} is free: "
                f"lower the tree budget or max context")

    # ---- public API -------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[RoundOutput]:
        """Validate now (ValueError), then return a generator of rounds; close it to cancel."""
        req = self._new_request(prompt_ids, params)
        return self._rounds(list(prompt_ids), req)

    # ---- request setup ----------------------------------------------------------------------------

    def _new_request(self, prompt_ids: list[int], p: SamplingParams) -> RequestState:
        mode = p.mode or self.config.mode
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode != "ar" and self.drafter is None:
            raise ValueError(f"mode {mode!r} needs a drafter; this engine has none")
        budget = self.config.tree_budget if p.tree_budget is None else p.tree_budget
        if not MIN_TREE_BUDGET <= budget <= MAX_TREE_BUDGET:
            raise ValueError(f"tree_budget must be in [{MIN_TREE_BUDGET}, {MAX_TREE_BUDGET}], got {budget}")
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if p.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if len(prompt_ids) + p.max_new_tokens > self.max_context:
            raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({p.max_new_tokens}) "
                             f"exceeds the context limit {self.max_context}")
        vocab = self.target.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if p.temperature < 0 or not 0 < p.top_p <= 1:
            raise ValueError("need temperature >= 0 and 0 < top_p <= 1")
        slots = {"ar": 1, "dflash": self.block_size, "ddtree": budget + 1}[mode]
        if not self.target_cache.holds(TargetRunner.capacity_for(self.max_context, slots), tree_bucket(slots)):
            self._alloc_target_cache(slots)  # rare: a request asks for a bigger tree than configured
        gen = None
        if p.temperature > 0:
            gen = torch.Generator(device=self.device)
            if p.seed is None:
                gen.seed()
            else:
                gen.manual_seed(p.seed)
        return RequestState(mode=mode, budget=budget, params=p,
                            stop_ids=frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids),
                            generator=gen)

    def _rounds(self, prompt_ids: list[int], req: RequestState) -> Iterator[RoundOutput]:
        # no grad-mode context manager spans a yield: the phases below each run in inference mode
        out = self._emit(req, [self._prefill(req, prompt_ids)], 0)
        yield out
        while not out.finished:
            tokens, accepted = self._ar_step(req) if req.mode == "ar" else self._spec_round(req)
            req.rounds += 1
            req.accepted_total += accepted
            out = self._emit(req, tokens, accepted)
            yield out

    def _emit(self, req: RequestState, tokens: list[int], accepted: int) -> RoundOutput:
        """Cut the round's tokens at the first stop token or at max_new_tokens."""
        kept: list[int] = []
        for t in tokens:
            kept.append(t)
            req.generated += 1
            if t in req.stop_ids:
                return RoundOutput(kept, accepted, True, "stop")
            if req.generated >= req.params.max_new_tokens:
                return RoundOutput(kept, accepted, True, "length")
        return RoundOutput(kept, accepted, False, None)

    def _phase(self, name: str) -> None:
        if self.phase_hook is not None:
            self.phase_hook(name)

    def _choose(self, req: RequestState, logits: torch.Tensor) -> torch.Tensor:
        return choose_tokens(logits, req.params, req.generator)

    # ---- phases -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def _prefill(self, req: RequestState, prompt_ids: list[int]) -> int:
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)  # [1, P]
        h, feats = prefill(self.target, ids, self.target_cache)                 # [1, 1, H], [1, P, F]
        first = int(self._choose(req, self.target.logits(h[0, -1:]))[0])
        req.n_ctx, req.bonus, req.prompt_feats = ids.shape[1], first, feats
        return first

    @torch.inference_mode()
    def _ar_step(self, req: RequestState) -> tuple[list[int], int]:
        """One token; the next step is queued (from the device's token) before this one's token is
        read, so the device never waits for the host between steps."""
        self._phase("step")
        token = req.ahead
        if token is None:  # the first step after the prefill
            token = self._choose(req, self.runner.run(req.bonus, req.n_ctx).logits)
        self.target_cache.compact(req.n_ctx, [0], self.root_node)  # no-op for KV; advances a recurrent state
        req.n_ctx += 1
        self.readback.start(token)
        req.ahead = self._choose(req, self.runner.run(token, req.n_ctx).logits)
        req.bonus = self.readback.wait()[0]
        self._phase("end")
        return [req.bonus], 0

    @torch.inference_mode()
    def _spec_round(self, req: RequestState) -> tuple[list[int], int]:
        """Build the tree from the draft, verify, choose and walk, then queue the next round's drafter
        pass from the walk's device-side result: one host sync a round (the walk's result), and the
        device is busy with the next draft while the host reads it."""
        depth = self.block_size - 1 if req.mode == "dflash" else min(self.block_size - 1, req.budget)
        if req.drafted is None:  # the first round: the drafter takes in the whole prompt
            self._phase("draft")
            req.drafted = self._draft_prompt(req, depth)
        self._phase("tree")
        if req.mode == "dflash":
            tree = build_chain(req.drafted)
        else:
            tree = self.trees.build(req.drafted, req.budget)
        self._phase("verify")
        out = self.runner.run(req.bonus, req.n_ctx, tree)               # logits [N, V], feats [1, N, F]
        self._phase("commit")
        target = self._choose(req, out.logits)                          # the target's token per node
        result = walk(out.tokens, out.parents, out.depths, out.mask, target, self.block_size - 1)
        self.readback.start(result)
        self._phase("draft")
        length, bonus, rows = Walk.on_device(result, self.block_size - 1)
        req.drafted = self.draft_runner.run(bonus, length, rows, out.feats, req.n_ctx)[:depth]
        self._phase("commit")
        accepted = Walk.read(self.readback.wait(), self.block_size - 1)
        # the accepted path's KV, moved to right after the context (by the walk's own device copy of it)
        self.target_cache.compact(req.n_ctx, accepted.path, rows[:len(accepted.path)])
        req.n_ctx += len(accepted.path)
        req.bonus = accepted.next_token
        self._phase("end")
        return accepted.tokens[1:] + [req.bonus], len(accepted.path) - 1

    def _draft_prompt(self, req: RequestState, depth: int) -> torch.Tensor:
        """The first drafter pass of a request, eager: its context is every prompt position (features
        from the prefill) plus the block [bonus, MASK * (block_size-1)] -> logits for depths 1..depth."""
        n, bs = req.n_ctx, self.block_size
        block = torch.full((1, bs), self.mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0] = req.bonus
        emb = self.target.model.embed_tokens(block)                     # [1, bs, H]
        block_pos = torch.arange(n, n + bs, device=self.device)[None]
        ctx_pos = torch.arange(n, device=self.device)[None]
        h = self.drafter(emb, block_pos, req.prompt_feats, ctx_pos, self.draft_cache)
        req.prompt_feats = None
        return self.target.logits(h[0, 1:depth + 1])

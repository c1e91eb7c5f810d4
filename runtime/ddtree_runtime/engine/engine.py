"""The DDTree engine: prefill, then rounds of draft -> build tree -> verify -> accept & commit.

Continuous batching: `submit` queues a request, each `step` reserves the pages the running requests'
next round can write (preempting the newest when the pool runs out), prefills up to one chunk of
prompt tokens (admitting queued requests while their prompt and a first round fit) and runs one round
for every request already decoding: all their trees verified by one target pass, then each its own
walk and commit, and one drafter pass for all. A lone request takes the single-stream path (graphed,
one host sync a round).

Memory: a KV pool of fixed-size pages counted in tokens (block_manager.py), sized once at start-up
from free memory, holding the target's and the drafter's KV; each of the max_running rows maps its
positions to pages through a block table, and takes pages as it grows. A hybrid target's recurrent
state is one slot per row, apart from the pages. A preempted request gives its pages back and is
recomputed later from its tokens (prompt and output so far; its sampling generator kept), so its
output does not change. A request that leaves keeps its row and pages as a cached sequence until the
row or its pages are needed, and a prompt that starts with a running or cached sequence's tokens takes
that prefix's full pages by reference and skips its prefill (prefix_cache.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from ..model import DFlashDrafter, Qwen35Config, Qwen3ForCausalLM, load_drafter, load_target
from ..model.fp8 import FP8Linear
from ..model.layers import TreeInputs, fuse_projections
from .batch_runner import BatchDraftRunner, BatchTargetRunner
from .block_manager import BlockManager, PageTable
from .context import prefill_workspace_bytes, serving_context
from .graphs import HostRead
from .kv_cache import KVCache, target_cache, target_cache_bytes
from .prefill import PREFILL_PIECE
from .pool import KVPool, round_reserve
from .prefix_cache import CachedSequence, PrefixCache, common_prefix, snapshot_point
from .runner import KV_BUCKET, TREE_BUCKETS, DraftRunner, TargetRunner, tree_bucket
from .sampling import PendingLogprobs, choose_tokens, start_logprobs, suppress_stops
from .scheduler import Scheduler
from .modes import mode_named
from .tree import Tree, TreeBuilder, Walk, walk, walk_rows
from ..limits import DTYPE_NAMES, MAX_LOGPROBS, MAX_TREE_BUDGET, MIN_BLOCK_SIZE, MIN_TREE_BUDGET, QUANTIZE_METHODS
from ..settings import resolve_device
from .types import BatchStats, EngineConfig, RequestState, RoundOutput, SamplingParams, TokenLogprob

log = logging.getLogger(__name__)

# A round's result for one request: the tokens it committed, the draft tokens accepted among them, and
# their log-probabilities (None unless the request asked for them).
Round = tuple[list[int], int, list[TokenLogprob] | None]

# Requests of this many tokens the start-up line counts the pool in (besides the full context).
CAPACITY_PROBE = 8192

# The most attention-bias elements (rows x queries x keys) one grouped prefill pass builds (_group_holds):
# 64M, 128 MB in 16 bits; a group that would need more runs as several passes.
GROUP_BIAS = 1 << 26


def _eos_ids(tokenizer, target_dir: str) -> set[int]:
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_cfg = Path(target_dir) / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


def _turn_token(tokenizer) -> int | None:
    """The chat template's turn-start token (ChatML's <|im_start|>, all Qwen templates), if it has one."""
    if tokenizer is None:
        return None
    token = tokenizer.convert_tokens_to_ids("<|im_start|>")
    return token if isinstance(token, int) and token != tokenizer.unk_token_id else None


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

        if config.device is None or config.dtype is None:  # the settings' defaults: the GPU when there is one
            config = dataclasses.replace(config, **dict(zip(("device", "dtype"),
                                                            resolve_device(config.device, config.dtype))))
        mode = mode_named(config.mode)  # ValueError for a name it does not know
        if config.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {config.dtype!r}")
        if config.draft_dir is None and drafter is None and mode.drafts:
            raise ValueError(f"mode {config.mode!r} needs a draft_dir")
        if not MIN_TREE_BUDGET <= config.tree_budget <= MAX_TREE_BUDGET:
            raise ValueError(f"tree_budget must be in [{MIN_TREE_BUDGET}, {MAX_TREE_BUDGET}]")
        if config.max_running < 1 or config.prefill_chunk < 1 or not 0 < config.mem_fraction <= 1:
            raise ValueError("need max_running >= 1, prefill_chunk >= 1 and 0 < mem_fraction <= 1")
        if config.round_nodes is not None and config.round_nodes < 1:
            raise ValueError("round_nodes must be >= 1 (or None: fixed tree budgets)")
        if config.prefix_cache_rows < 0:
            raise ValueError("prefix_cache_rows must be >= 0")
        if config.quantization not in QUANTIZE_METHODS:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_METHODS)}")
        if config.quantize_drafter and config.quantization == "none":
            raise ValueError("quantize_drafter needs a quantize method (fp8)")
        if config.page_size < 1 or (config.kv_pool_tokens is not None and config.kv_pool_tokens < 1):
            raise ValueError("need page_size >= 1 and kv_pool_tokens >= 1 (or None: from free memory)")
        self.config = config
        self.device = torch.device(config.device)
        self.tokenizer = AutoTokenizer.from_pretrained(config.target_dir) if target is None else tokenizer
        self.model_name = Path(config.target_dir).resolve().name
        self.draft_name = Path(config.draft_dir).resolve().name if config.draft_dir else None
        # phase_hook(name) is called as each phase of a round starts ("draft", "tree", "verify",
        # "commit", "step" for AR) and with "end" after it: the benchmark's instrumented mode times
        # phases with it; None (the default) costs nothing
        self.phase_hook = None

        self.target: Qwen3ForCausalLM = (load_target(config.target_dir, config.device, config.dtype, config.quantization)
                                         if target is None else target)
        fuse_projections(self.target)
        tcfg = self.target.config
        self.arch = "qwen3_5" if isinstance(tcfg, Qwen35Config) else "qwen3"  # reported by /health
        # what the target's projections are (the checkpoint's, or --quantize's), also for /health
        self.quantization = "fp8" if any(isinstance(m, FP8Linear) for m in self.target.modules()) else "none"
        self.eos_ids = _eos_ids(self.tokenizer, config.target_dir)

        self.drafter: DFlashDrafter | None = drafter
        self.block_size = 1
        if config.draft_dir and drafter is None:
            self.drafter = load_drafter(config.draft_dir, config.device, config.dtype,
                                        config.quantization if config.quantize_drafter else "none")
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
        tree_slots = max(config.tree_budget, self.block_size) + 1
        # finished requests' rows kept for prefix reuse; a hybrid reuses only where a state was kept
        self.prefix = PrefixCache(snapshots_only=self.arch == "qwen3_5") if config.prefix_cache else None
        self.turn_token = _turn_token(self.tokenizer)  # where a hybrid's prompt state is kept (prefix_cache.py)
        self.page_size = config.page_size
        # sized with both models' weights in place, before any cache: the context one request can have,
        # then the rows (max_running, and those that only hold cached sequences), then the pages
        self.max_context = serving_context(config.max_context, tcfg.max_position_embeddings, self._needed_bytes,
                                           _free_bytes(self.device), str(self.device))
        extra = config.prefix_cache_rows if config.prefix_cache else 0
        self.rows = config.max_running + extra   # the pool's rows (block tables, a hybrid's state slots)
        self.slots = config.max_running          # of them, running requests'
        self.pages = BlockManager(self._pages_that_fit(tree_slots), self.page_size)
        self.page_table = PageTable(self.pages, self.rows, -(-self._row_capacity() // self.page_size), self.device)
        self.pool = KVPool(self.pages, self.page_table, self.prefix, self.block_size, self.max_context)
        if self.drafter is not None:
            dcfg = self.drafter.config
            self.draft_cache = KVCache(dcfg.num_hidden_layers, dcfg.num_key_value_heads, dcfg.head_dim, 0,
                                       self.device, self.target.lm_head.weight.dtype, table=self.page_table)
            self.pool.draft_cache = self.draft_cache
            self.draft_runner = DraftRunner(self.target, self.drafter, self.draft_cache.rows(0, 1), self.block_size,
                                            self.mask_token_id, self.device)
            self.batch_draft = BatchDraftRunner(self.target, self.drafter, self.draft_cache, self.block_size,
                                                self.mask_token_id, self.device)
        self.target_cache: KVCache | None = None
        self.runner: TargetRunner | None = None
        self._resizing = False  # between dropping the old pool and the new one (or the old) being in place
        self._alloc_target_cache(tree_slots)
        self.trees = TreeBuilder(self.device)
        self.readback = HostRead(Walk.size(self.block_size - 1), self.device)  # the round's one read
        self.batch_readback = HostRead(self.slots * Walk.size(self.block_size - 1), self.device)
        self.root_node = torch.zeros(1, dtype=torch.long, device=self.device)  # an AR step's path, [0]
        self.stats = BatchStats(pages_total=self.pages.num_pages)
        self.scheduler = Scheduler(self.slots, config.max_queue, self.pool, self.stats, self._alloc_target_cache,
                                   has_drafter=self.drafter is not None)
        self._next_id = 0
        cap = self.capacity()
        log.info("KV pool: %d tokens (%d pages x %d); holds %d requests of %d tokens, %d of the full context "
                 "(%d); %d running at most", cap["tokens"], cap["pages_total"], self.page_size, cap["requests_8k"],
                 CAPACITY_PROBE, cap["requests_full_context"], self.max_context, self.slots)

    # ---- memory -----------------------------------------------------------------------------------

    def _page_bytes(self) -> int:
        """One page: page_size positions of the target's KV and the drafter's."""
        cfg, elem = self.target.config, self.target.lm_head.weight.element_size()
        need = KVCache.page_bytes(cfg.kv_layers, cfg.num_key_value_heads, cfg.head_dim, self.page_size, elem)
        if self.drafter is not None:
            d = self.drafter.config
            need += KVCache.page_bytes(d.num_hidden_layers, d.num_key_value_heads, d.head_dim, self.page_size, elem)
        return need

    def _row_bytes(self, tree_slots: int) -> int:
        """What a row costs beside its pages: a hybrid's state slot and tree scratch (none otherwise)."""
        cfg, elem = self.target.config, self.target.lm_head.weight.element_size()
        return target_cache_bytes(cfg, 0, tree_bucket(tree_slots), elem, snapshots=self.prefix is not None)

    def _row_capacity(self) -> int:
        """Logical positions a block table addresses: the context, the largest round's writes, and a
        bucket beyond, where pad rows write (never backed by a page: the scratch page)."""
        largest = max(round_reserve(MAX_TREE_BUDGET + 1, self.block_size), TREE_BUCKETS[-1])
        return -(-(self.max_context + largest) // KV_BUCKET) * KV_BUCKET + KV_BUCKET

    def _request_pages(self, tokens: int, tree_slots: int) -> int:
        return -(-(tokens + round_reserve(tree_slots, self.block_size)) // self.page_size)

    def _prefill_bytes(self, context: int) -> int:
        """A prefill's activations at `context` prompt tokens (one prefill runs at a time)."""
        return prefill_workspace_bytes(self.target.config, context, len(self.target.feature_layers),
                                       self.target.lm_head.weight.element_size())

    def _needed_bytes(self, context: int) -> int:
        """What serving one request of `context` tokens takes: its pages at the configured tree size, a
        row, and a prefill's activations."""
        tree_slots = max(self.config.tree_budget, self.block_size) + 1
        return (self._request_pages(context, tree_slots) * self._page_bytes() + self._row_bytes(tree_slots)
                + self._prefill_bytes(context))

    def _pages_that_fit(self, tree_slots: int) -> int:
        """The pool's pages: kv_pool_tokens' if configured, else what mem_fraction of the free memory
        holds beside the rows and a prefill's activations (at least one request of the full context,
        which all of it may hold: serving_context's measure), and never more than every row at the
        full context with the largest tree. ValueError (before anything is allocated) when not even that fits."""
        page, rows = self._page_bytes(), self.rows * self._row_bytes(tree_slots)
        one = self._request_pages(self.max_context, tree_slots)
        free, prefill = _free_bytes(self.device), self._prefill_bytes(self.max_context)
        if self.config.kv_pool_tokens is not None:
            pages = -(-self.config.kv_pool_tokens // self.page_size)
            if pages * page + rows + prefill > free:
                raise ValueError(f"kv_pool_tokens {self.config.kv_pool_tokens} needs "
                                 f"{(pages * page + rows) / 2**30:.1f} GiB for the pool, but "
                                 f"{free / 2**30:.1f} GiB of {self.device} is free: lower it")
            if pages < one:
                log.warning("a pool of %d tokens holds no request of the full context (%d)", pages * self.page_size,
                            self.max_context)
            return pages
        most = self.rows * self._request_pages(self.max_context, MAX_TREE_BUDGET + 1)
        pages = min((int(free * self.config.mem_fraction) - prefill - rows) // page, most)
        if pages < one and one * page + rows + prefill <= free:
            pages = one
        if pages < one:
            what = " and recurrent-state slots" if isinstance(self.target.config, Qwen35Config) else ""
            raise ValueError(
                f"tree budget {tree_slots - 1} at context {self.max_context} needs "
                f"{(one * page + rows) / 2**30:.1f} GiB for the caches{what} of {self.rows} rows, but "
                f"{free / 2**30:.1f} GiB of {self.device} is free: lower the tree budget, max context or "
                f"max running")
        return pages

    def capacity(self) -> dict[str, int]:
        """The KV pool in tokens and pages, how many requests of CAPACITY_PROBE tokens and of the full
        context it holds (each with one round's reservation), and what is in use now."""
        tree_slots = max(self.config.tree_budget, self.block_size) + 1
        pages = self.pages.num_pages
        return {"page_size": self.page_size, "pages_total": pages, "tokens": pages * self.page_size,
                "pages_used": self.pages.used_pages, "pages_free": self.pages.free_pages,
                "pages_shared": self.pages.shared_pages, "max_running": self.slots,
                "max_context": self.max_context,
                "requests_8k": min(self.slots, pages // self._request_pages(min(CAPACITY_PROBE, self.max_context),
                                                                           tree_slots)),
                "requests_full_context": min(self.slots, pages // self._request_pages(self.max_context, tree_slots))}

    @property
    def can_serve(self) -> bool:
        """False only if a re-allocation failed after the old pool was dropped and the old one could
        not be put back (the server's /health reports it). While the pool is being re-sized it has no
        cache for a moment, and can serve all the same: requests wait in the server's queue."""
        return self._resizing or (self.target_cache is not None and self.runner is not None)

    def _alloc_target_cache(self, tree_slots: int) -> None:
        """Size the target pool (self.rows rows) for the context and a tree of tree_slots nodes;
        ValueError when the device cannot hold it, raised before anything is dropped, so a request
        refused for one leaves the engine exactly as it was (but for the cached sequences: a new pool
        starts empty)."""
        previous = self.pool.target_slots
        if previous:
            self._check_resize(tree_slots)
        if self.prefix is not None:
            self.prefix.clear()
        self.page_table.reset()  # idle: only cached sequences held pages
        # drop the old cache and the graphs captured over it (and their memory pool) before sizing anew
        self._resizing = True
        self.target_cache = self.runner = self.batch_runner = None
        self.pool.target_slots = 0
        try:
            self._build_target_cache(tree_slots)
        except BaseException:
            if previous:  # put back what served before (if this fails too, can_serve stays False)
                self._build_target_cache(previous)
            raise
        finally:
            self._resizing = False

    def _build_target_cache(self, tree_slots: int) -> None:
        cfg, dtype = self.target.config, self.target.lm_head.weight.dtype
        self.target_cache = target_cache(cfg, 0, self.device, dtype, nodes=tree_bucket(tree_slots),
                                         snapshots=self.prefix is not None, table=self.page_table)
        self.pool.target_cache = self.target_cache
        self.runner = TargetRunner(self.target, self.target_cache.rows(0, 1), self.device,
                                   max_depth=self.block_size - 1)
        self.batch_runner = BatchTargetRunner(self.target, self.target_cache, self.device,
                                              max_depth=self.block_size - 1)
        self.pool.target_slots = tree_slots

    # ---- public API -------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Validate now (ValueError: a request that can never be served), then queue the request;
        returns its id. Its outputs come from `step`."""
        req = self._new_request(prompt_ids, params)
        self.scheduler.add(req)
        return req.id

    @torch.inference_mode()
    def cancel(self, request_id: int) -> None:
        """Drop a request wherever it is (between steps); its slot is free for the next one. (In
        inference mode: a departure moves cache rows, and a pool re-sized inside a step is made of
        inference tensors.)"""
        req = self.scheduler.find(request_id)
        if req is not None:
            self._release(req)

    @property
    def has_work(self) -> bool:
        return len(self.scheduler) > 0

    def has_room(self, arriving: int = 0) -> bool:
        """Whether the waiting queue takes one more request beside `arriving` ones on their way to
        `submit` (max_queue behind the free rows): the server's 429 otherwise. `submit` itself queues
        whatever it is given."""
        return self.scheduler.has_room(arriving)

    @property
    def queue_depth(self) -> int:
        """Requests waiting to be admitted."""
        return len(self.scheduler.waiting)

    def queued(self, request_id: int) -> bool:
        """Whether the request still waits to be admitted (False once admitted, finished or unknown)."""
        return self.scheduler.queued(request_id)

    @torch.inference_mode()
    def step(self) -> list[tuple[int, RoundOutput]]:
        """One step: prefill up to prefill_chunk prompt tokens (admitting queued requests while slots
        are free), then one round for every request that was already decoding. Returns (request id,
        output) for each request that produced tokens; a finished request has left the engine."""
        self.scheduler.reserve_round()
        outputs, joined = self._prefill_step()
        decoding = self.scheduler.decoding(joined)  # rows 0..B-1: the batch is a prefix of the pool
        if len(decoding) == 1:
            req = decoding[0]
            rounds = [self._spec_round(req) if req.mode.drafts else self._ar_step(req)]
        else:
            rounds = self._batch_round(decoding) if decoding else []
        self.stats.rounds += bool(rounds)
        for req, (tokens, accepted, logprobs) in zip(decoding, rounds):
            req.produced += tokens
            req.rounds += 1
            req.accepted_total += accepted
            outputs.append((req.id, self._emit(req, tokens, accepted, logprobs)))
        for request_id, out in outputs:
            if out.finished:
                self.cancel(request_id)
        self.stats.running = len(self.scheduler.running)
        self.stats.waiting = len(self.scheduler.waiting)
        self.stats.pages_used, self.stats.pages_shared = self.pages.used_pages, self.pages.shared_pages
        return outputs

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[RoundOutput]:
        """One request on an idle engine: validate now (ValueError), then return a generator of its
        rounds; close it to cancel. (A server submits and steps instead.)"""
        if self.has_work:
            raise RuntimeError("generate() needs an idle engine: use submit() and step() to batch")
        return self._follow(self._new_request(prompt_ids, params))

    def _follow(self, req: RequestState) -> Iterator[RoundOutput]:
        self.scheduler.add(req)
        try:
            while not req.finished:
                for request_id, out in self.step():
                    if request_id == req.id:
                        yield out
        finally:
            self.cancel(req.id)

    # ---- request setup ----------------------------------------------------------------------------

    def _new_request(self, prompt_ids: list[int], p: SamplingParams) -> RequestState:
        mode = mode_named(p.mode or self.config.mode)
        if mode.drafts and self.drafter is None:
            raise ValueError(f"mode {mode.name!r} needs a drafter; this engine has none")
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
        if not 0 <= p.min_tokens <= p.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_new_tokens = {p.max_new_tokens}], got {p.min_tokens}")
        if p.logprobs is not None and not 0 <= p.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}")
        uniforms = None
        if p.temperature > 0:  # the draw of every output position (and of tree nodes past the last one)
            gen = torch.Generator(device=self.device)
            if p.seed is None:
                gen.seed()
            else:
                gen.manual_seed(p.seed)
            uniforms = torch.rand(p.max_new_tokens + self.block_size, generator=gen, device=self.device)
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids)
        req = RequestState(id=self._next_id, prompt_ids=list(prompt_ids), mode=mode, budget=budget, params=p,
                           stop_ids=stop_ids, uniforms=uniforms)
        if p.min_tokens and stop_ids:
            req.stop_tensor = torch.tensor(sorted(stop_ids), dtype=torch.long, device=self.device)
        tree_slots = self.scheduler.tree_slots(req)
        if not self.pool.holds(tree_slots):
            # a bigger tree than the pool was sized for: the pool is re-sized when the engine is idle,
            # so refuse now if even that could not hold it
            self._check_resize(tree_slots)
        need = self._request_pages(len(prompt_ids) + p.max_new_tokens - 1, tree_slots)
        if need > self.pages.num_pages:
            raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({p.max_new_tokens}) needs {need} KV pages "
                             f"of {self.page_size} tokens, the pool holds {self.pages.num_pages}: shorten the prompt "
                             f"or lower max_tokens")
        self._next_id += 1
        return req

    def _check_resize(self, tree_slots: int) -> None:
        """ValueError unless a target cache of the same pages and rows for trees of tree_slots nodes
        fits in what is free once the current one is given back."""
        current = sum(t.numel() * t.element_size() for t in self.target_cache._per_slot())
        cfg, elem = self.target.config, self.target.lm_head.weight.element_size()
        kv = KVCache.page_bytes(cfg.kv_layers, cfg.num_key_value_heads, cfg.head_dim, self.page_size, elem)
        need = kv * (self.pages.num_pages + 1) + self.rows * self._row_bytes(tree_slots)
        if need > _free_bytes(self.device) + current:
            raise ValueError(f"tree budget {tree_slots - 1} needs more memory than is free for the pool's "
                             f"{self.rows} slots: lower the tree budget")

    def _release(self, req: RequestState) -> None:
        """Take `req` out; the rows behind it move down, and a request that was decoding leaves its
        row as a cached sequence (moved to the first idle row) when prefix reuse is on."""
        row, keep = req.slot, self.prefix is not None and req in self.scheduler.running and req.n_ctx > 0
        # valid positions of each row that may move (a lone AR request's next pass has written n_ctx)
        valid = {r.slot: r.n_ctx + 1 for r in self.scheduler.running}
        if self.scheduler.prefilling is not None:
            valid[self.scheduler.prefilling.slot] = self.scheduler.prefilling.prefilled
        if keep:  # a cached sequence holds only its own length
            self.page_table.truncate(row, req.n_ctx, writable=False)
        elif row >= 0:
            self.page_table.release(row)
        moves = self.scheduler.remove(req)
        src, dst = [s for s, _ in moves], [d for _, d in moves]
        if keep:
            idle = len(self.scheduler.running) + (self.scheduler.prefilling is not None)  # the freed row
            if idle != row:
                src.append(row)
                dst.append(idle)
            self.prefix.add(idle, (req.prompt_ids + req.produced)[:req.n_ctx], req.snapshot_at,
                            self.scheduler.draft_length(req))
        self.pool.move_rows(dst, src, max((valid[s] for s in src), default=0))
        req.finished = True
        req.drafted = req.ahead = req.ahead_logprobs = req.stop_tensor = None
        req.prompt_feats = None
        self._prefix_stats()

    # ---- prefix reuse -----------------------------------------------------------------------------

    def _place(self, req: RequestState) -> None:
        """Set up the row of a request just admitted (row = len(running)): move any cached sequence
        there out of its way, and start it from the cached prefix that saves the most prefill."""
        req.placed = True
        row = req.slot
        if self.prefix is not None:
            hit = self.scheduler.lookup(req)
            resident = self.prefix.by_row.get(row)
            if resident is not None:
                self._rehome(resident, hit.seq if hit is not None else None)
            if hit is not None:
                seq = hit.seq
                self.pool.keep_free(1, spare=seq)  # for the partial page's copy
                if seq.row == row:  # taken over where it lies: the request writes past the prefix
                    self.prefix.pop(row)
                    self.pool.copy_pages(self.page_table.truncate(row, hit.length))
                else:  # its full pages by reference, the partial last one copied
                    self.pool.copy_pages(self.page_table.share(seq.row, row, hit.length))
                self.target_cache.copy_prefix(seq.row, row, hit.length, hit.from_snapshot)
                req.draft_ctx = min(hit.length, seq.draft_len) if self.drafter is not None else 0
                req.prefilled = req.reused = hit.length
            req.snapshot_at = len(req.context)
            if self.prefix.snapshots_only:
                req.snapshot_at = snapshot_point(req.context, self.turn_token, req.reused)
            self._prefix_stats()
        if not self.pool.take_pages(row, len(req.context) + self.pool.round_reserve(self.scheduler.tree_slots(req))):
            raise RuntimeError(f"request {req.id} was admitted without the pages it needs")  # pages_admit: not reached

    def _rehome(self, seq: CachedSequence, keep: CachedSequence | None) -> None:
        """Move `seq` out of a row an admission needs: to a free idle row; else, if it is `keep` (the
        one being reused), leave it to be taken over in place; else over the least recently used other
        cached sequence (never `keep`), unless `seq` is itself the least recently used: then drop it."""
        occupied = len(self.scheduler.running) + 1  # the running rows and the one being admitted
        free = [r for r in range(occupied, self.rows) if r not in self.prefix.by_row]
        if free:
            dest = free[0]
        elif seq is keep:
            return
        else:
            victim = self.prefix.least_recent(spare=(keep,))
            self.pool.evict(victim)
            if victim is seq:
                return
            dest = victim.row
        self.pool.move_rows([dest], [seq.row], seq.end)
        self.prefix.pop(seq.row)
        seq.row = dest
        self.prefix.by_row[dest] = seq

    def _prefix_stats(self) -> None:
        if self.prefix is not None:
            p, s = self.prefix.stats, self.stats
            s.prefix_lookups, s.prefix_hits, s.prefix_tokens_saved = p.lookups, p.hits, p.tokens_saved
            s.prefix_evictions, s.prefix_cached = p.evictions, len(self.prefix)

    def _emit(self, req: RequestState, tokens: list[int], accepted: int,
              logprobs: list[TokenLogprob] | None = None) -> RoundOutput:
        """Cut the round's tokens (and their log-probabilities) at the first stop token or at
        max_new_tokens (`_emitted`)."""
        kept = tokens[:self._emitted(req, tokens)]
        req.generated += len(kept)
        logprobs = _cut(logprobs, len(kept))
        if kept and kept[-1] in req.stop_ids:
            return RoundOutput(kept, accepted, True, "stop", logprobs=logprobs)
        if req.generated >= req.params.max_new_tokens:
            return RoundOutput(kept, accepted, True, "length", logprobs=logprobs)
        return RoundOutput(kept, accepted, False, None, logprobs=logprobs)

    def _phase(self, name: str) -> None:
        if self.phase_hook is not None:
            self.phase_hook(name)

    def _choose(self, req: RequestState, logits: torch.Tensor, position: int,
                depths: torch.Tensor | None = None) -> torch.Tensor:
        """logits: [N, V] -> the target's token per row. `position`: which output token (0-based) row
        0 chooses; a tree's rows choose position + their depth ([N] `depths`; None: every row chooses
        `position`). The stop tokens are masked in the rows that choose one of the first min_tokens."""
        if position < req.params.min_tokens and req.stop_tensor is not None:
            early = None if depths is None else position + depths < req.params.min_tokens
            logits = suppress_stops(logits, req.stop_tensor, early)
        draws = None
        if req.uniforms is not None:  # each row's draw is its output position's (sampling.py)
            last = req.uniforms.shape[0] - 1
            draws = (req.uniforms[(position + depths).clamp(max=last)] if depths is not None
                     else req.uniforms[min(position, last)].expand(logits.shape[0]))
        return choose_tokens(logits, req.params, draws)

    @staticmethod
    def _logprobs(req: RequestState, logits: torch.Tensor, chosen: torch.Tensor) -> PendingLogprobs | None:
        """The raw log-probabilities of the tokens chosen from `logits` ([N, V], chosen [N]), queued
        for the host, if the request asked for them (None otherwise: nothing is computed)."""
        if req.params.logprobs is None:
            return None
        return start_logprobs(logits, chosen, req.params.logprobs)

    # ---- prefill ----------------------------------------------------------------------------------

    def _prefill_step(self) -> tuple[list[tuple[int, RoundOutput]], list[RequestState]]:
        """Prefill up to prefill_chunk prompt tokens, from the request in progress on and then the
        queue's head while slots are free: a long prompt takes several steps, between which the
        running requests keep decoding. Returns the first tokens and the requests that joined."""
        outputs, joined = [], []
        group: list[tuple[RequestState, int]] = []  # prompts' last pieces, run as one pass (_prefill_rows)
        # with nothing decoding there is no one to stall: a prompt goes in pieces as large as prefill.py's
        left = self.scheduler.prefill_budget(self.config.prefill_chunk)
        self.stats.prefill_tokens = self.stats.prefill_passes = 0
        while left > 0:
            try:
                req = self.scheduler.next_prefill()
            except Exception as exc:  # noqa: BLE001 - re-sizing the pool for it failed: it fails, alone
                failed = self.scheduler.fail_head()
                outputs.append((failed.id, RoundOutput([], 0, True, "error", error=exc)))
                continue
            if req is None:
                break
            if group and not req.placed and self._shares_with(group, req):
                self._prefill_group(group, outputs)  # computed first, so that its pages can be shared
            if not req.placed:
                self._place(req)
            take = min(left, len(req.context) - req.prefilled, PREFILL_PIECE)
            if req.prefilled < req.snapshot_at < len(req.context):  # a hybrid's state is kept there
                take = min(take, req.snapshot_at - req.prefilled)
            left -= take
            self.stats.prefill_tokens += take
            if self._groupable(req, take):
                if not self._group_holds(group, req, take):
                    self._prefill_group(group, outputs)
                # the request joins now (the next admission takes the next slot); its pass runs with the group's
                self.scheduler.start_running(req)
                joined.append(req)
                group.append((req, take))
                continue
            self._prefill_group(group, outputs)
            first = self._prefill_chunk(req, take)
            if first is not None:
                self.scheduler.start_running(req)
                joined.append(req)
                self._joined(req, first, outputs)
        self._prefill_group(group, outputs)
        return outputs, joined

    def _shares_with(self, group: list[tuple[RequestState, int]], req: RequestState) -> bool:
        """Whether req's context starts with a full page of a grouped request's (not computed yet)."""
        return self.prefix is not None and any(common_prefix(r.context, req.context) >= self.page_size
                                               for r, _ in group)

    def _joined(self, req: RequestState, first: tuple[int, list[TokenLogprob] | None],
                outputs: list[tuple[int, RoundOutput]]) -> None:
        token, logprobs = first
        if token is None:  # a preempted request recomputed: its next token is already known
            return
        req.produced.append(token)
        outputs.append((req.id, self._emit(req, [token], 0, logprobs)))

    def _groupable(self, req: RequestState, take: int) -> bool:
        """Whether this piece may share a prefill pass with other requests' (_prefill_rows): the last
        of its prompt, no longer than a chunk, on an attention-only target (a hybrid's recurrent state
        would run on over the padding of a shorter row)."""
        return self.arch == "qwen3" and take <= self.config.prefill_chunk and req.prefilled + take == len(req.context)

    @staticmethod
    def _group_holds(group: list[tuple[RequestState, int]], req: RequestState, take: int) -> bool:
        """Whether the group's pass can take one more row: its padded tokens within one prefill piece
        (the activations the pool was sized for) and its attention bias within GROUP_BIAS elements."""
        rows = [*group, (req, take)]
        width = max(t for _, t in rows)
        keys = max(r.prefilled + t for r, t in rows)
        return len(rows) * width <= PREFILL_PIECE and len(rows) * width * keys <= GROUP_BIAS

    def _prefill_group(self, group: list[tuple[RequestState, int]], outputs: list[tuple[int, RoundOutput]]) -> None:
        """Run the deferred last pieces (one pass for two or more, the lone path for one), then empty it."""
        if len(group) == 1:
            req, take = group[0]
            self._joined(req, self._prefill_chunk(req, take), outputs)
        elif group:
            for req, first in zip([r for r, _ in group], self._prefill_rows(group)):
                self._joined(req, first, outputs)
        group.clear()

    def _prefill_chunk(self, req: RequestState, take: int) -> tuple[int, list[TokenLogprob] | None] | None:
        """Prompt tokens prefilled..prefilled+take into the request's slot; at the prompt's end, the
        first token (and, for a speculative request, the first draft). Returns the first token (and its
        log-probabilities if asked for) then."""
        lo, hi = req.prefilled, req.prefilled + take
        ids = torch.tensor([req.context[lo:hi]], dtype=torch.long, device=self.device)   # [1, C]
        pos = torch.arange(lo, hi, device=self.device)[None]
        # a later chunk attends to the cached prompt and itself, causally (layers.attend_cached)
        h, feats = self.target(ids, pos, self.target_cache.rows(req.slot, req.slot + 1), start=lo)
        self.stats.prefill_passes += 1
        self._prefilled(req, take, feats)
        if hi < len(req.context):
            return None
        return self._first_token(req, self.target.logits(h[0, -1:]))

    def _prefill_rows(self, group: list[tuple[RequestState, int]]) -> list[tuple[int, list[TokenLogprob] | None]]:
        """The last pieces of several prompts in one target pass: row i is group[i]'s piece at its own
        offset over its own cache row (the group holds consecutive slots), padded to the longest piece
        and causal within its row, so a burst of short prompts reads the weights once instead of once
        each. The padding's k/v land past a row's prompt, where the first round writes over them before
        anything may read there. Returns each request's first token, as _prefill_chunk does."""
        reqs, takes = [r for r, _ in group], [t for _, t in group]
        n, width, dev = len(group), max(takes), self.device
        ids = torch.zeros(n, width, dtype=torch.long)
        for i, (req, take) in enumerate(group):
            ids[i, :take] = torch.tensor(req.context[req.prefilled:req.prefilled + take])
        pos = torch.tensor([req.prefilled for req in reqs], device=dev)[:, None] + torch.arange(width, device=dev)
        kv_len = max(req.prefilled + take for req, take in group)
        cols = torch.arange(kv_len, device=dev)
        bias = torch.zeros((), dtype=self.target_cache.k.dtype, device=dev).expand(n, 1, width, kv_len)
        bias = bias.masked_fill(cols > pos[:, None, :, None], float("-inf"))       # [n, 1, W, L] causal per row
        slots = pos.clamp(max=self.target_cache.capacity - 1)
        rows = self.target_cache.rows(reqs[0].slot, reqs[0].slot + n)
        h, feats = self.target(ids.to(dev), pos, rows, static=TreeInputs(slots, bias, kv_len, None))
        self.stats.prefill_passes += 1
        for i, (req, take) in enumerate(group):
            self._prefilled(req, take, None if feats is None else feats[i:i + 1, :take])
        last = self.target.logits(h[torch.arange(n, device=dev), torch.tensor(takes, device=dev) - 1])  # [n, V]
        firsts = [self._first_token(req, last[i:i + 1], draft=False) for i, req in enumerate(reqs)]
        if sum(req.mode.drafts for req in reqs) > 1:
            self._draft_prompts(reqs)
        else:
            for req in reqs:
                if req.mode.drafts:
                    req.drafted = self._draft_prompt(req)
        return firsts

    def _draft_prompts(self, reqs: list[RequestState]) -> None:
        """_draft_prompt for a prefill group (consecutive slots) in one drafter pass: row i's context is
        its computed prompt (zero-padded to the longest; the padding's k/v land past its context, under
        its block or masked, as the per-round pass's do), then its block. An AR row takes part at the
        last cache slot only, so nothing it holds is touched."""
        dev, bs, n = self.device, self.block_size, len(reqs)
        spec = [req.mode.drafts for req in reqs]
        width = max(req.n_ctx - req.reused for req, s in zip(reqs, spec) if s)
        feats = next(req.prompt_feats for req, s in zip(reqs, spec) if s)
        ctx = feats.new_zeros(n, width, feats.shape[-1])
        block = torch.full((n, bs), self.mask_token_id, dtype=torch.long, device=dev)
        for i, req in enumerate(reqs):
            if spec[i]:
                ctx[i, :req.n_ctx - req.reused] = req.prompt_feats[0]
                req.prompt_feats = None
            block[i, 0] = req.bonus
        lo = torch.tensor([req.reused for req in reqs], device=dev)[:, None]
        end = torch.tensor([req.n_ctx for req in reqs], device=dev)[:, None]
        ctx_pos, block_pos = lo + torch.arange(width, device=dev), end + torch.arange(bs, device=dev)
        last = self.draft_cache.capacity - 1
        live = torch.tensor(spec, device=dev)[:, None]
        ctx_slots = torch.where(live, ctx_pos.clamp(max=last), last)
        block_slots = torch.where(live, block_pos, last)
        kv_len = max(req.n_ctx for req, s in zip(reqs, spec) if s) + bs
        cols = torch.arange(kv_len, device=dev)
        bias = torch.zeros((), dtype=self.draft_cache.k.dtype, device=dev).expand(n, 1, 1, kv_len)
        bias = bias.masked_fill((cols >= torch.where(live, end + bs, 1))[:, None, None], float("-inf"))
        rows = self.draft_cache.rows(reqs[0].slot, reqs[0].slot + n)
        h = self.drafter(self.target.model.embed_tokens(block), block_pos, ctx, ctx_pos, rows, mask=bias,
                         static=(ctx_slots, block_slots, kv_len))
        drafted = self.target.logits(h[:, 1:])                          # [n, bs-1, V]
        for i, req in enumerate(reqs):
            if spec[i]:
                req.drafted = drafted[i]

    def _prefilled(self, req: RequestState, take: int, feats: torch.Tensor | None) -> None:
        """Book `take` more prompt tokens as computed, keeping their features for the first draft."""
        lo, hi = req.prefilled, req.prefilled + take
        req.prefilled = hi
        if req.mode.drafts:
            if req.prompt_feats is None:  # the computed prompt's, filled chunk by chunk (no concatenation)
                req.prompt_feats = feats.new_empty(1, len(req.context) - req.reused, feats.shape[-1])
            req.prompt_feats[:, lo - req.reused:hi - req.reused] = feats
        if hi == req.snapshot_at and self.prefix is not None and self.prefix.snapshots_only:
            self.target_cache.snapshot(req.slot)  # the prompt's state there, for a later turn's reuse

    def _first_token(self, req: RequestState, logits: torch.Tensor,
                     draft: bool = True) -> tuple[int | None, list[TokenLogprob] | None]:
        """The prompt is in: choose the first token from the last position's logits [1, V], and draft
        (unless the caller drafts for several requests at once). A request recomputed after a
        preemption chooses nothing: its next round's root is the last token it produced (None)."""
        if req.resume_bonus is not None:
            req.n_ctx, req.bonus, req.resume_bonus = len(req.context), req.resume_bonus, None
            if draft and req.mode.drafts:
                req.drafted = self._draft_prompt(req)
            return None, None
        chosen = self._choose(req, logits, 0)
        pending = self._logprobs(req, logits, chosen)
        first = int(chosen[0])
        req.n_ctx, req.bonus = len(req.context), first
        if draft and req.mode.drafts:
            req.drafted = self._draft_prompt(req)
        return first, None if pending is None else pending.rows([0])

    def _draft_prompt(self, req: RequestState) -> torch.Tensor:
        """The first drafter pass of a request, eager: its context is every prompt position (features
        from the prefill, written to the drafter's cache after the reused prefix's, which came with it:
        a position's drafter k/v depend on that position's target features alone) plus the block
        [bonus, MASK * (block_size-1)] -> logits for depths 1..Q-1."""
        n, bs, lo = req.n_ctx, self.block_size, req.reused
        block = torch.full((1, bs), self.mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0] = req.bonus
        emb = self.target.model.embed_tokens(block)                     # [1, bs, H]
        block_pos = torch.arange(n, n + bs, device=self.device)[None]
        ctx_pos = torch.arange(lo, n, device=self.device)[None]
        h = self.drafter(emb, block_pos, req.prompt_feats, ctx_pos, self.draft_cache.rows(req.slot, req.slot + 1),
                         ctx_start=lo)
        req.prompt_feats = None
        return self.target.logits(h[0, 1:])

    # ---- a lone request: the single-stream path ---------------------------------------------------

    def _ar_step(self, req: RequestState) -> Round:
        """One token; the next step is queued (from the device's token) before this one's token is
        read, so the device never waits for the host between steps."""
        self._phase("step")
        token, pending = req.ahead, req.ahead_logprobs
        if token is None:  # the first step after the prefill or after batched rounds
            logits = self.runner.run(req.bonus, req.n_ctx).logits
            token = self._choose(req, logits, req.generated)
            pending = self._logprobs(req, logits, token)
        self.runner.cache.compact(req.n_ctx, [0], self.root_node)  # no-op for KV; advances a recurrent state
        req.n_ctx += 1
        self.readback.start(token)
        logits = self.runner.run(token, req.n_ctx).logits
        req.ahead = self._choose(req, logits, req.generated + 1)
        req.ahead_logprobs = self._logprobs(req, logits, req.ahead)
        req.bonus = self.readback.wait()[0]
        self.stats.batch_size, self.stats.tree_nodes = 1, 1
        self._phase("end")
        return [req.bonus], 0, None if pending is None else pending.rows([0])

    def _spec_round(self, req: RequestState) -> Round:
        """Build the tree from the draft, verify, choose and walk, then queue the next round's drafter
        pass from the walk's device-side result: one host sync a round (the walk's result), and the
        device is busy with the next draft while the host reads it."""
        self._phase("tree")
        budget = self.scheduler.tree_budgets([req], self.config.round_nodes)[0]
        tree = req.mode.tree(self.trees, req.drafted, budget, self.block_size)
        self._phase("verify")
        out = self.runner.run(req.bonus, req.n_ctx, tree)               # logits [N, V], feats [1, N, F]
        self.stats.batch_size, self.stats.tree_nodes = 1, tree.size
        self._phase("commit")
        target = self._choose(req, out.logits, req.generated, out.depths)  # the target's token per node
        pending = self._logprobs(req, out.logits, target)
        result = walk(out.tokens, out.parents, out.depths, out.mask, target, self.block_size - 1)
        self.readback.start(result)
        self._phase("draft")
        length, bonus, rows = Walk.on_device(result, self.block_size - 1)
        req.drafted = self.draft_runner.run(bonus, length, rows, out.feats, req.n_ctx)
        self._phase("commit")
        accepted = Walk.read(self.readback.wait(), self.block_size - 1)
        tokens = accepted.tokens[1:] + [accepted.next_token]
        keep = self._emitted(req, tokens)  # a finishing round commits only what it emits (see _emitted)
        # the accepted path's KV, moved to right after the context (by the walk's own device copy of it)
        self.runner.cache.compact(req.n_ctx, accepted.path[:keep], rows[:keep])
        req.n_ctx += keep
        req.bonus = tokens[keep - 1]
        self._phase("end")
        # the committed tokens are the ones chosen at the path's nodes: its tokens past the root, then the bonus
        logprobs = None if pending is None else pending.rows(accepted.path[:keep])
        return tokens[:keep], len(accepted.path) - 1, logprobs

    @staticmethod
    def _emitted(req: RequestState, tokens: list[int]) -> int:
        """How many of a round's tokens the request emits (`_emit`: up to a stop or max_new_tokens). A
        round that finishes the request commits only those, so the cache it leaves behind ends where
        the client's text does, which is where a next turn can continue it (a hybrid's state cannot be
        wound back to there later)."""
        for i, t in enumerate(tokens):
            if t in req.stop_ids or req.generated + i + 1 >= req.params.max_new_tokens:
                return i + 1
        return len(tokens)

    # ---- a batch: one verify pass for every request's tree ----------------------------------------

    def _batch_round(self, reqs: list[RequestState]) -> list[Round]:
        """draft (queued by the last round) -> each request's tree -> one verify pass over all of them
        -> each row's walk -> one drafter pass for the next round, queued before the host reads the
        walks -> each row's commit. Rows are slots 0..B-1."""
        depth = self.block_size - 1
        settled_logprobs = [_rows_of(req.ahead_logprobs) for req in reqs]  # taken before _settle drops them
        settled = [self._settle(req) for req in reqs]
        self._phase("tree")
        budgets = self.scheduler.tree_budgets(reqs, self.config.round_nodes)
        trees = self._batch_trees(reqs, budgets)
        self._phase("verify")
        starts = [req.n_ctx for req in reqs]
        out = self.batch_runner.run([req.bonus for req in reqs], starts, trees)
        sizes = [1 if tree is None else tree.size for tree in trees]
        self.stats.batch_size, self.stats.tree_nodes = len(reqs), sum(sizes)
        self._phase("commit")
        target = out.logits.argmax(dim=-1)                               # [B, T] the target's token per node
        positions = [req.generated + len(settled[row]) for row, req in enumerate(reqs)]
        for row, req in enumerate(reqs):
            p = req.params
            if p.temperature > 0 or p.logit_bias or positions[row] < p.min_tokens:  # as alone, its own draws
                target[row, :sizes[row]] = self._choose(req, out.logits[row, :sizes[row]], positions[row],
                                                        out.depths[row, :sizes[row]])
        pending = [self._logprobs(req, out.logits[row, :sizes[row]], target[row, :sizes[row]])
                   for row, req in enumerate(reqs)]
        result = walk_rows(out.tokens, out.parents, out.depths, out.mask, target, depth)   # [B', W]
        n = len(reqs)
        self.batch_readback.start(result[:n].flatten())
        drafted = None
        if any(req.mode.drafts for req in reqs):
            self._phase("draft")
            drafted = self.batch_draft.run(result[:, 1], result[:, 0], result[:, 2:3 + depth], out.feats, starts)
        self._phase("commit")
        host = self.batch_readback.wait()
        rounds, width = [], Walk.size(depth)
        moved = 0  # the longest committed path not already in place (compact_rows)
        for row, req in enumerate(reqs):
            accepted = Walk.read(host[row * width:(row + 1) * width], depth)
            tokens = settled[row] + accepted.tokens[1:] + [accepted.next_token]
            # a finishing row commits only what it emits (_emitted), its root at least
            keep = max(self._emitted(req, tokens), len(settled[row]) + 1)
            path = keep - len(settled[row])
            if path < len(accepted.path):
                result[row, 0] = path  # the commit's length (the drafter pass queued before read the walk's)
            if accepted.path[:path] != list(range(path)):
                moved = max(moved, path)
            req.n_ctx += path
            req.bonus = tokens[keep - 1]
            if req.mode.drafts:
                req.drafted = drafted[row]
            logprobs = None
            if pending[row] is not None:
                logprobs = (settled_logprobs[row] + pending[row].rows(accepted.path))[:keep]
            rounds.append((tokens[:keep], len(accepted.path) - 1, logprobs))
        # only the KV of paths that are not in place already moves (none for a batch of AR steps)
        self.target_cache.rows(0, n).compact_rows(out.start[:n], result[:n, 2:3 + depth], result[:n, 0], moved)
        self._phase("end")
        return rounds

    def _settle(self, req: RequestState) -> list[int]:
        """An AR request coming from the single-stream path has its next pass already run and its
        token chosen (req.ahead): commit that pass and take the token, as its next step would."""
        if req.ahead is None:
            return []
        self.runner.cache.compact(req.n_ctx, [0], self.root_node)  # it ran alone: it is in slot 0
        req.n_ctx += 1
        req.bonus = int(req.ahead[0])
        req.ahead = req.ahead_logprobs = None
        return [req.bonus]

    def _batch_trees(self, reqs: list[RequestState], budgets: list[int]) -> list[Tree | None]:
        """Each request's tree (None: AR): the requests of one mode and budget built together."""
        groups: dict[tuple, list[int]] = {}
        for row, req in enumerate(reqs):
            groups.setdefault((req.mode.name, budgets[row]), []).append(row)
        trees: list[Tree | None] = [None] * len(reqs)
        for (_, budget), rows in groups.items():
            mode = reqs[rows[0]].mode
            for row, tree in zip(rows, mode.trees(self.trees, [reqs[r].drafted for r in rows], budget,
                                                  self.block_size)):
                trees[row] = tree
        return trees


def _cut(logprobs: list[TokenLogprob] | None, n: int) -> list[TokenLogprob] | None:
    return None if logprobs is None else logprobs[:n]


def _rows_of(pending: PendingLogprobs | None) -> list[TokenLogprob]:
    return [] if pending is None else pending.rows([0])

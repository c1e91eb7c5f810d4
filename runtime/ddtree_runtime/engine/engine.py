"""The DDTree engine: schedule -> run -> postprocess, over three parts.

`Scheduler` (scheduler.py) owns the requests and the KV pool's pages: each step it reserves the running
requests' round pages (preempting the newest when the pool runs out), gives the step's token budget to
their rounds first and fills the rest with prompt pieces (admitting queued requests where a row is free
and the pool holds them, each placed at its longest cached prefix), and afterwards appends the tokens,
finishes requests and frees their rows. `ModelRunner` (model_runner.py) owns the device: the models, the
caches, the graphed passes, the prompt passes and the round (draft -> tree -> verify -> accept and
commit, one target pass and one drafter pass for every request decoding), and re-sizing the pool. The
speculative modes are objects (modes.py).

Memory: a KV pool of fixed-size pages counted in tokens (block_manager.py, pool.py), sized once at
start-up from free memory by capacity.py's arithmetic (memory.py), holding the target's and the
drafter's KV; each row maps its positions to pages through a block table and takes pages as it grows.
A hybrid target's recurrent state is one slot per row, apart from the pages. A preempted request
gives its pages back and is recomputed later from its tokens, so its output does not change; a
request that leaves keeps its pages as a cached sequence that later prompts share (prefix_cache.py).

This file loads and checks the models, sizes the pool, builds the parts, and holds the public API
(submit, cancel, step, generate, capacity, warm_up). What the server calls of it, what it publishes
(`info`: its names and the limits a request is checked against, once, by `RequestLimits.check`) and
the refusal it raises are engine/api.py's."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ..capacity import (SHORT_REQUEST, WARM_UP_NEW_TOKENS, WARM_UP_PROMPT_MAX, least_pool_tokens,
                        pool_too_small)
from ..draft_vocab import draft_vocab_ids
from ..limits import (DTYPE_NAMES, MAX_TREE_BUDGET, MIN_BLOCK_SIZE, MIN_TREE_BUDGET, QUANTIZE_METHODS,
                      TREE_POLICIES)
from ..model import (DFlashDrafter, Qwen35Config, Qwen3ForCausalLM, load_drafter, load_target, parallel,
                     target_config)
from ..model.compile_pool import parallel_compiles, record_for, start_early
from ..model.fp8 import FP8Linear, choose_gemms, gemm_path
from ..model.gdn_chunk import FLA_MODULE
from ..model.layers import fuse_projections
from ..settings import resolve_device
from . import memory
from .api import EngineInfo, RequestLimits
from .block_manager import BlockManager, PageTable
from .context import serving_context
from .costs import measure_round_costs, round_clock
from .memory import PoolSizing, shape_of
from .model_runner import ModelRunner
from .modes import mode_named
from .policy import BudgetPolicy
from .pool import KVPool
from .prefix_cache import PrefixCache
from .runner import batch_bucket
from .scheduler import Scheduler
from .types import BatchStats, EngineConfig, RequestState, RoundOutput, SamplingParams, WarmUp

log = logging.getLogger(__name__)

# A warm-up request: two tokens (the prefill's, then one round's), whatever the model says.
WARM_UP_PARAMS = SamplingParams(max_new_tokens=WARM_UP_NEW_TOKENS, ignore_eos=True)


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
        if config.max_running < 1 or config.max_batched_tokens < 1 or not 0 < config.mem_fraction <= 1:
            raise ValueError("need max_running >= 1, max_batched_tokens >= 1 and 0 < mem_fraction <= 1")
        if config.tree_policy not in TREE_POLICIES:
            raise ValueError(f"tree_policy must be one of {', '.join(TREE_POLICIES)}, got {config.tree_policy!r}")
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

        tp = parallel.current()  # this process's ranks (engine/distributed.py), None serving alone
        if config.tensor_parallel != (1 if tp is None else tp.world):
            raise ValueError(f"tensor_parallel {config.tensor_parallel}: this process is one of "
                             f"{1 if tp is None else tp.world} ranks (engine/distributed.py starts them)")
        # the record of compiles shipped for this model's shape (compile_pool.SHIPPED), if there is one:
        # the checkpoint's config.json is read before the weights load
        self.shipped_record = record_for(
            target.config if target is not None else target_config(
                json.loads((Path(config.target_dir) / "config.json").read_text())),
            config.dtype, config.quantization, 1 if tp is None else tp.world)
        if self.device.type == "cuda":  # a first start's compile workers import while the weights load
            start_early(preload=(FLA_MODULE,), shipped=self.shipped_record)
        self.target: Qwen3ForCausalLM = (load_target(config.target_dir, config.device, config.dtype, config.quantization,
                                                     tp) if target is None else target)
        fuse_projections(self.target)
        tcfg = self.target.config
        self.arch = "qwen3_5" if isinstance(tcfg, Qwen35Config) else "qwen3"  # reported by /health
        # what the target's projections are (the checkpoint's, or --quantize's), also for /health
        self.quantization = "fp8" if any(isinstance(m, FP8Linear) for m in self.target.modules()) else "none"
        # which FP8 GEMMs this device runs (model/fp8.gemm_path), also for /health; None in 16 bits
        self.fp8_gemm = gemm_path(self.device) if self.quantization == "fp8" else None
        self.eos_ids = _eos_ids(self.tokenizer, config.target_dir)

        self.drafter: DFlashDrafter | None = drafter
        self.block_size, self.mask_token_id = 1, None
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
            if config.draft_vocab is not None:
                self._use_draft_vocab(config.draft_vocab, tcfg.vocab_size)
        if self.fp8_gemm:  # probed up to the largest pass: a step's tokens, or every request's biggest tree
            rows = max(config.max_batched_tokens, config.max_running * (MAX_TREE_BUDGET + 1))
            dtype = self.target.lm_head.weight.dtype
            shapes = {**choose_gemms(self.target, self.device, dtype, rows, config.fp8_gemm),
                      **(choose_gemms(self.drafter, self.device, dtype, rows, config.fp8_gemm)
                         if self.drafter is not None else {})}
            log.info("fp8 GEMM on %s: %s%s", self.device, self.fp8_gemm,
                     f" ({', '.join(f'{s} {g}' for s, g in shapes.items())})" if shapes else "")
        tree_slots = max(config.tree_budget, self.block_size) + 1
        # finished requests' rows kept for prefix reuse; a hybrid reuses only where a state was kept
        self.prefix = PrefixCache(snapshots_only=self.arch == "qwen3_5") if config.prefix_cache else None
        self.page_size = config.page_size
        # sized with both models' weights in place, before any cache: the context one request can have,
        # then the rows (max_running, and those that only hold cached sequences), then the pages
        elem = self.target.lm_head.weight.element_size()
        self.sizing = PoolSizing(shape_of(tcfg), None if self.drafter is None else shape_of(self.drafter.config),
                                 elem, self.page_size, self.block_size, len(self.target.feature_layers),
                                 snapshots=self.arch == "qwen3_5" and self.prefix is not None,
                                 ring_snapshots=self.prefix is not None)
        self.tree_slots = tree_slots  # the configured tree's nodes, root included: what the pool is sized for
        extra = config.prefix_cache_rows if config.prefix_cache else 0
        self.rows = config.max_running + extra   # the pool's rows (block tables, a hybrid's state slots)
        self.slots = config.max_running          # of them, running requests'
        self.max_context = serving_context(config.max_context, tcfg.max_position_embeddings, self.needed_bytes,
                                           memory.free_bytes(self.device), str(self.device))
        least = least_pool_tokens(config.mode, config.tree_budget, self.block_size, self.page_size, self.max_context)
        if config.kv_pool_tokens is not None and config.kv_pool_tokens < least:
            raise ValueError(pool_too_small("kv_pool_tokens", config.kv_pool_tokens, least, config.mode, self.page_size))
        pages = self.sizing.pages_that_fit(free=memory.free_bytes(self.device), rows=self.rows,
                                           max_context=self.max_context, tree_slots=tree_slots,
                                           mem_fraction=config.mem_fraction, kv_pool_tokens=config.kv_pool_tokens,
                                           device=self.device)
        self.pages = BlockManager(pages, self.page_size)
        self.stats = BatchStats(pages_total=self.pages.num_pages)
        width = -(-self.sizing.row_capacity(self.max_context) // self.page_size)
        self.page_table = PageTable(self.pages, self.rows, width, self.device)
        self.pool = KVPool(self.pages, self.page_table, self.prefix, self.sizing, self.max_context)
        by_cost = config.tree_policy == "cost" and self.drafter is not None
        self.policy = BudgetPolicy(by_cost=by_cost, cap=config.tree_budget, slots=self.slots,
                                   block_size=self.block_size, round_nodes=config.round_nodes,
                                   learning=by_cost and tp is None,  # ranks must choose alike (costs.py)
                                   dense=self.device.type != "cuda")
        self.runner = ModelRunner(self.target, self.drafter, self.pool, slots=self.slots, block_size=self.block_size,
                                  mask_token_id=self.mask_token_id, device=self.device,
                                  stats=self.stats, tree_slots=tree_slots,
                                  forecast_at=self.policy.candidates if self.policy.by_cost else ())
        self.scheduler = Scheduler(self.slots, config.max_queue, self.pool, self.stats,
                                   step_tokens=config.max_batched_tokens, policy=self.policy,
                                   groups=self.arch == "qwen3", has_drafter=self.drafter is not None,
                                   turn_token=_turn_token(self.tokenizer))
        self._next_id = 0
        self._clock = round_clock(self.device)  # what a round's time is taken with (costs.py)
        limits = RequestLimits(self.max_context, tcfg.vocab_size, self.drafter is not None, config.mode,
                               config.tree_budget, self.block_size, self.page_size, self.pages.num_pages)
        vocab_ids = None if self.drafter is None else self.drafter.vocab_ids
        self.info = EngineInfo(self.model_name, self.arch, self.draft_name, self.quantization, limits,
                               fp8_gemm=self.fp8_gemm, draft_vocab=None if vocab_ids is None else len(vocab_ids))
        cap = self.capacity()
        log.info("KV pool: %d tokens (%d pages x %d); holds %d requests of %d tokens, %d of the full context "
                 "(%d); %d running at most", cap["tokens"], cap["pages_total"], self.page_size, cap["requests_8k"],
                 SHORT_REQUEST, cap["requests_full_context"], self.max_context, self.slots)

    def _use_draft_vocab(self, spec: str, vocab_size: int) -> None:
        """--draft-vocab: the drafter proposes only those tokens, its logits over a copy of their rows of
        the target's head (draft_vocab.py), taken before the pool is sized from what memory is left."""
        added = [] if self.tokenizer is None else sorted(self.tokenizer.added_tokens_decoder)
        ids = torch.tensor(draft_vocab_ids(spec, vocab_size, added, sorted(self.eos_ids)), device=self.device)
        self.drafter.use_vocab(ids, parallel.head_rows(self.target.lm_head, ids))
        log.info("draft vocabulary: %d of the target's %d tokens (--draft-vocab %s)", len(ids), vocab_size, spec)

    # ---- memory -----------------------------------------------------------------------------------

    def needed_bytes(self, context: int) -> int:
        """What serving one request of `context` tokens takes at the configured tree, beside every row
        the pool keeps (memory.py)."""
        return self.sizing.needed_bytes(context, self.tree_slots, self.rows)

    def capacity(self) -> dict[str, int]:
        """The KV pool in tokens and pages, how many requests of SHORT_REQUEST tokens and of the full
        context it holds (each with one round's reservation), and what is in use now."""
        tree_slots, request_pages = self.tree_slots, self.sizing.request_pages
        pages = self.pages.num_pages
        return {"page_size": self.page_size, "pages_total": pages, "tokens": pages * self.page_size,
                "pages_used": self.pages.used_pages, "pages_free": self.pages.free_pages,
                "pages_shared": self.pages.shared_pages, "max_running": self.slots,
                "max_context": self.max_context,
                "requests_8k": min(self.slots, pages // request_pages(min(SHORT_REQUEST, self.max_context), tree_slots)),
                "requests_full_context": min(self.slots, pages // request_pages(self.max_context, tree_slots))}

    @property
    def can_serve(self) -> bool:
        """False only if a re-size failed after the old pool was dropped and the old one could not be
        put back (the server's /health reports it)."""
        return self.runner.can_serve

    @property
    def phase_hook(self):
        """Called with each phase's name as a step's phases start ("prefill", the round's "tree",
        "verify", "draft", "commit") and with "end" after them: the benchmarks time phases with it;
        None (the default) costs nothing."""
        return self.runner.phase_hook

    @phase_hook.setter
    def phase_hook(self, hook) -> None:
        self.runner.phase_hook = hook

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
            self.scheduler.release(req)

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
        """Whether the request waits for its first admission (False once admitted, finished or unknown;
        requests are first admitted in the order they came)."""
        return self.scheduler.queued(request_id)

    @torch.inference_mode()
    def step(self) -> list[tuple[int, RoundOutput]]:
        """One step: the scheduler decides it (the running requests' rounds first in the token budget,
        prompt pieces in the rest, admitting queued requests while rows are free), the runner computes
        it, and the scheduler takes its tokens back (finished requests leave). Returns (request id,
        output) for each request that produced tokens. A step that is one round and nothing else tells
        the budget policy its time (costs.py: the round's one read is inside it, so no sync is added);
        not with a phase hook, whose syncs at each phase stretch the round (2-3 ms of 20 on the H200)."""
        started = self._clock()
        batch = self.scheduler.schedule()
        result = self.runner.run(batch)
        outputs = self.scheduler.postprocess(batch, result)
        if batch.decoding:
            alone = (not batch.prefills and batch.resize is None and result.error is None
                     and self.phase_hook is None)
            self.policy.timed(self._clock() - started if alone else None)
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

    @torch.inference_mode()
    def warm_up(self, batches: Sequence[int] | None = None) -> WarmUp:
        """Run before any traffic what traffic will run, so that Triton compiles its kernels and the
        runners capture their CUDA graphs now, not on the engine's thread while users wait (a served
        engine measured 20% of its time compiling and 12% capturing, docs/performance.md). For each
        batch size in `batches` (by default every batch bucket of the round, largest first, where
        graphs are captured; one request without them: nothing to compile), that many short prompts
        of different lengths arrive together (one grouped prefill), then one round of the configured
        mode runs at that batch size, at the smallest KV bucket. By default, with the cost policy, it then
        times a round at every batch bucket and budget the policy may choose (costs.py). Its requests neither reuse nor leave
        cached sequences and the stats and the policy's acceptance outlook are put back, so the pool and
        every counter are as before.
        Needs an idle engine with nothing cached (RuntimeError)."""
        if self.has_work or (self.prefix is not None and len(self.prefix)):
            raise RuntimeError("warm_up() runs before serving: on an idle engine with nothing cached")
        sweep, swept = batches is None and self.policy.by_cost, 0  # the default one times the round (costs.py)
        if batches is None:
            buckets = {batch_bucket(n, self.slots) for n in range(1, self.slots + 1)}
            batches = sorted(buckets, reverse=True) if self.runner.use_graphs else [1]
        started, kept = time.perf_counter(), dataclasses.replace(self.stats)
        outlook = dataclasses.replace(self.policy.prior)  # made-up prompts teach nothing of real acceptance
        prefix, hook = self.scheduler.prefix, self.phase_hook
        self.scheduler.prefix = self.phase_hook = None  # no reuse, no cached sequence left behind; no bench phases
        vocab, ids, per_batch, workers = self.target.config.vocab_size, [], [], {}
        try:
            # compiles go wide over worker processes: what the last warm-up recorded and the cache lacks at
            # once, and each autotuner's candidates before it times them (compile_pool)
            with parallel_compiles(None if self.device.type == "cuda" else 0, preload=(FLA_MODULE,),
                                   shipped=self.shipped_record) as pool:
                for n in batches:
                    batch_started = time.perf_counter()
                    # first tokens differ, so no two prompts share a page (admission counts shared pages);
                    # 4 to 79 tokens (WARM_UP_PROMPT_MAX: the least pool holds one): a group's rows differ
                    # in length, all within the smallest KV bucket
                    lengths = [min(WARM_UP_PROMPT_MAX - 5 * (15 - i % 16), self.max_context - WARM_UP_NEW_TOKENS)
                               for i in range(n)]
                    ids += [self.submit([(i + 1 + 3 * j) % vocab for j in range(length)], WARM_UP_PARAMS)
                            for i, length in enumerate(lengths)]
                    while self.has_work:
                        self.step()
                    per_batch.append(round(time.perf_counter() - batch_started, 2))
                if pool is not None and pool.outcomes:
                    workers = pool.summary()
            if sweep:
                swept = measure_round_costs(self)
        finally:
            for request_id in ids:
                self.cancel(request_id)  # a no-op for those that finished
            self.scheduler.prefix, self.phase_hook, self.policy.prior = prefix, hook, outlook
            captures = self.stats.graph_captures - kept.graph_captures
            for f in dataclasses.fields(kept):
                setattr(self.stats, f.name, getattr(kept, f.name))
        done = WarmUp(time.perf_counter() - started, tuple(batches), len(ids) + swept, captures, tuple(per_batch),
                      workers)
        log.info("warm-up: %d request(s) at batch sizes %s, %d CUDA graph(s) captured, in %.1f s%s", done.requests,
                 ", ".join(map(str, done.batches)), done.graph_captures, done.seconds,
                 f"; Triton kernels compiled by {workers['workers']} worker processes: {workers['outcomes']} "
                 f"({workers['from_record']} from {workers['record'] or 'no'} record), waited {workers['waited_s']} s"
                 if workers else "")
        return done

    # ---- request setup ----------------------------------------------------------------------------

    def _new_request(self, prompt_ids: list[int], p: SamplingParams) -> RequestState:
        self.info.limits.check(prompt_ids, p)  # RequestRefused (a ValueError): never servable
        mode = mode_named(p.mode or self.config.mode)
        budget = self.info.limits.budget(p)
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
            self.runner.check_resize(tree_slots)
        self._next_id += 1
        return req

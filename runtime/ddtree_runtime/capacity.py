"""What one GPU's memory holds for a target and its drafter: the KV pool in tokens, and so how many
requests of a given length run at once. Pure arithmetic from the models' config.json dicts, with no
torch, so ddops can show it in a pivot's plan (and refuse a profile that cannot serve one request of
its max_context) and the runtime can log the same figures at start-up.

    pool_tokens = (memory x mem_fraction - weights - workspaces - max_running x request_state) / token_bytes

- weights: both models' parameters (counted from their configs) in the serving dtype;
- workspaces: one prefill's activations at max_context (the engine's bound, engine/context.py);
- request_state: what a running request holds outside the pool: a hybrid target's recurrent and conv
  state per linear layer, and the tree pass's per-node scratch (engine/kv_cache.py, HybridCache);
- token_bytes: a token's KV in the target's full-attention layers and in the drafter's full layers;
- a drafter's sliding-window layers keep no per-token KV in the pool: each row keeps their last
  positions in a ring of `ring_length` slots (the window and two blocks), counted in request_state
  (twice with the prefix cache: a snapshot at the prompt, engine/draft_cache.py).

With tensor parallelism over T GPUs the figures are one GPU's (model/parallel.py's split): its share of
every layer's heads, KV heads and MLP rows and of the LM head's vocabulary (`Shape.split`), and whole
the embeddings, the norms and the drafter, which every rank runs; the pool's tokens are the server's, each
GPU keeping its share of every token's target KV.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .drafter_layout import drafter_layout, draft_value

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The engine's constants, declared here (torch-free) and imported by it: prompt tokens per prefill
# forward (engine/prefill.py says why this many), and the sizes a tree pass is padded to (engine/runner.py's
# graph buckets): root + 2^k draft nodes (a budget of 2^k), and from 8 on 2^k nodes as well (a budget of
# 2^k - 1), for the policy by cost to take where the last node is worth less than it costs: on an H100 a
# round of 16 rows of 16-node trees of the 27B took 38.5 ms against 41.5 at 17 nodes (its GEMMs ~0.6 ms
# of the 3; an 8B layer's GEMMs on the H200 took 14.7% longer at 272 rows than at 256; docs/performance.md
# "Session 27").
PREFILL_PIECE = 32768
TREE_BUCKETS = (1, 2, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 1025)
SHORT_REQUEST = 8192    # the "requests of 8K" the plan and the start-up line count
RING_ALIGN = 64         # a sliding layer's ring is a whole number of these slots (the decode kernel's key blocks)


def ring_length(window: int, block_size: int) -> int:
    """Slots of a sliding-window drafter layer's ring per row (engine/draft_cache.py): the window, and
    what one drafter pass writes past the committed context (up to a block of new context, then the
    block), so that no write reaches a key a query of the pass still sees."""
    return -(-(window + 2 * block_size) // RING_ALIGN) * RING_ALIGN


def _is_drafter(config: dict[str, Any]) -> bool:
    return "dflash_config" in config or any("DFlash" in a for a in config.get("architectures") or [])


def _text(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: multimodal checkpoints (Qwen3.5/3.6) keep it under text_config."""
    return config.get("text_config") or config


def _layer_kinds(text: dict[str, Any]) -> list[str]:
    """Each layer's kind: the config's layer_types, else a full-attention layer every
    full_attention_interval layers in a hybrid, else all full attention."""
    n = text["num_hidden_layers"]
    if text.get("layer_types"):
        return list(text["layer_types"])
    if text.get("model_type", "").startswith("qwen3_5"):
        interval = text.get("full_attention_interval", 4)
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    return ["full_attention"] * n


@dataclass(frozen=True)
class Shape:
    """The numbers of a config.json the arithmetic needs (a target, or a DFlash drafter)."""

    vocab: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    full_layers: int
    linear_layers: int = 0
    tied: bool = False
    bias: bool = False
    gated: bool = False           # a hybrid's full-attention layers gate their output (q_proj doubled)
    conv_kernel: int = 4
    key_heads: int = 0            # linear layers: Hk x dk keys, Hv x dv values
    key_dim: int = 0
    value_heads: int = 0
    value_dim: int = 0
    positions: int = 40960
    feature_layers: int = 0       # a drafter: the target layers it reads
    block_size: int = 0           # a drafter: its block size
    window_layers: int = 0        # a drafter: its sliding-window layers (besides full_layers), kept in rings
    window: int = 0               # ... their largest window
    head_vocab: int | None = None  # a tensor-parallel rank's LM head rows (None: the whole vocabulary)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Shape":
        text = _text(config)
        kinds = _layer_kinds(text)
        hybrid = "linear_attention" in kinds
        heads = text["num_attention_heads"]
        dflash = config.get("dflash_config") or {}
        windows = [a.window for a in drafter_layout(config).attention] if _is_drafter(config) else []
        sliding = [w for w in windows if w is not None]
        return cls(vocab=text["vocab_size"], hidden=text["hidden_size"], intermediate=text["intermediate_size"],
                   heads=heads, kv_heads=text.get("num_key_value_heads", heads),
                   head_dim=text.get("head_dim") or text["hidden_size"] // heads,
                   full_layers=len(windows) - len(sliding) if windows else kinds.count("full_attention"),
                   linear_layers=kinds.count("linear_attention"),
                   tied=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
                   bias=bool(text.get("attention_bias", False)), gated=hybrid,
                   conv_kernel=text.get("linear_conv_kernel_dim", 4),
                   key_heads=text.get("linear_num_key_heads", 16) if hybrid else 0,
                   key_dim=text.get("linear_key_head_dim", 128) if hybrid else 0,
                   value_heads=text.get("linear_num_value_heads", 32) if hybrid else 0,
                   value_dim=text.get("linear_value_head_dim", 128) if hybrid else 0,
                   positions=text.get("max_position_embeddings", 40960),
                   feature_layers=len(dflash.get("target_layer_ids") or []),
                   block_size=int(draft_value(config, "block_size", 16)),
                   window_layers=len(sliding), window=max(sliding, default=0))

    def split_counts(self) -> dict[str, int]:
        """What tensor parallelism shares out evenly, each rank an equal part: the attention heads, the
        KV heads, the MLP's intermediate rows, and a hybrid's linear-attention key and value heads."""
        counts = {"attention heads": self.heads, "KV heads": self.kv_heads, "MLP intermediate size": self.intermediate}
        if self.linear_layers:
            counts.update({"linear-attention key heads": self.key_heads, "linear-attention value heads":
                           self.value_heads})
        return counts

    def split(self, ranks: int) -> "Shape":
        """What one of `ranks` tensor-parallel ranks holds of this target: its share of the heads, of the
        MLP's intermediate rows and of the LM head's vocabulary (padded to a multiple of the ranks),
        rounded up; the embeddings and the hidden size (so the norms and the residual stream) whole."""
        if ranks == 1:
            return self
        def share(n: int) -> int:
            return -(-n // ranks)
        return replace(self, intermediate=share(self.intermediate), heads=share(self.heads),
                       kv_heads=share(self.kv_heads), key_heads=share(self.key_heads),
                       value_heads=share(self.value_heads), head_vocab=share(self.vocab))

    @property
    def conv_dim(self) -> int:
        """Channels of a linear layer's causal conv: its q, k and v."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def token_bytes(self, elem: int) -> int:
        """One token's K and V in every full-attention layer."""
        return 2 * self.full_layers * self.kv_heads * self.head_dim * elem

    def ring_bytes(self, elem: int, block_size: int, snapshots: bool = False) -> int:
        """A drafter row's rings: each sliding layer's K and V at ring_length slots (and one scratch
        slot), twice with `snapshots` (the prefix cache keeps the ring at the prompt's snapshot point)."""
        if not self.window_layers:
            return 0
        slots = ring_length(self.window, block_size) + 1
        return 2 * self.window_layers * self.kv_heads * self.head_dim * elem * slots * (2 if snapshots else 1)

    def state_bytes(self, elem: int) -> int:
        """A hybrid's per-request state: each linear layer's float32 recurrent state (Hv x dk x dv) and
        its conv tail (kernel - 1 inputs); 0 for a plain transformer."""
        recurrent = 4 * self.value_heads * self.key_dim * self.value_dim
        return self.linear_layers * (recurrent + elem * (self.conv_kernel - 1) * self.conv_dim)

    def request_bytes(self, nodes: int, elem: int, snapshots: bool = False) -> int:
        """What a row of the engine's pool holds beside its pages: the state, and with `snapshots` (the
        prefix cache on a hybrid) its end-of-prompt copy, and the tree scratch."""
        return self.state_bytes(elem) * (2 if snapshots else 1) + self.tree_scratch_bytes(nodes, elem)

    def tree_scratch_bytes(self, nodes: int, elem: int) -> int:
        """A hybrid's per-request scratch for a tree pass of `nodes` nodes (inputs, keys, values, decays
        per node and linear layer) and the per-layer [Hv, nodes, nodes] float32 matrices of one pass."""
        if not self.linear_layers:
            return 0
        per_node = 4 * self.value_heads * (self.key_dim + self.value_dim + 1) + elem * self.conv_dim
        return self.linear_layers * nodes * per_node + 6 * 4 * self.value_heads * nodes * nodes

    def _layer_parameters(self) -> tuple[int, int]:
        """Parameters of one full-attention layer and of one linear-attention layer (each with its MLP
        and two norms)."""
        h, q = self.hidden, self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        mlp_and_norms = 3 * h * self.intermediate + 2 * h
        attention = h * q * (2 if self.gated else 1) + 2 * h * kv + q * h + 2 * self.head_dim
        if self.bias:
            attention += q * (2 if self.gated else 1) + 2 * kv + h
        values = self.value_heads * self.value_dim
        linear = (h * self.conv_dim + h * values + 2 * h * self.value_heads + self.conv_dim * self.conv_kernel
                  + self.value_dim + values * h + 2 * self.value_heads)
        return attention + mlp_and_norms, linear + mlp_and_norms

    def target_parameters(self) -> int:
        full, linear = self._layer_parameters()
        # the LM head is the embeddings when tied, unless split over ranks (then each keeps its rows apart)
        head = 0 if self.tied and self.head_vocab is None else (self.head_vocab or self.vocab) * self.hidden
        embeddings = self.vocab * self.hidden + head
        return embeddings + self.full_layers * full + self.linear_layers * linear + self.hidden

    def drafter_parameters(self) -> int:
        """A DFlash drafter: its layers, the projection of the target's features, two norms; it shares
        the target's embeddings and head."""
        full, _ = self._layer_parameters()
        layers = self.full_layers + self.window_layers
        return layers * full + self.hidden * self.feature_layers * self.hidden + 2 * self.hidden


def tree_bucket(nodes: int) -> int:
    return next((b for b in TREE_BUCKETS if nodes <= b), TREE_BUCKETS[-1])


def round_reserve(tree_slots: int, block_size: int) -> int:
    """Positions past a request's context that one round may write: its tree of `tree_slots` nodes
    (and a lone AR step's pass ahead), the drafter's new context rows and block."""
    return max(tree_slots + 1, 2 * block_size)


def round_tree_slots(mode: str, tree_budget: int, block_size: int) -> int:
    """Nodes (root included) a round of `mode` verifies (engine/modes.py's Mode.tree_slots): a root
    alone (ar), the drafter's chain (dflash), or the tree's budget and its root (ddtree)."""
    if mode == "ar":
        return 1
    return block_size if mode == "dflash" else tree_budget + 1


# The least request a server must hold to start at all: the start-up warm-up's longest (engine.warm_up:
# prompts of 4 to WARM_UP_PROMPT_MAX tokens, WARM_UP_NEW_TOKENS new tokens each).
WARM_UP_PROMPT_MAX, WARM_UP_NEW_TOKENS = 79, 2


def least_pool_tokens(mode: str, tree_budget: int, block_size: int, page_size: int,
                      max_context: int | None = None) -> int:
    """The smallest KV pool (in tokens, whole pages) that serves: one warm-up request of the longest
    kind (within `max_context`) with one round's reservation for `mode`. A smaller pool cannot start."""
    longest = min(WARM_UP_PROMPT_MAX + WARM_UP_NEW_TOKENS, max_context or WARM_UP_PROMPT_MAX + WARM_UP_NEW_TOKENS)
    tokens = longest - 1 + round_reserve(round_tree_slots(mode, tree_budget, block_size), block_size)
    return -(-tokens // page_size) * page_size


def pool_too_small(name: str, tokens: int, least: int, mode: str, page_size: int) -> str:
    """The one line that refuses a pool of `tokens` under `least_pool_tokens` (`name`: the setting's)."""
    return (f"{name} {tokens}: too small to serve: the start-up warm-up's longest request "
            f"({WARM_UP_PROMPT_MAX + WARM_UP_NEW_TOKENS} tokens) with one {mode} round's reservation needs "
            f"{least} tokens in pages of {page_size}: give at least {least}")


def prefill_workspace_bytes(target: Shape, context: int, feature_layers: int, elem: int) -> int:
    """A bound on a prefill's live activations at `context` prompt tokens, run in pieces of at most
    PREFILL_PIECE (the engine sizes its pool with it, engine/memory.py): per token of a piece the MLP's
    gate|up and their product (3 x intermediate), the residual stream, its normed copy and a layer's
    output (3 x hidden), doubled for the attention and linear layers' own temporaries and the allocator;
    and the piece's drafter features (hidden per feature layer), held through the pass, with their
    projection and its norm (2 x hidden): the drafter's context is written a piece at a time, so
    nothing scales with the whole prompt but one layer's earlier keys and values, which a later piece
    (or a chunk beside running requests) gathers from the pages into a contiguous copy (2 x context x
    KV heads x head_dim). For the Qwen3.6-27B shape this gives 1.3 GiB at 4K, 10.4 at 32K and 10.9 at
    128K (in 32K pieces); measured above weights and caches on an H200 (docs/performance.md), with the
    whole prompt's features then kept for the first draft: 1.2 GiB at 4K, 9.4 at 32K in one piece,
    11.5 at 128K in 16K pieces (8.8 GiB of it those features)."""
    piece = min(context, PREFILL_PIECE)
    gathered = 2 * context * target.kv_heads * target.head_dim
    return elem * (piece * (2 * (3 * target.intermediate + 3 * target.hidden) + (feature_layers + 2) * target.hidden)
                   + gathered)


@dataclass(frozen=True)
class Capacity:
    """What the pool holds on one GPU, and the figures it comes from (bytes)."""

    memory_bytes: int
    mem_fraction: float
    weights_bytes: int
    workspace_bytes: int
    request_bytes: int          # per running request, outside the pool
    max_running: int
    token_bytes: int            # per token in the pool (target + the drafter's full layers' KV)
    reserve_tokens: int         # a request's tokens beyond its context: the tree pass and the drafter's block
    max_context: int
    tensor_parallel: int = 1    # GPUs the server spans; the bytes above are one GPU's

    @property
    def usable_bytes(self) -> int:
        """As the engine sizes its pool: mem_fraction of the memory the weights leave free, less a
        prefill's workspace and the running requests' own state."""
        free = self.memory_bytes - self.weights_bytes
        return int(free * self.mem_fraction) - self.workspace_bytes - self.max_running * self.request_bytes

    @property
    def pool_tokens(self) -> int:
        return max(0, self.usable_bytes // self.token_bytes)

    def requests(self, context: int) -> int:
        """Requests of `context` tokens the pool holds at once (before max_running caps them)."""
        return self.pool_tokens // (context + self.reserve_tokens)

    def running(self, context: int) -> int:
        """... and how many of them run at once: at most max_running."""
        return min(self.max_running, self.requests(context))

    def summary(self) -> str:
        """The capacity in one line: the pool, and requests of 8K and of the full context at once."""
        short = min(SHORT_REQUEST, self.max_context)
        label = "8K" if short == SHORT_REQUEST else f"{short:,}"
        return (f"KV pool of {self.pool_tokens:,} tokens: {self.running(short)} request(s) of {label} at once, "
                f"{self.running(self.max_context)} of max_context {self.max_context:,} "
                f"(max_running {self.max_running})")

    def breakdown(self) -> str:
        """Where the memory goes, for a refusal or a plan's detail."""
        gib = 2**30
        return (f"{self.memory_bytes / gib:.1f} GiB less weights {self.weights_bytes / gib:.1f} GiB, x mem_fraction "
                f"{self.mem_fraction:g}, less workspaces {self.workspace_bytes / gib:.1f} GiB and "
                f"{self.max_running} x {self.request_bytes / gib:.2f} GiB of request state, leaves "
                f"{max(0, self.usable_bytes) / gib:.1f} GiB at {self.token_bytes:,} bytes a token")


def pool_capacity(memory_bytes: int, target_config: dict[str, Any], draft_config: dict[str, Any] | None, *,
                  dtype: str, mem_fraction: float, max_running: int, max_context: int | None = None,
                  tree_budget: int = 16, block_size: int | None = None, tensor_parallel: int = 1,
                  prefix_cache: bool = True, draft_vocab: int = 0) -> Capacity:
    """The pool on a GPU of `memory_bytes`, for these models served in `dtype` (`draft_config` None:
    mode ar, no drafter). `max_context` None: the target's positions; `block_size` None: the drafter's;
    `tensor_parallel` T: the target split over T such GPUs, the drafter whole on each; `prefix_cache`: a
    hybrid's rows keep a prompt snapshot of their state, and a sliding drafter's of its rings (the
    engine's default); `draft_vocab`: rows of the target's head the drafter keeps a copy of
    (--draft-vocab), whole on each rank."""
    elem = DTYPE_BYTES[dtype]
    whole = Shape.from_config(target_config)
    target = whole.split(tensor_parallel)
    drafter = Shape.from_config(draft_config) if draft_config is not None else None
    context = max_context or whole.positions
    block = (block_size or drafter.block_size) if drafter is not None else 1
    tree_slots = max(tree_budget, block) + 1  # as the engine sizes its pool
    nodes = tree_bucket(tree_slots)
    weights = target.target_parameters() * elem
    token = target.token_bytes(elem)
    features, rings = 0, 0
    if drafter is not None:
        weights += (drafter.drafter_parameters() + draft_vocab * whole.hidden) * elem
        token += drafter.token_bytes(elem)
        features = drafter.feature_layers
        rings = drafter.ring_bytes(elem, block, snapshots=prefix_cache)
    return Capacity(memory_bytes=memory_bytes, mem_fraction=mem_fraction, weights_bytes=weights,
                    workspace_bytes=prefill_workspace_bytes(target, context, features, elem),
                    request_bytes=target.request_bytes(nodes, elem, snapshots=prefix_cache) + rings,
                    max_running=max_running, token_bytes=token, reserve_tokens=round_reserve(tree_slots, block),
                    max_context=context, tensor_parallel=tensor_parallel)


def longest_context(memory_bytes: int, target_config: dict[str, Any], draft_config: dict[str, Any] | None,
                    **settings: Any) -> int:
    """The longest max_context at which one request fits (its prefill's workspace shrinks with it too);
    0 when not even one token does. `settings`: pool_capacity's, but max_context."""
    def fits(context: int) -> bool:
        pool = pool_capacity(memory_bytes, target_config, draft_config, max_context=context, **settings)
        return pool.requests(context) >= 1

    lo, hi = 0, Shape.from_config(target_config).positions + 1   # fits(lo) (or lo is 0); not fits(hi)
    if fits(hi - 1):
        return hi - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo

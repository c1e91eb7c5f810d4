"""Every setting of `ddtree-serve`, declared once: its name, type, bounds, default, help and flag, and
whether the engine takes it and a deploy profile may set it. From this table come the server's
argparse flags, `ServerConfig`, `EngineConfig` (its fields and defaults), and ddops's check of a
profile's `serve:` block and the unit's command line, so a default or a bound cannot differ between them.

Adding a setting is one `Setting(...)` below plus the code that uses it. Standard library only (and
`limits`): ddops loads this on the control machine, where torch need not be installed.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from .limits import (DTYPE_NAMES, FP8_GEMMS, MAX_QUEUE, MAX_RUNNING, MAX_TREE_BUDGET, MIN_BLOCK_SIZE, MIN_MEM_FRACTION,
                     MIN_TREE_BUDGET, MODES, QUANTIZE_METHODS, TREE_POLICIES)

# A request body larger than this is a 413 before it is read: 4 MiB holds a 262k-token conversation
# several times over (about 4 bytes of JSON a token), and bounds what parsing one request may cost.
DEFAULT_MAX_BODY = 4 * 2**20
# The chat endpoint's parsers, by the names SGLang gives them (server/output_parsers.py implements them).
TOOL_CALL_PARSERS = ("hermes", "qwen3_coder")
REASONING_PARSERS = ("qwen3",)
# The largest tree budget a request may ask for, unless --max-tree-budget says otherwise: 4x the default
# budget. A bigger tree makes every batched round it joins slower (the verify pads to the largest tree).
DEFAULT_MAX_TREE_BUDGET = 64
_MISSING = object()


@dataclass(frozen=True)
class Setting:
    """One serve setting. `type` is int, float, str, bool or dict (a JSON object on the command line);
    a default of None means "off", or "derived at start-up" as `default_words` says. A bool defaulting to
    True is turned off by `--no-NAME`; one defaulting to False is turned on by `--NAME`."""

    name: str                           # the ServerConfig field (and EngineConfig's, and a profile's serve: key)
    type: type
    default: Any = _MISSING             # _MISSING: required
    help: str = ""
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    pattern: str | None = None          # a str value must fullmatch it...
    pattern_words: str | None = None    # ...which says this
    engine: bool = False                # an EngineConfig field: the server hands it to the engine
    profile: bool = False               # a deploy profile may set it under `serve:` (same name)
    flag_name: str | None = None        # the flag, when not --NAME-WITH-DASHES
    aliases: tuple[str, ...] = ()       # older flags that still set it
    metavar: str | None = None
    default_words: str | None = None    # the default in --help, where the value alone does not say it

    @property
    def required(self) -> bool:
        return self.default is _MISSING

    @property
    def flag(self) -> str:
        if self.flag_name:
            return self.flag_name
        dashed = self.name.replace("_", "-")
        return f"--no-{dashed}" if self.type is bool and self.default is True else f"--{dashed}"

    def default_value(self) -> Any:
        """The default, a fresh copy for a dict."""
        return dict(self.default) if isinstance(self.default, dict) else self.default

    def describe_default(self) -> str:
        if self.default_words:
            return self.default_words
        if self.type is bool:
            return "on" if self.default else "off"
        return "none" if self.default is None else str(self.default)

    def problem(self, value: Any) -> str | None:
        """Why `value` is out of this setting's bounds, in words (None: it is within them)."""
        if value is None:
            return None if self.default is None else "must be given"
        if self.choices is not None and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            return f"expected {self.pattern_words or 'a value matching ' + self.pattern}"
        if self.minimum is not None and value < self.minimum:
            return f"must be >= {self.minimum:g}"
        if self.maximum is not None and value > self.maximum:
            return f"must be <= {self.maximum:g}"
        return None


# In this order: the flags in --help, the fields of both configs, the flags of a deployed unit (which
# ddops keeps in the order they had before this table, so a pivot that changes nothing rewrites no unit).
SERVE_SETTINGS: tuple[Setting, ...] = (
    # what the engine loads and how it decodes
    Setting("target_dir", str, help="target model directory", engine=True, flag_name="--target", metavar="DIR"),
    Setting("draft_dir", str, None, "DFlash drafter directory (required unless --mode ar)", engine=True,
            flag_name="--draft", metavar="DIR"),
    Setting("mode", str, "ddtree", "decoding mode", choices=MODES, engine=True, profile=True),
    Setting("block_size", int, None, "draft block size", minimum=MIN_BLOCK_SIZE, engine=True, profile=True,
            metavar="N", default_words="the drafter's"),
    Setting("tree_budget", int, 16, "tree nodes verified per round: the most, by the cost policy; every "
            "round's, by the fixed one", minimum=MIN_TREE_BUDGET, maximum=MAX_TREE_BUDGET, engine=True, profile=True,
            metavar="B"),
    Setting("tree_policy", str, "fixed", "how each round's tree budget is chosen: cost = the one that maximises "
            "the batch's expected tokens/s, from round costs measured at warm-up and learnt from every round, "
            "and each request's acceptance (plain AR rounds when they are faster), up to the tree budget; "
            "fixed = the tree budget every round. "
            "A request's speculative.tree_budget is always its own", choices=TREE_POLICIES, engine=True,
            profile=True),
    Setting("draft_vocab", str, None, "the tokens the drafter may propose: N = the N lowest ids and the "
            "tokenizer's added tokens, or a file of token ids (JSON list, one a line, or a .pt tensor: SGLang's "
            "--speculative-token-map); the drafter's LM head reads only those rows. Output is unchanged (the "
            "target verifies every token); acceptance falls where the target's next token is outside them",
            engine=True, metavar="N|FILE", default_words="the target's whole vocabulary"),
    Setting("max_tree_budget", int, DEFAULT_MAX_TREE_BUDGET, "largest speculative.tree_budget a request may ask "
            "for; larger is a 400 (a bigger tree slows every batched round it joins)", minimum=MIN_TREE_BUDGET,
            maximum=MAX_TREE_BUDGET, profile=True, metavar="B",
            default_words=f"{DEFAULT_MAX_TREE_BUDGET}, or --tree-budget if that is larger"),
    # where it listens (a deploy profile's `bind` and `port`)
    Setting("host", str, "127.0.0.1", "bind address"),
    Setting("port", int, 8000, "bind port", minimum=0, maximum=65535),
    Setting("device", str, None, "cpu, cuda or cuda:N", pattern=r"cpu|cuda(:\d+)?",
            pattern_words="cpu, cuda or cuda:N", engine=True, default_words="cuda when a GPU is visible, else cpu"),
    Setting("dtype", str, None, "weights dtype", choices=DTYPE_NAMES, engine=True,
            default_words="bfloat16 on a GPU, float32 on the CPU"),
    Setting("quantization", str, "none", "fp8: the target's projections in FP8 (128x128 blocks, activations per "
            "token) at load, half the weight bytes; exact against the FP8 model, not the 16-bit one. A checkpoint "
            "that is FP8 already loads as FP8 without it", choices=QUANTIZE_METHODS, engine=True, profile=True,
            flag_name="--quantize"),
    Setting("fp8_gemm", str, "auto", "the FP8 GEMM on Hopper: auto = cuBLASLt's block-scaled GEMM where its rows "
            "do not depend on each other (fastest from ~272 rows: prefill, many running), triton = the Triton "
            "kernel's wgmma tiles (fastest up to ~128 rows: decode with few running); docs/performance.md",
            choices=FP8_GEMMS, engine=True, profile=True),
    Setting("quantize_drafter", bool, False, "quantize the drafter too, with --quantize's method (the drafter "
            "stays in 16 bits unless asked)", engine=True),
    Setting("served_model_name", str, None, "model id clients use", profile=True, metavar="NAME",
            default_words="the target's name"),
    # how much it serves at once
    Setting("max_context", int, None, "limit on prompt + completion tokens", minimum=1, engine=True, profile=True,
            metavar="N", default_words="the target's positions, as far as memory holds"),
    Setting("max_running", int, 16, "requests decoded together, each round one batch (like SGLang's "
            "--max-running-requests)", minimum=1, maximum=MAX_RUNNING, engine=True, profile=True, metavar="N"),
    Setting("tensor_parallel", int, 1, "GPUs one server spans: the target's layers split over them, one process each (the GPUs from CUDA_VISIBLE_DEVICES)", minimum=1, maximum=8, engine=True, profile=True, metavar="N"),
    Setting("rank_timeout", float, 300.0, "with --tensor-parallel: seconds one engine call (a step, a submission, a "
            "cancellation) may wait on the other ranks; past it the rank that stalled is named and the server "
            "stops, exit 1", minimum=1, metavar="S"),
    Setting("max_queue", int, 16, "requests waiting behind the running ones before 429", minimum=1,
            maximum=MAX_QUEUE, engine=True, profile=True, metavar="N"),
    Setting("mem_fraction", float, 0.9, "share of the free device memory the KV pool may take; fewer requests "
            "than --max-running if it holds fewer", minimum=MIN_MEM_FRACTION, maximum=1, engine=True,
            profile=True, metavar="F"),
    Setting("page_size", int, 16, "tokens per KV page (docs/performance.md says why 16)", minimum=1, maximum=4096,
            engine=True, metavar="N"),
    Setting("kv_pool_tokens", int, None, "the KV pool's size in tokens, fixed", minimum=1, engine=True, metavar="N",
            default_words="as many as --mem-fraction of the free memory holds"),
    # vLLM's max_num_batched_tokens, SGLang's chunked_prefill_size. 8192: on the H200 (burst_bench.py)
    # a burst of 16 x 8K prompts (27B) is 1.08x their prefill one by one and a running request waits at
    # most 1.19x a step's prefill; 4096 misses both, 16384 doubles the wait (docs/performance.md)
    Setting("max_batched_tokens", int, 8192, "tokens one step computes: the running requests' rounds first, "
            "prompt pieces of waiting requests in the rest, so a long prompt stalls the running ones for at "
            "most one step of this many tokens", minimum=1, engine=True, metavar="N",
            aliases=("--prefill-chunk",)),
    Setting("round_nodes", int, None, "the most tree nodes a round verifies over all running requests: by "
            "--tree-policy cost, no larger round is chosen; by fixed, each request gets an equal share",
            minimum=1, engine=True, metavar="N", default_words="no limit"),
    Setting("prefix_cache_rows", int, 0, "slots beyond --max-running that only hold cached prefixes, each the "
            "memory of one running request", minimum=0, maximum=MAX_RUNNING, engine=True, profile=True,
            metavar="N", default_words="0, idle running slots only"),
    Setting("prefix_cache", bool, True, "the prefix cache: finished requests' KV kept for prompts that start "
            "with them, in idle slots until a request needs one, least recently used first", engine=True,
            profile=True),
    # what the chat endpoint makes of the model's text and the template (issue 18)
    Setting("tool_call_parser", str, None, "how the model writes tool calls", choices=TOOL_CALL_PARSERS,
            profile=True, default_words="hermes for a qwen3 target, qwen3_coder for qwen3_5"),
    Setting("reasoning_parser", str, None, "return <think>...</think> as reasoning_content",
            choices=REASONING_PARSERS, profile=True, default_words="off, left in the content"),
    Setting("chat_template_kwargs", dict, {}, "chat template variables for requests that set none, e.g. "
            "'{\"enable_thinking\": false}'", profile=True, metavar="JSON",
            default_words="the template's own defaults"),
    # who may call it, and how it stops
    Setting("api_key", str, None, "require 'Authorization: Bearer KEY' (or set DDTREE_API_KEY, which keeps the "
            "key out of the process list)", metavar="KEY"),
    Setting("insecure_no_auth", bool, False, "allow a non-loopback --host without an API key (anyone who "
            "reaches the port may use it)"),
    Setting("max_body", int, DEFAULT_MAX_BODY, "largest request body; larger is a 413", minimum=1,
            metavar="BYTES"),
    Setting("drain_timeout", float, 30.0, "on SIGTERM, seconds to let in-flight requests finish", minimum=0,
            metavar="S"),
    Setting("log_level", str, "info", "log level", choices=("debug", "info", "warning", "error")),
)

BY_NAME = {s.name: s for s in SERVE_SETTINGS}
ENGINE_SETTINGS = tuple(s for s in SERVE_SETTINGS if s.engine)
PROFILE_SETTINGS = tuple(s for s in SERVE_SETTINGS if s.profile)


def help_text(setting: Setting) -> str:
    """The flag's help: the setting's, and its default (a --no-NAME flag turns the setting off)."""
    if setting.required:
        return setting.help
    words = f"turn off {setting.help}" if setting.type is bool and setting.default else setting.help
    return f"{words} (default: {setting.describe_default()})"


def add_arguments(parser, settings: tuple[Setting, ...] = SERVE_SETTINGS) -> None:
    """Each setting as an argparse flag (bounds are checked after parsing, by `problems`)."""
    for s in settings:
        kwargs: dict[str, Any] = {"dest": s.name, "help": help_text(s)}
        if s.type is bool:
            kwargs["action"] = "store_false" if s.default else "store_true"
        else:
            kwargs.update(type=str if s.type is dict else s.type, metavar=s.metavar)
            if s.required:
                kwargs["required"] = True
            else:
                kwargs["default"] = "{}" if s.type is dict else s.default
            if s.choices is not None:
                kwargs.update(choices=s.choices, metavar=None)
        parser.add_argument(s.flag, *s.aliases, **kwargs)


def problems(values: dict[str, Any], settings: tuple[Setting, ...] = SERVE_SETTINGS) -> list[str]:
    """`--flag VALUE: why` for every value out of its setting's bounds."""
    found = []
    for s in settings:
        why = s.problem(values.get(s.name)) if s.type is not dict else None
        if why:
            found.append(f"{s.flag} {values.get(s.name)}: {why}")
    return found


def config_class(name: str, module: str, settings: tuple[Setting, ...], doc: str, *, frozen: bool = True,
                 extra_fields: tuple = (), namespace: dict | None = None):
    """A dataclass with one field per setting (in table order), its defaults the table's, then
    `extra_fields` (make_dataclass's (name, type, field) triples)."""
    fields: list[tuple] = []
    for s in settings:
        hint = s.type if s.default is _MISSING or s.default is not None else s.type | None
        if s.required:
            fields.append((s.name, hint))
        elif isinstance(s.default, dict):
            fields.append((s.name, hint, dataclasses.field(default_factory=s.default_value)))
        else:
            fields.append((s.name, hint, dataclasses.field(default=s.default)))
    cls = dataclasses.make_dataclass(name, fields + list(extra_fields), frozen=frozen, namespace=namespace)
    cls.__doc__, cls.__module__ = doc, module
    return cls


def resolve_device(device: str | None, dtype: str | None) -> tuple[str, str]:
    """(device, dtype) with what was not given filled in: the GPU when torch sees one (as vLLM and
    SGLang do), else the CPU; bfloat16 on a GPU, float32 on the CPU (where bfloat16 matmuls are slow)."""
    if device is None:
        import torch  # only where a server or engine starts: ddops loads this module without torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:
        dtype = "float32" if device == "cpu" else "bfloat16"
    return device, dtype

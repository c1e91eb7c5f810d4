"""Server settings, fixed at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..limits import MODES  # noqa: F401 - the CLI's --mode choices, from their one home

# A request body larger than this is a 413 before it is read: 4 MiB holds a 262k-token conversation
# several times over (about 4 bytes of JSON a token), and bounds what parsing one request may cost.
DEFAULT_MAX_BODY = 4 * 2**20
# The largest tree budget a request may ask for, unless --max-tree-budget says otherwise: 4x the default
# budget. A bigger tree makes every batched round it joins slower (the verify pads to the largest tree).
DEFAULT_MAX_TREE_BUDGET = 64


@dataclass(frozen=True)
class ServerConfig:
    # What the engine loads (turned into an EngineConfig on the worker thread).
    target_dir: str
    draft_dir: str | None
    mode: str = "ddtree"
    block_size: int | None = None
    tree_budget: int = 16
    device: str = "cpu"
    dtype: str = "float32"
    max_context: int | None = None
    max_running: int = 16                 # requests decoded together (like SGLang's --max-running-requests)
    mem_fraction: float = 0.9             # share of the free device memory the cache pool may take
    prefill_chunk: int = 512              # prompt tokens prefilled per step beside the running requests
    round_nodes: int | None = None        # adaptive tree budget: tree nodes per round over all requests
    prefix_cache: bool = True             # reuse cached prefixes of finished requests (engine/prefix_cache.py)
    prefix_cache_rows: int = 0            # pool rows beyond max_running that only hold cached sequences
    # How the server behaves.
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 16
    max_body: int = DEFAULT_MAX_BODY
    max_tree_budget: int = DEFAULT_MAX_TREE_BUDGET  # a request's speculative.tree_budget, at most
    served_model_name: str | None = None
    drain_timeout: float = 30.0
    # What the chat endpoint makes of the model's text and the template (issue 18).
    tool_call_parser: str | None = None  # hermes | qwen3_coder; None: from the target's architecture
    reasoning_parser: str | None = None  # qwen3: <think>...</think> -> reasoning_content; None: off
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # the service's template defaults

    def engine_kwargs(self) -> dict:
        return {
            "target_dir": self.target_dir,
            "draft_dir": self.draft_dir,
            "mode": self.mode,
            "block_size": self.block_size,
            "tree_budget": self.tree_budget,
            "device": self.device,
            "dtype": self.dtype,
            "max_context": self.max_context,
            "max_running": self.max_running,
            "mem_fraction": self.mem_fraction,
            "prefill_chunk": self.prefill_chunk,
            "round_nodes": self.round_nodes,
            "prefix_cache": self.prefix_cache,
            "prefix_cache_rows": self.prefix_cache_rows,
        }

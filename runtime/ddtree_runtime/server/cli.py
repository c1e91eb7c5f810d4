"""``ddtree-serve``: parse flags, check them, run the app under uvicorn with a draining SIGTERM.

Exit codes: 0 after a clean shutdown (SIGTERM/SIGINT, drained), 2 for bad command-line input,
uvicorn's own non-zero codes if the port cannot be bound.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from ddtree_runtime.limits import MAX_QUEUE, MAX_RUNNING, MAX_TREE_BUDGET, MIN_MEM_FRACTION
from ddtree_runtime.server.config import DEFAULT_MAX_BODY, DEFAULT_MAX_TREE_BUDGET, MODES, ServerConfig
from ddtree_runtime.server.output_parsers import REASONING_PARSERS, TOOL_PARSERS
from ddtree_runtime.server.schemas import RESERVED_TEMPLATE_ARGS

log = logging.getLogger("ddtree_runtime.server")

API_KEY_ENV = "DDTREE_API_KEY"
DTYPES = ("float32", "float16", "bfloat16")
GRACEFUL_CLOSE_S = 5.0  # after draining: how long uvicorn waits for idle connections to close


class UsageError(Exception):
    """Bad command-line input: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ddtree-serve", description="OpenAI-compatible server doing DDTree speculative decoding.")
    p.add_argument("--target", required=True, metavar="DIR", help="target model directory")
    p.add_argument("--draft", metavar="DIR", help="DFlash drafter directory (required unless --mode ar)")
    p.add_argument("--mode", choices=MODES, default="ddtree", help="decoding mode (default: ddtree)")
    p.add_argument("--block-size", type=int, metavar="N", help="draft block size (default: the drafter's)")
    p.add_argument("--tree-budget", type=int, default=16, metavar="B", help="tree nodes verified per round (default: 16)")
    p.add_argument("--max-tree-budget", type=int, default=DEFAULT_MAX_TREE_BUDGET, metavar="B",
                   help="largest speculative.tree_budget a request may ask for; larger is a 400 (default: "
                        f"{DEFAULT_MAX_TREE_BUDGET}, or --tree-budget if that is larger)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="bind port (default: 8000)")
    p.add_argument("--api-key", metavar="KEY", help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV}, "
                   "which keeps the key out of the process list)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow a non-loopback --host without an API key (anyone who reaches the port may use it)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu)")
    p.add_argument("--dtype", choices=DTYPES, help="weights dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--max-running", type=int, default=16, metavar="N",
                   help="requests decoded together, each round one batch (default: 16)")
    p.add_argument("--mem-fraction", type=float, default=0.9, metavar="F",
                   help="share of the free device memory the KV pool may take; fewer slots than --max-running "
                        "if it holds fewer (default: 0.9)")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="N",
                   help="prompt tokens prefilled per step, so running requests keep decoding (default: 512)")
    p.add_argument("--round-nodes", type=int, metavar="N",
                   help="adaptive tree budget: tree nodes verified per round over all running requests, shared "
                        "between them (default: off, each request's own budget)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="do not keep finished requests' KV for prompts that start with them (default: kept in "
                        "idle slots until a request needs the slot, least recently used first)")
    p.add_argument("--prefix-cache-rows", type=int, default=0, metavar="N",
                   help="slots beyond --max-running that only hold cached prefixes, each the memory of one "
                        "running request (default: 0, idle running slots only)")
    p.add_argument("--max-queue", type=int, default=16, metavar="N",
                   help="requests waiting behind the running ones before 429 (default: 16)")
    p.add_argument("--max-body", type=int, default=DEFAULT_MAX_BODY, metavar="BYTES",
                   help=f"largest request body; larger is a 413 (default: {DEFAULT_MAX_BODY})")
    p.add_argument("--served-model-name", metavar="NAME", help="model id clients use (default: the target's name)")
    p.add_argument("--max-context", type=int, metavar="N", help="limit on prompt + completion tokens")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds to let in-flight requests finish (default: 30)")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls (default: hermes for a qwen3 target, qwen3_coder for "
                        "qwen3_5)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                   help="return <think>...</think> as reasoning_content (default: off, left in the content)")
    p.add_argument("--chat-template-kwargs", metavar="JSON", default="{}",
                   help="chat template variables for requests that set none, e.g. '{\"enable_thinking\": false}' "
                        "(default: the template's own defaults)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return p


def config_from_args(args: argparse.Namespace, environ: dict[str, str]) -> ServerConfig:
    target = _model_dir(args.target, "--target")
    if args.draft is None and args.mode != "ar":
        raise UsageError(f"--draft DIR is required for --mode {args.mode} (only --mode ar runs without a drafter)")
    draft = _model_dir(args.draft, "--draft") if args.draft is not None else None
    _positive(args.block_size, "--block-size")
    _positive(args.tree_budget, "--tree-budget", MAX_TREE_BUDGET)
    _positive(args.max_tree_budget, "--max-tree-budget", MAX_TREE_BUDGET)
    _positive(args.max_queue, "--max-queue", MAX_QUEUE)
    _positive(args.max_running, "--max-running", MAX_RUNNING)
    _positive(args.prefill_chunk, "--prefill-chunk")
    _positive(args.round_nodes, "--round-nodes")
    if args.prefix_cache_rows < 0:
        raise UsageError(f"--prefix-cache-rows {args.prefix_cache_rows}: must be >= 0")
    if args.prefix_cache_rows and not args.prefix_cache:
        raise UsageError("--prefix-cache-rows needs the prefix cache: drop --no-prefix-cache")
    if not MIN_MEM_FRACTION <= args.mem_fraction <= 1:
        raise UsageError(f"--mem-fraction {args.mem_fraction}: must be between {MIN_MEM_FRACTION} and 1")
    _positive(args.max_body, "--max-body")
    _positive(args.max_context, "--max-context")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: must be between 0 and 65535")
    if args.drain_timeout < 0:
        raise UsageError(f"--drain-timeout {args.drain_timeout}: must be >= 0")
    if args.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise UsageError(f"--device {args.device}: expected cpu, cuda or cuda:N")
    device, dtype = default_device(args.device, args.dtype)
    api_key = args.api_key if args.api_key is not None else environ.get(API_KEY_ENV)
    if not api_key and not _is_loopback(args.host) and not args.insecure_no_auth:
        raise UsageError(f"--host {args.host} without an API key would let anyone who reaches the port use "
                         f"the model: set {API_KEY_ENV} or --api-key (or pass --insecure-no-auth)")
    template_kwargs = _template_kwargs(args.chat_template_kwargs)
    return ServerConfig(
        target_dir=target,
        draft_dir=draft,
        mode=args.mode,
        block_size=args.block_size,
        tree_budget=args.tree_budget,
        device=device,
        dtype=dtype,
        max_context=args.max_context,
        max_running=args.max_running,
        mem_fraction=args.mem_fraction,
        prefill_chunk=args.prefill_chunk,
        round_nodes=args.round_nodes,
        prefix_cache=args.prefix_cache,
        prefix_cache_rows=args.prefix_cache_rows,
        host=args.host,
        port=args.port,
        api_key=api_key or None,
        max_queue=args.max_queue,
        max_body=args.max_body,
        max_tree_budget=args.max_tree_budget,
        served_model_name=args.served_model_name,
        drain_timeout=args.drain_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template_kwargs=template_kwargs,
    )


def default_device(device: str | None, dtype: str | None) -> tuple[str, str]:
    """(device, dtype) with what was not given filled in: the GPU when torch sees one (as vLLM and
    SGLang do), else the CPU; bfloat16 on a GPU, float32 on the CPU (where bfloat16 matmuls are slow)."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:
        dtype = "float32" if device == "cpu" else "bfloat16"
    return device, dtype


def _model_dir(path: str, flag: str) -> str:
    if not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: not a directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"{flag} {path}: no config.json there; is it a model directory?")
    return os.path.abspath(path)


def _template_kwargs(text: str) -> dict:
    """--chat-template-kwargs: a JSON object of template variables (none of apply_chat_template's own)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--chat-template-kwargs: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError("--chat-template-kwargs: expected a JSON object")
    clash = sorted(set(value) & RESERVED_TEMPLATE_ARGS)
    if clash:
        raise UsageError(f"--chat-template-kwargs: {clash[0]!r} is not a chat template variable")
    return value


def _positive(value: int | None, flag: str, ceiling: int | None = None) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{flag} {value}: must be >= 1")
    if value is not None and ceiling is not None and value > ceiling:
        raise UsageError(f"{flag} {value}: must be <= {ceiling}")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None, make_app: Callable[[ServerConfig], Any] | None = None) -> int:
    """Parse, build the app (``make_app``: app.create_app unless a wrapper brings its own) and serve
    until SIGTERM has drained it. Exit 2 on a usage error."""
    try:
        args = build_parser().parse_args(argv)
        config = config_from_args(args, dict(os.environ))
    except UsageError as exc:
        print(f"ddtree-serve: error: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    from ddtree_runtime.server.app import create_app
    from ddtree_runtime.server.draining import DrainingServer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.device is None or args.dtype is None:
        log.info("serving on %s in %s (%s)", config.device, config.dtype,
                 "chosen: no --device/--dtype given" if args.device is None else "--dtype follows --device")
    if not config.api_key and not _is_loopback(config.host):  # only with --insecure-no-auth
        bar = "!" * 78
        print(f"{bar}\nWARNING: ddtree-serve is listening on {config.host} WITHOUT an API key.\n"
              f"Anyone who can reach this port can use the model. Set {API_KEY_ENV} or --api-key.\n{bar}",
              file=sys.stderr)

    app = (make_app or create_app)(config)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=args.log_level,
                               timeout_graceful_shutdown=GRACEFUL_CLOSE_S, lifespan="on")
    server = DrainingServer(uv_config, app.state.ddtree)
    server.run()
    return 0

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
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ddtree_runtime import settings
from ddtree_runtime.capacity import Shape, least_pool_tokens, pool_too_small
from ddtree_runtime.draft_vocab import DraftVocabError, draft_vocab_ids
from ddtree_runtime.server import ranks
from ddtree_runtime.server.config import ServerConfig
from ddtree_runtime.quantization import UnsupportedCheckpoint, check_checkpoint
from ddtree_runtime.server.schemas import RESERVED_TEMPLATE_ARGS

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("ddtree_runtime.server")

API_KEY_ENV = "DDTREE_API_KEY"
GRACEFUL_CLOSE_S = 5.0  # after draining: how long uvicorn waits for idle connections to close


class UsageError(Exception):
    """Bad command-line input: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    """Every flag is a serve setting (settings.py): its type, default and help come from there."""
    p = _Parser(prog="ddtree-serve", description="OpenAI-compatible server doing DDTree speculative decoding.")
    settings.add_arguments(p)
    return p


def config_from_args(args: argparse.Namespace, environ: dict[str, str]) -> ServerConfig:
    """The table's bounds for every setting, then what no bound says: model dirs, the drafter the mode
    needs, the API key a public address needs, the template variables."""
    values = vars(args).copy()
    problems = settings.problems(values)
    if problems:
        raise UsageError(problems[0])
    values["target_dir"] = _model_dir(args.target_dir, "--target")
    if args.draft_dir is None and args.mode != "ar":
        raise UsageError(f"--draft DIR is required for --mode {args.mode} (only --mode ar runs without a drafter)")
    if args.draft_dir is not None:
        values["draft_dir"] = _model_dir(args.draft_dir, "--draft")
    if args.quantize_drafter and args.quantization == "none":
        raise UsageError("--quantize-drafter needs --quantize fp8")
    for flag, path in (("--target", values["target_dir"]), ("--draft", values.get("draft_dir"))):
        _implemented(path, flag)
    if args.kv_pool_tokens is not None:
        _pool_serves(args, values.get("draft_dir"))
    if args.draft_vocab is not None:
        _draft_vocab(args, values["target_dir"])
    if args.prefix_cache_rows and not args.prefix_cache:
        raise UsageError("--prefix-cache-rows needs the prefix cache: drop --no-prefix-cache")
    api_key = args.api_key if args.api_key is not None else environ.get(API_KEY_ENV)
    if not api_key and not _is_loopback(args.host) and not args.insecure_no_auth:
        raise UsageError(f"--host {args.host} without an API key would let anyone who reaches the port use "
                         f"the model: set {API_KEY_ENV} or --api-key (or pass --insecure-no-auth)")
    values["device"], values["dtype"] = settings.resolve_device(args.device, args.dtype)
    if args.tensor_parallel > 1:
        _splits(values["target_dir"], args.tensor_parallel, values["device"])
    values["api_key"] = api_key or None
    values["chat_template_kwargs"] = _template_kwargs(args.chat_template_kwargs)
    return ServerConfig(**values)


def _model_dir(path: str, flag: str) -> str:
    if not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: not a directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"{flag} {path}: no config.json there; is it a model directory?")
    return os.path.abspath(path)


def _implemented(path: str | None, flag: str) -> None:
    """A checkpoint whose quantization (config.json, tensor dtypes) the runtime does not implement is
    refused here, before anything loads: never served as if its codes were weights."""
    if path is None:
        return
    try:
        check_checkpoint(path)
    except UnsupportedCheckpoint as exc:
        raise UsageError(f"{flag} {exc}") from None
    except (OSError, ValueError) as exc:  # unreadable config.json or safetensors header
        raise UsageError(f"{flag} {path}: cannot read the checkpoint: {exc}") from None


def _pool_serves(args: argparse.Namespace, draft_dir: str | None) -> None:
    """--kv-pool-tokens: at least the pool that serves one request (capacity.least_pool_tokens)."""
    block = args.block_size
    if block is None:  # the drafter's (1 with none), as the engine takes it
        block = 1 if draft_dir is None else Shape.from_config(_config_json(draft_dir, "--draft")).block_size
    least = least_pool_tokens(args.mode, args.tree_budget, block, args.page_size, args.max_context)
    if args.kv_pool_tokens < least:
        raise UsageError(pool_too_small("--kv-pool-tokens", args.kv_pool_tokens, least, args.mode, args.page_size))


def _draft_vocab(args: argparse.Namespace, target_dir: str) -> None:
    """--draft-vocab: a drafter to apply it to, and ids the target's vocabulary has (draft_vocab.py)."""
    if args.mode == "ar":
        raise UsageError("--draft-vocab sets what the drafter proposes: --mode ar runs none")
    try:
        draft_vocab_ids(args.draft_vocab, Shape.from_config(_config_json(target_dir, "--target")).vocab)
    except DraftVocabError as exc:
        raise UsageError(str(exc)) from None


def _config_json(model_dir: str, flag: str) -> dict:
    try:
        return json.loads(Path(model_dir, "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag} {model_dir}: cannot read config.json: {exc}") from None


def _splits(target_dir: str, world: int, device: str) -> None:
    """--tensor-parallel N: the target's heads and rows must split over N ranks, each on its own GPU."""
    if device.startswith("cuda:"):
        raise UsageError(f"--tensor-parallel {world} takes its GPUs from CUDA_VISIBLE_DEVICES: give --device cuda, "
                         f"not {device}")
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < world:
            raise UsageError(f"--tensor-parallel {world} needs {world} GPUs, {torch.cuda.device_count()} visible "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    from ddtree_runtime.engine.distributed import split_problem

    problem = split_problem(target_dir, world)
    if problem:
        raise UsageError(problem)


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


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None, make_app: Callable[[ServerConfig], FastAPI] | None = None) -> int:
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

    follower = ranks.rank() if config.tensor_parallel > 1 else 0
    where = f" rank {follower}" if follower else ""
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s %(levelname)s{where} %(name)s: %(message)s")
    if follower:  # a tensor-parallel follower: no HTTP, rank 0's engine calls only
        ranks.end_process(ranks.follow(config))
    if args.device is None or args.dtype is None:
        log.info("serving on %s in %s (%s)", config.device, config.dtype,
                 "chosen: no --device/--dtype given" if args.device is None else "--dtype follows --device")
    if not config.api_key and not _is_loopback(config.host):  # only with --insecure-no-auth
        bar = "!" * 78
        print(f"{bar}\nWARNING: ddtree-serve is listening on {config.host} WITHOUT an API key.\n"
              f"Anyone who can reach this port can use the model. Set {API_KEY_ENV} or --api-key.\n{bar}",
              file=sys.stderr)

    followers = None
    if config.tensor_parallel > 1:
        followers = ranks.start_followers(sys.argv[1:] if argv is None else list(argv), config.tensor_parallel,
                                          config.rank_timeout)
    try:
        app = (make_app or create_app)(config)
        uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=GRACEFUL_CLOSE_S, lifespan="on")
        server = DrainingServer(uv_config, app.state.ddtree)
        server.run()
    finally:
        if followers is not None:
            followers.stop()
    if followers is not None:
        ranks.end_process(0)
    return 0

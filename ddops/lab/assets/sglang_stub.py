#!/usr/bin/python3
"""Lab stand-in for SGLang's `python -m sglang.launch_server` (installed on lab hosts as the module
`sglang.launch_server`): SGLang's flag names in an argparse parser (an unknown flag is refused, exit 2,
as SGLang's own parser does), the start-up checks SGLang makes on them (DFLASH with dp-attention, DFLASH
without a drafter, more tensor-parallel ranks than GPUs, more draft tokens than the drafter's block, and,
as some builds do, speculative decoding on a hybrid Mamba/linear-attention target without
`--mamba-scheduler-strategy extra_buffer`), then an OpenAI-compatible server: /health (200, empty body,
as SGLang's), /health_generate, /v1/models, /get_model_info and /v1/chat/completions, which answers
"echo: " and the last user message (it has no model), streaming or not. It holds memory on every lab
GPU it was given while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, "/usr/lib/python3/dist-packages")
try:
    import ddops_lab_gpu
except ImportError:
    ddops_lab_gpu = None

SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH")
MAMBA_STRATEGIES = ("auto", "no_buffer", "extra_buffer", "extra_buffer_lazy")
HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_next")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang.launch_server", description="SGLang server (ddops lab stand-in).")
    model = p.add_argument_group("Model and tokenizer")
    model.add_argument("--model-path", "--model", required=True, help="The path of the model weights.")
    model.add_argument("--tokenizer-path", help="The path of the tokenizer.")
    model.add_argument("--trust-remote-code", action="store_true", help="Allow custom models from the Hub.")
    model.add_argument("--dtype", default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    model.add_argument("--context-length", type=int, help="The model's maximum context length.")
    model.add_argument("--served-model-name", help="The model name in the API's responses and /v1/models.")
    http = p.add_argument_group("HTTP server")
    http.add_argument("--host", default="127.0.0.1", help="The host of the HTTP server.")
    http.add_argument("--port", type=int, default=30000, help="The port of the HTTP server.")
    http.add_argument("--api-key", help="Require this key as a bearer token.")
    http.add_argument("--log-level", default="info")
    memory = p.add_argument_group("Memory and scheduling")
    memory.add_argument("--mem-fraction-static", type=float, help="The fraction of GPU memory for static use.")
    memory.add_argument("--max-running-requests", type=int)
    memory.add_argument("--chunked-prefill-size", type=int)
    memory.add_argument("--disable-radix-cache", action="store_true")
    memory.add_argument("--cuda-graph-max-bs", type=int)
    memory.add_argument("--attention-backend", choices=["triton", "flashinfer", "fa3", "fa4", "torch_native"])
    parallel = p.add_argument_group("Parallelism")
    parallel.add_argument("--tp-size", "--tp", "--tensor-parallel-size", type=int, default=1)
    parallel.add_argument("--dp-size", "--dp", "--data-parallel-size", type=int, default=1)
    parallel.add_argument("--pp-size", "--pipeline-parallel-size", type=int, default=1)
    parallel.add_argument("--enable-dp-attention", action="store_true", help="Data parallelism for attention.")
    spec = p.add_argument_group("Speculative decoding")
    spec.add_argument("--speculative-algorithm", "--speculative-algo", choices=SPECULATIVE_ALGORITHMS)
    spec.add_argument("--speculative-draft-model-path", "--speculative-draft-model")
    spec.add_argument("--speculative-num-steps", type=int)
    spec.add_argument("--speculative-eagle-topk", type=int)
    spec.add_argument("--speculative-num-draft-tokens", type=int)
    mamba = p.add_argument_group("Mamba cache")
    mamba.add_argument("--mamba-scheduler-strategy", default="auto", choices=MAMBA_STRATEGIES,
                       help="extra_buffer keeps a ping-pong state buffer per request (needed by speculative "
                            "decoding on hybrid models in some builds).")
    mamba.add_argument("--max-mamba-cache-size", type=int)
    parsers = p.add_argument_group("Output parsing")
    parsers.add_argument("--tool-call-parser")
    parsers.add_argument("--reasoning-parser")
    return p


def read_config(path: str | None) -> dict:
    if not path:
        return {}
    try:
        with open(os.path.join(path, "config.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}   # a hub id, or no local config: nothing to check against


def is_hybrid(config: dict) -> bool:
    text = config.get("text_config") or config
    return (config.get("model_type") in HYBRID_TYPES or text.get("model_type") in HYBRID_TYPES
            or "linear_attention" in (text.get("layer_types") or []))


def visible_gpus() -> list[int]:
    """The lab GPUs this server may use: CUDA_VISIBLE_DEVICES's, else all of the host's."""
    try:
        count = int(ddops_lab_gpu.load_config()["count"]) if ddops_lab_gpu is not None else 0
    except (OSError, KeyError, ValueError):
        count = 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    return [int(d) for d in visible.split(",") if d.strip().isdigit() and int(d) < count]


def check(args: argparse.Namespace) -> None:
    """The start-up checks SGLang's ServerArgs makes on these flags: a ValueError ends the launch."""
    if args.tp_size > len(visible_gpus()):
        raise ValueError(f"tp_size {args.tp_size} needs {args.tp_size} GPUs; {len(visible_gpus())} visible")
    if args.speculative_algorithm == "DFLASH":
        if args.enable_dp_attention:
            raise ValueError("Currently DFLASH speculative decoding does not support dp attention.")
        if args.pp_size != 1:
            raise ValueError("Currently DFLASH speculative decoding only supports pp_size == 1.")
        if args.speculative_draft_model_path is None:
            raise ValueError("DFLASH speculative decoding requires setting --speculative-draft-model-path.")
        draft = read_config(args.speculative_draft_model_path)
        block = draft.get("block_size", (draft.get("dflash_config") or {}).get("block_size"))
        if block is not None and args.speculative_num_draft_tokens and args.speculative_num_draft_tokens > block:
            raise ValueError(f"--speculative-num-draft-tokens {args.speculative_num_draft_tokens} exceeds the "
                             f"DFLASH drafter's block_size {block}.")
    if args.speculative_algorithm and is_hybrid(read_config(args.model_path)) \
            and args.mamba_scheduler_strategy != "extra_buffer":
        raise ValueError("Speculative decoding on a hybrid (Mamba / linear attention) model needs "
                         "--mamba-scheduler-strategy extra_buffer.")


class Handler(BaseHTTPRequestHandler):
    server_version = "sglang-lab/0.2"
    protocol_version = "HTTP/1.1"
    model = "model"
    api_key: str | None = None

    def send_json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def authorized(self) -> bool:
        if self.api_key is None or self.headers.get("Authorization") == f"Bearer {self.api_key}":
            return True
        self.send_json(401, {"error": {"message": "Invalid API Key", "type": "invalid_request_error", "code": 401}})
        return False

    def do_GET(self) -> None:
        if self.path in ("/health", "/health_generate"):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif not self.authorized():
            return
        elif self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "sglang", "root": self.model}]})
        elif self.path == "/get_model_info":
            self.send_json(200, {"model_path": self.model, "is_generation": True})
        else:
            self.send_json(404, {"error": {"message": f"no route {self.path}", "code": 404}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if not self.authorized():
            return
        try:
            request = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            self.send_json(400, {"error": {"message": "body is not JSON", "code": 400}})
            return
        if self.path != "/v1/chat/completions":
            self.send_json(404, {"error": {"message": f"no route {self.path}", "code": 404}})
            return
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
            self.send_json(400, {"error": {"message": "messages must be a non-empty list", "code": 400}})
            return
        last = str(messages[-1].get("content", ""))
        text = f"echo: {last}"
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if request.get("stream"):
            self.stream(rid, text)
            return
        self.send_json(200, {
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": len(last.split()), "completion_tokens": len(text.split()),
                      "total_tokens": len(last.split()) + len(text.split())}})

    def stream(self, rid: str, text: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for i, word in enumerate(text.split(" ")):
            chunk = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model,
                     "choices": [{"index": 0, "delta": {"content": word if i == 0 else " " + word},
                                  "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        done = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model,
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        self.wfile.write(f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode())
        self.close_connection = True

    def log_message(self, fmt: str, *args) -> None:
        print(f"{self.address_string()} {fmt % args}", flush=True)


def main() -> int:
    args = build_parser().parse_args()   # an unknown flag: usage and exit 2, as SGLang's parser does
    try:
        check(args)
    except ValueError as exc:
        print(f"ValueError: {exc}", file=sys.stderr, flush=True)
        return 1
    Handler.model = args.served_model_name or args.model_path
    Handler.api_key = args.api_key or os.environ.get("SGLANG_API_KEY")
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    if ddops_lab_gpu is not None:
        try:
            ddops_lab_gpu.hold(visible_gpus(), int(os.environ.get("SGLANG_GPU_MIB", "88000")))
        except (OSError, KeyError, ValueError) as err:
            print(f"warning: could not register GPU memory: {err}", flush=True)
    print(f"serving {Handler.model} on http://{args.host}:{args.port}"
          + (f" ({args.speculative_algorithm}, mamba {args.mamba_scheduler_strategy})" if args.speculative_algorithm
             else ""), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

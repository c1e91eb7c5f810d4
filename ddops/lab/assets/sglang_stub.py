#!/usr/bin/python3
"""Lab stand-in for an SGLang server: /health, /v1/models and an echoing /v1/chat/completions
on 127.0.0.1:30000, holding memory on every lab GPU while it runs."""

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

MODEL = os.environ.get("SGLANG_MODEL", "Qwen/Qwen3-8B")


class Handler(BaseHTTPRequestHandler):
    server_version = "sglang-lab/0.1"
    protocol_version = "HTTP/1.1"

    def send_json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": 0, "owned_by": "sglang", "root": MODEL}]})
        elif self.path == "/get_model_info":
            self.send_json(200, {"model_path": MODEL, "is_generation": True})
        else:
            self.send_json(404, {"error": {"message": f"no route {self.path}", "code": 404}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            request = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError:
            self.send_json(400, {"error": {"message": "body is not JSON", "code": 400}})
            return
        if self.path != "/v1/chat/completions":
            self.send_json(404, {"error": {"message": f"no route {self.path}", "code": 404}})
            return
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            self.send_json(400, {"error": {"message": "messages must be a non-empty list", "code": 400}})
            return
        last = str(messages[-1].get("content", ""))
        text = f"echo: {last}"
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if request.get("stream"):
            self.stream(rid, text)
            return
        self.send_json(200, {
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": len(last.split()), "completion_tokens": len(text.split()),
                      "total_tokens": len(last.split()) + len(text.split())}})

    def stream(self, rid: str, text: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        words = text.split(" ")
        for i, word in enumerate(words):
            piece = word if i == 0 else " " + word
            chunk = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": MODEL, "choices": [{"index": 0, "delta": {"content": piece},
                                                  "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        done = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": MODEL, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        self.wfile.write(f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode())
        self.close_connection = True

    def log_message(self, fmt: str, *args) -> None:
        print(f"{self.address_string()} {fmt % args}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=int(os.environ.get("SGLANG_PORT", "30000")))
    parser.add_argument("--gpu-mib", type=int, default=int(os.environ.get("SGLANG_GPU_MIB", "88000")))
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    if ddops_lab_gpu is not None:
        try:
            ddops_lab_gpu.hold(list(range(int(ddops_lab_gpu.load_config()["count"]))), args.gpu_mib)
        except (OSError, KeyError, ValueError) as err:
            print(f"warning: could not register GPU memory: {err}", flush=True)
    print(f"serving {MODEL} on http://{args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

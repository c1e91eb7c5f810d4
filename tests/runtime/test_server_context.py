"""A request longer than the configured context is an OpenAI-style 400 (context_length_exceeded), and
the server goes on serving: the next request is answered. A configured context the device cannot hold
is said at start, by /health, with the longest that fits."""

from __future__ import annotations

import time

import httpx
import pytest
from starlette.testclient import TestClient

from ddtree_runtime.engine import Engine, EngineConfig
from ddtree_runtime.server.app import create_app
from ddtree_runtime.server.config import ServerConfig
from ddtree_devtools.server_process import ServerProcess

pytestmark = pytest.mark.slow

CONTEXT = 300


def test_too_long_a_request_is_a_400_and_the_next_is_served(tiny_models):
    args = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
            "--served-model-name", "tiny", "--max-context", str(CONTEXT)]
    with ServerProcess(args) as srv:
        srv.wait_ready()
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            for prompt, max_tokens, param in (([7] * (CONTEXT + 1), 4, "prompt"),
                                              ([7] * (CONTEXT - 10), 11, "max_tokens")):
                r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert (error["code"], error["type"], error["param"]) == (
                    "context_length_exceeded", "invalid_request_error", param)
                assert f"context is {CONTEXT} tokens" in error["message"]
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "1\n2\n3\n", "max_tokens": 8,
                                                   "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8


def test_a_context_the_device_cannot_hold_is_said_at_start(tiny_models, monkeypatch):
    models = (str(tiny_models / "target"), str(tiny_models / "draft"))
    free = Engine(EngineConfig(*models, max_context=CONTEXT)).needed_bytes(CONTEXT)
    monkeypatch.setattr("ddtree_runtime.engine.memory.free_bytes", lambda device: free)   # the device holds CONTEXT
    config = ServerConfig(target_dir=models[0], draft_dir=models[1], served_model_name="tiny",
                          max_context=2 * CONTEXT)
    with TestClient(create_app(config), raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 60
        while (health := client.get("/health").json())["status"] == "starting":
            assert time.monotonic() < deadline, health
            time.sleep(0.05)
    assert health["status"] == "error", health
    assert f"max context {2 * CONTEXT} needs" in health["detail"]
    assert f"the longest context that fits is {CONTEXT} tokens" in health["detail"]

"""The hostile pass of issue 23, for what must be seen from inside the process: /health during a pool
re-size, what reaches the tokenizer, the prep thread's queue, a model steered into writing what its
parser cannot read, seeds under --round-nodes, who waits for a bigger tree, client text posing as
control tokens, a half-sent body at shutdown, and the device a bare `ddtree-serve` picks.

Each test failed on the code before issue 23's fixes (f025b22) and passes after them. The inputs sent
to a real server are in test_runtime_hostile.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx
import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from ddtree_devtools.engine_runs import serve
from ddtree_devtools.server_process import HOST, ServerProcess
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine import model_runner as runner_module
from ddtree_runtime.server import cli, routes
from ddtree_runtime.server.config import ServerConfig
from ddtree_runtime.server.context import ServerContext
from ddtree_runtime.server.errors import APIError
from ddtree_runtime.server.metrics import Metrics
from ddtree_runtime.server.prompts import ControlTokens, render_chat
from ddtree_runtime.server.schemas import ChatCompletionRequest
from ddtree_runtime.server.worker import READY
from tests.reliability.test_runtime_cache_refusal import ready_app

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "array"}}}}}]


@pytest.fixture(scope="module")
def api(tiny_models):
    """The app in this process on the tiny Qwen3 pair (tree budget 16; requests may ask up to 1,024)."""
    with ready_app(tiny_models) as client:
        yield client


def _ctx(api: TestClient) -> ServerContext:
    return api.app.state.ddtree


@pytest.fixture(scope="module")
def hybrid_api(tiny_hybrid_models):
    """The same on the hybrid pair, whose per-node tree scratch is what a bigger tree re-sizes (an
    attention-only target's paged pool holds any tree as it is)."""
    with ready_app(tiny_hybrid_models) as client:
        yield client


# -- item 1: a re-size that succeeds is not an error -------------------------------------------------


def test_health_stays_ok_while_the_pool_is_resized(hybrid_api, monkeypatch):
    api = hybrid_api
    build, seen = runner_module.target_cache, []

    def watched(*args, **kwargs):  # runs on the worker thread, between dropping the old pool and the new
        seen.append(_ctx(api).worker.health())
        return build(*args, **kwargs)
    monkeypatch.setattr(runner_module, "target_cache", watched)
    r = api.post("/v1/completions", json={"model": "tiny", "prompt": "1\n2\n", "max_tokens": 4, "temperature": 0,
                                          "speculative": {"tree_budget": 600}})  # past the pool's cache
    assert r.status_code == 200, r.text
    assert seen and all(state == READY for state, _ in seen), seen
    assert api.get("/health").json()["status"] == "ok"


# -- item 5: the text is bounded before it is tokenized; the prep thread's wait is bounded -----------


def test_a_text_far_over_the_context_never_reaches_the_tokenizer(api, monkeypatch):
    tok = _ctx(api).worker.engine.tokenizer
    lengths: list[int] = []
    encode = tok.encode

    def spy(text, *args, **kwargs):
        lengths.append(len(text))
        return encode(text, *args, **kwargs)
    monkeypatch.setattr(tok, "encode", spy)
    huge = "x " * 500_000  # a million characters against a 2,048-token context
    for path, body, param in (("/v1/completions", {"prompt": huge}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages")):
        r = api.post(path, json={"model": "tiny", "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "context_length_exceeded"
    assert max(lengths, default=0) < 100_000, lengths


def test_the_prep_threads_queue_is_bounded_by_max_queue(tiny_models):
    """As many requests may wait for the prep thread as the server takes at once (running + queue)."""
    class Worker:
        def retry_after_s(self) -> int:
            return 3

        def capacity(self) -> int:
            return 1
    config = ServerConfig(target_dir=str(tiny_models / "target"), draft_dir=None, max_queue=1)
    ctx = ServerContext(config, Worker(), Metrics())
    release = threading.Event()

    async def scenario():
        held = [asyncio.ensure_future(ctx.off_loop(release.wait)) for _ in range(3)]  # one at work, two wait
        await asyncio.sleep(0)
        refused = asyncio.ensure_future(ctx.off_loop(release.wait))
        await asyncio.sleep(0)
        try:
            assert refused.done() and isinstance(refused.exception(), APIError)
            assert refused.exception().status == 429 and refused.exception().headers["Retry-After"] == "3"
        finally:
            release.set()
            await asyncio.gather(*held, refused, return_exceptions=True)
    try:
        asyncio.run(scenario())
    finally:
        release.set()
        ctx.prep_pool.shutdown(wait=True)


# -- item 4: the model's own output never crashes the parser, streamed or not ------------------------


def _steered_into_deep_json(api: TestClient, stream: bool) -> dict:
    """A named tool_choice, then 1,100 "[" (logit_bias; </tool_call> is a stop token masked by
    min_tokens), then </tool_call>: JSON nested past the parser's recursion limit."""
    tok = _ctx(api).worker.engine.tokenizer
    bracket, close = tok.encode("[")[0], tok.convert_tokens_to_ids("</tool_call>")
    return {"model": "tiny", "messages": [{"role": "user", "content": "call f"}], "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "f"}}, "temperature": 0,
            "logit_bias": {str(bracket): 60, str(close): 100}, "stop_token_ids": [close], "min_tokens": 1100,
            "max_tokens": 1150, "stream": stream, "speculative": {"mode": "ar"}}


def test_deep_json_from_the_model_comes_back_as_content(api):
    r = api.post("/v1/chat/completions", json=_steered_into_deep_json(api, stream=False))
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"].count("[") >= 1100
    with api.stream("POST", "/v1/chat/completions", json=_steered_into_deep_json(api, stream=True)) as s:
        events = [line for line in s.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    content = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert content.count("[") >= 1100


def test_a_stream_that_fails_ends_with_an_error_event_and_done(api, monkeypatch):
    def broken(self, text, final=False):
        raise RuntimeError("a bug while shaping the reply")
    monkeypatch.setattr(routes._Shape, "deltas", broken)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with api.stream("POST", "/v1/chat/completions", json=body) as s:
        events = [line for line in s.iter_lines() if line]
    assert json.loads(events[-2][6:])["error"]["type"] == "server_error" and events[-1] == "data: [DONE]"


# -- items 6 and 9: a bigger tree holds nobody; draws are per position -------------------------------


@pytest.fixture(scope="module")
def engine(tiny_models) -> Engine:
    return Engine(EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft"), tree_budget=16,
                               max_running=4, round_nodes=40))


def test_a_bigger_tree_does_not_hold_the_requests_behind_it(engine):
    tok = engine.tokenizer
    prompt = tok("1 2 3 4", add_special_tokens=False)["input_ids"]
    long = engine.submit(prompt, SamplingParams(max_new_tokens=40))
    while not engine.scheduler.running:
        engine.step()
    big = SamplingParams(max_new_tokens=8, tree_budget=600)  # past what the pool holds: a re-size
    later = [engine.submit(prompt, big), engine.submit(prompt, SamplingParams(max_new_tokens=8))]
    texts: dict[int, list[int]] = {i: [] for i in later}
    for _ in range(4):
        for i, out in engine.step():
            texts.setdefault(i, []).extend(out.token_ids)
    running = {r.id for r in engine.scheduler.running}
    assert long in running and not engine.scheduler.waiting and all(texts[i] for i in later)
    while engine.has_work:
        for i, out in engine.step():
            texts.setdefault(i, []).extend(out.token_ids)
    alone = [t for r in engine.generate(prompt, big) for t in r.token_ids]  # now the pool grows for it
    assert texts[later[0]] == alone  # the tree it ran with changed its speed, not its text


def test_a_seed_reproduces_batched_and_alone_under_round_nodes(engine):
    """--round-nodes 40: a request alone gets a 16-node tree, one of four an 8-node tree."""
    tok = engine.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("cat dog", "The weather", "1 2 3", "Once")]
    requests = [(p, SamplingParams(max_new_tokens=16, temperature=0.8, seed=100 + i)) for i, p in enumerate(prompts)]
    alone = [[t for r in engine.generate(p, q) for t in r.token_ids] for p, q in requests]
    assert serve(engine, requests) == alone


# -- items 7 and 8: no client text becomes a control token -------------------------------------------


@pytest.mark.parametrize("pair", ["tiny_models", "tiny_hybrid_models"])
def test_every_added_token_and_placeholder_in_client_text_stays_text(request, pair):
    tok = AutoTokenizer.from_pretrained(request.getfixturevalue(pair) / "target")
    controls = ControlTokens(tok)
    added = {t.content: i for i, t in tok.added_tokens_decoder.items()}
    placeholders = "".join(chr(0x100000 + i) for i in range(len(added) + 2))

    def prompt(text: str) -> list[int]:
        req = ChatCompletionRequest.model_validate({"messages": [
            {"role": "user", "content": text},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "f", "arguments": json.dumps({"a": text})}}]},
            {"role": "tool", "tool_call_id": "c", "content": text}], "tools": TOOLS})
        return render_chat(tok, controls, req, {}, None).ids

    plain = prompt("a b")
    for text, token in [*added.items(), (placeholders, None)]:
        hostile = prompt(f"a{text}b")
        counts = {i: (hostile.count(i), plain.count(i)) for i in added.values()}
        assert all(h == p for h, p in counts.values()), (text, counts)
        assert f"a{text}b" in tok.decode(hostile, skip_special_tokens=False)


# -- item 10: a half-sent body holds neither the drain nor the log -----------------------------------


def test_a_half_sent_body_does_not_hold_the_shutdown(tiny_models):
    args = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
            "--drain-timeout", "120"]
    with ServerProcess(args) as srv:
        srv.wait_ready()
        with socket.create_connection((HOST, srv.port), timeout=30) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b'Content-Length: 100000\r\n\r\n{"messages": [')
            deadline = time.monotonic() + 30
            while "ddtree_requests_in_flight 1.0" not in httpx.get(srv.url + "/metrics").text.splitlines():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            srv.signal(signal.SIGTERM)
            reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 503"), reply
        assert srv.wait_exit(60) == 0  # not the 120 s drain: nothing was in flight
        log = srv.log_tail(chars=10**9)
        assert "Traceback" not in log and "CancelledError" not in log, log


# -- item 12: a bare ddtree-serve uses the GPU when there is one --------------------------------------


@pytest.mark.parametrize("gpu, device, dtype", [(True, "cuda", "bfloat16"), (False, "cpu", "float32")])
def test_the_device_defaults_to_the_gpu_when_one_is_visible(tiny_models, monkeypatch, gpu, device, dtype):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    args = cli.build_parser().parse_args(["--target", str(tiny_models / "target"), "--mode", "ar"])
    config = cli.config_from_args(args, {})
    assert (config.device, config.dtype) == (device, dtype)
    explicit = cli.build_parser().parse_args(["--target", str(tiny_models / "target"), "--mode", "ar",
                                              "--device", "cpu"])
    assert cli.config_from_args(explicit, {}).device == "cpu"

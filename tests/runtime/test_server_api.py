"""ddtree-serve end to end: a real server process, the real engine and tiny models, the official
``openai`` client. One server for the module (model load + warm-up takes seconds).

The server runs through ddtree_devtools.serve, which adds POST /_test/fault: it pauses the engine (to
fill the queue deterministically), slows rounds down (to disconnect mid-generation) and injects
engine errors. See ddtree_devtools.faults.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest

from ddtree_devtools.server_process import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Count from 3 to 20."}]
PROMPT = "1\n2\n3\n4\n"


@pytest.fixture(scope="module")
def server(tiny_models):
    args = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
            "--served-model-name", MODEL, "--max-queue", "2", "--drain-timeout", "5"]
    with ServerProcess(args, faults=True) as srv:
        srv.wait_ready()
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
        c.post("/_test/fault", json={"paused": False, "round_delay_s": 0, "engine_errors": 0})


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _chat(client, **kw):
    kw = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 48, **kw}
    return client.chat.completions.create(**kw)


def _spec(obj) -> dict:
    return obj.model_dump()["usage"]["speculative"]


def _stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join((c.choices[0].delta.content or "") if c.choices and hasattr(c.choices[0], "delta")
                   else (c.choices[0].text if c.choices else "") for c in chunks)
    return text, chunks


def _metrics(http) -> dict[str, float]:
    """Parse the Prometheus text into {'name{labels}': value}; every sample line must parse."""
    r = http.get("/metrics")
    assert r.status_code == 200
    samples = {}
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_]\w*="(?:[^"\\]|\\.)*",?)*\})? (\S+)', line)
        assert m, f"unparseable metrics line: {line!r}"
        samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return samples


def _eventually(check, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _wait_metric(http, name: str, pred, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = _metrics(http)[name]
        if pred(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


# --- happy paths --------------------------------------------------------------------------------


def test_health_and_models(server, client):
    code, body = server.health()
    assert code == 200
    assert body["status"] == "ok"
    assert body["mode"] == "ddtree" and body["tree_budget"] == 16
    assert body["max_draft_len"] == body["block_size"] - 1 > 0
    assert body["model"] == MODEL and body["draft_model"] == "draft" and body["target_arch"] == "qwen3"
    assert body["quantization"] == "none" and body["uptime_s"] > 0
    assert "fp8_gemm" not in body   # named only when FP8 is in use
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_non_stream(client):
    resp = _chat(client)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.model == MODEL and resp.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens > 0 and resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    spec = _spec(resp)
    assert spec["mode"] == "ddtree" and spec["tree_budget"] == 16
    assert spec["rounds"] >= 1 and spec["mean_acceptance_length"] >= 1.0


def test_chat_stream_equals_non_stream_and_carries_usage(client):
    full = _chat(client)
    text, chunks = _stream_text(_chat(client, stream=True, stream_options={"include_usage": True}))
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == full.choices[0].finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert _spec(last) == _spec(full)


def test_completions_stream_and_non_stream(client):
    kw = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 24}
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].text
    assert full.usage.completion_tokens <= 24
    text, chunks = _stream_text(client.completions.create(**kw, stream=True))
    assert text == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage is None  # include_usage not asked for


def test_max_tokens_gives_length_finish(client):
    resp = _chat(client, max_tokens=3)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 3
    resp = _chat(client, max_tokens=None, max_completion_tokens=2)
    assert resp.usage.completion_tokens == 2


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_cut_from_the_output(client, stream):
    full = _chat(client).choices[0].message.content
    assert len(full) > 6, full
    stop = full[3:5]
    want = full[: full.index(stop)]
    if stream:
        text, chunks = _stream_text(_chat(client, stop=[stop, "never-there"], stream=True))
        reason = [c for c in chunks if c.choices and c.choices[0].finish_reason][0].choices[0].finish_reason
    else:
        resp = _chat(client, stop=stop)
        text, reason = resp.choices[0].message.content, resp.choices[0].finish_reason
    assert text == want and reason == "stop"


def test_speculative_override_ar_vs_ddtree(client):
    ar = _chat(client, max_tokens=40, extra_body={"speculative": {"mode": "ar"}})
    dd = _chat(client, max_tokens=40, extra_body={"speculative": {"mode": "ddtree", "tree_budget": 32}})
    df = _chat(client, max_tokens=40, extra_body={"speculative": {"mode": "dflash"}})
    # Lossless: greedy text is the same whatever the decoding mode.
    assert ar.choices[0].message.content == dd.choices[0].message.content == df.choices[0].message.content
    assert _spec(ar)["mode"] == "ar" and _spec(dd)["mode"] == "ddtree" and _spec(dd)["tree_budget"] == 32
    assert _spec(ar)["mean_acceptance_length"] == 1.0
    assert _spec(ar)["rounds"] == ar.usage.completion_tokens - 1  # one token per round after prefill
    assert _spec(dd)["rounds"] < _spec(ar)["rounds"]


def test_chat_template_kwargs_turn_thinking_on(client):
    off = _chat(client, max_tokens=4)
    on = _chat(client, max_tokens=4, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert on.usage.prompt_tokens < off.usage.prompt_tokens  # no empty <think></think> block appended


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"n": 2}, "n"),
    ({"extra_body": {"speculative": {"mode": "beam"}}}, "speculative.mode"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"extra_body": {"chat_template_kwargs": {"tokenize": True}}}, "chat_template_kwargs"),
])
def test_bad_requests_are_400_with_openai_error(client, server, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, **kw)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error" and body["message"]
    assert server.health()[0] == 200


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"1024": 1}}, "logit_bias"),        # the tiny target's vocabulary is 0..1023
    ({"stop_token_ids": [1024]}, "stop_token_ids"),
    ({"max_tokens": 2040}, "max_tokens"),                # over the 2,048-token context with the prompt
    ({"speculative": {"tree_budget": 65}}, "speculative.tree_budget"),  # over --max-tree-budget (64)
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_engines_limits_refuse_chat_and_completions_alike(server, http, path, body, param):
    """One check of a request against the engine's published limits, on the path both endpoints share:
    the same 400 naming the same field, before the request reaches the engine."""
    prompt = {"messages": [{"role": "user", "content": "1 2 3 4 5 6 7 8 9"}]} if "chat" in path else {
        "prompt": "1 2 3 4 5 6 7 8 9"}
    r = http.post(path, json={**prompt, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["code"] == ("context_length_exceeded" if param == "max_tokens" else None)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        _chat(client, model="gpt-4")
    assert err.value.body["code"] == "model_not_found"


def test_malformed_bodies_are_400(http):
    for body in (b"{not json", b"[1, 2]", b'{"prompt": ""}', b'{"prompt": [99999999]}'):
        r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_engine_error_is_500_once_and_worker_survives(client, http):
    http.post("/_test/fault", json={"engine_errors": 1})
    with pytest.raises(openai.InternalServerError) as err:
        _chat(client)
    assert err.value.status_code == 500 and err.value.body["type"] == "server_error"
    assert _chat(client, max_tokens=4).choices[0].message.content is not None


# --- queue, disconnects, metrics ---------------------------------------------------------------------


def test_full_queue_is_429_with_retry_after(client, http):
    http.post("/_test/fault", json={"paused": True})
    results = []
    threads = [threading.Thread(target=lambda: results.append(_chat(client, max_tokens=4))) for _ in range(3)]
    # One job held by the paused worker (started first, so it cannot race the others into the queue)...
    threads[0].start()
    assert _wait_metric(http, "ddtree_engine_busy", lambda v: v == 1) == 1
    # ...and two waiting: the queue (--max-queue 2) is full.
    for t in threads[1:]:
        t.start()
    assert _wait_metric(http, "ddtree_queue_depth", lambda v: v == 2) == 2
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4})
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "queue_full"
    http.post("/_test/fault", json={"paused": False})
    for t in threads:
        t.join(60)
    assert len(results) == 3 and all(r.choices[0].finish_reason for r in results)


def _long_request(stream: bool) -> dict:
    # ar: one token per round, and each round is slowed to 0.1 s: this would take many seconds.
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": stream,
            "speculative": {"mode": "ar"}}


def _gone(http) -> float:
    return _metrics(http).get('ddtree_requests_total{endpoint="/v1/completions",status="499"}', 0)


def test_disconnecting_stream_frees_the_worker(server, http):
    http.post("/_test/fault", json={"round_delay_s": 0.1})
    gone = _gone(http)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=_long_request(stream=True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # keep a reference: a dropped iterator closes the response
            next(lines)  # generation is running
            assert _metrics(http)["ddtree_engine_busy"] == 1
    started = time.monotonic()
    assert _wait_metric(http, "ddtree_engine_busy", lambda v: v == 0, timeout=5) == 0
    assert time.monotonic() - started < 2
    # counted as "client closed" once the request's task ends (it may trail the worker by a moment)
    assert _eventually(lambda: _gone(http) == gone + 1)


def test_disconnecting_non_stream_client_frees_the_worker(server, http):
    http.post("/_test/fault", json={"round_delay_s": 0.1})
    gone = _gone(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=_long_request(stream=False), timeout=1.0)
    started = time.monotonic()
    assert _wait_metric(http, "ddtree_engine_busy", lambda v: v == 0, timeout=5) == 0
    assert time.monotonic() - started < 2
    # counted as "client closed" once the request's task ends (it may trail the worker by a moment)
    assert _eventually(lambda: _gone(http) == gone + 1)


def test_metrics_text_parses_and_counts(client, http):
    _chat(client, max_tokens=8)
    m = _metrics(http)
    assert m['ddtree_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert m['ddtree_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 1
    assert m["ddtree_generated_tokens_total"] >= 8
    assert m["ddtree_queue_depth"] == 0 and m["ddtree_engine_up"] == 1
    assert m["ddtree_acceptance_length_count"] == m["ddtree_rounds_total"] > 0
    buckets = [v for k, v in m.items() if k.startswith("ddtree_acceptance_length_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == m["ddtree_acceptance_length_count"]
    assert m["ddtree_round_duration_seconds_count"] > 0
    assert m['ddtree_request_duration_seconds_count{endpoint="/v1/chat/completions"}'] >= 1


def test_client_that_gives_up_while_queued_leaves_the_queue(server, client, http):
    http.post("/_test/fault", json={"paused": True})
    held = threading.Thread(target=lambda: _chat(client, max_tokens=2))
    held.start()
    assert _wait_metric(http, "ddtree_engine_busy", lambda v: v == 1) == 1
    # Two clients queue up behind the held job (--max-queue 2), then give up.
    quitters = [threading.Thread(target=_give_up_after_1s, args=(server.url,)) for _ in range(2)]
    for t in quitters:
        t.start()
    for t in quitters:
        t.join(30)
    # Their places are free at once, while the worker still holds the first job.
    assert _wait_metric(http, "ddtree_queue_depth", lambda v: v == 0) == 0
    assert _metrics(http)["ddtree_engine_busy"] == 1
    waiting = threading.Thread(target=lambda: _chat(client, max_tokens=2))
    waiting.start()
    assert _wait_metric(http, "ddtree_queue_depth", lambda v: v == 1) == 1  # admitted, not a 429
    http.post("/_test/fault", json={"paused": False})
    held.join(60)
    waiting.join(60)
    assert _metrics(http)["ddtree_queue_depth"] == 0


def _give_up_after_1s(url: str) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2},
                   timeout=httpx.Timeout(60, read=1.0))


# --- hostile bodies (issue 12): refused early, parsed off the event loop, 400s naming the field ----------


def test_oversized_body_is_413_whether_declared_or_streamed(http):
    limit = 4 * 2**20  # the default --max-body
    body = b'{"prompt": "' + b"x" * limit + b'"}'
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"x" * 2**19
        yield b'"}'
    r = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert http.get("/health").status_code == 200


def test_health_and_metrics_answer_while_a_large_body_is_prepared(server, http):
    """A body just under the limit takes the server a second or more to parse, render and tokenize (then it is
    a 400: too long for the context). /health and /metrics must keep answering meanwhile: several
    answers arrive while that request is still being prepared (none could while it held the loop)."""
    messages = [{"role": "user", "content": "count to ten"}] * 70000  # ~3.4 MB of small messages: slow to render
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}).encode()
    assert len(body) < 4 * 2**20
    sent = threading.Event()
    answer: list[httpx.Response] = []

    def upload():
        yield body
        sent.set()

    def post():
        with httpx.Client(base_url=server.url, timeout=120) as c:
            answer.append(c.post("/v1/chat/completions", content=upload(),
                                 headers={"content-type": "application/json"}))
    poster = threading.Thread(target=post)
    poster.start()
    assert sent.wait(60)
    began = time.monotonic()
    answered = [began]   # when each /health + /metrics pair came back while the request was still prepared
    while poster.is_alive():
        ok = http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        if ok and poster.is_alive():
            answered.append(time.monotonic())
    poster.join()
    preparing_s = time.monotonic() - began
    assert answer[0].status_code == 400 and answer[0].json()["error"]["code"] == "context_length_exceeded"
    # a loop held by the preparation leaves one gap as long as most of it; a free one answers throughout
    # (the server freezes its startup heap: a full collection set off by the request walked it for 0.3 s+)
    longest_gap = max(b - a for a, b in zip(answered, answered[1:] + [began + preparing_s]))
    assert len(answered) >= 3 and longest_gap < preparing_s / 2, (preparing_s, longest_gap, len(answered) - 1)


DEEP = 100_000


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", b'{"messages": ' + b"[" * DEEP + b"]" * DEEP + b"}", "messages"),
    ("/v1/completions", b'{"prompt": "1", "stop": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}", "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/completions", b'{"prompt": "\\ud800 1 2"}', "prompt"),
    ("/v1/completions", b'{"prompt": "1", "model": "tiny\\ud800"}', "model"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": true}', "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": true}', "temperature"),
    ("/v1/completions", b'{"prompt": [true, false]}', "prompt[0]"),
    ("/v1/completions", b'{"prompt": "1", "speculative": {"tree_budget": true}}', "speculative.tree_budget"),
    ("/v1/completions", b'{"prompt": "1", "seed": 1.5}', "seed"),
], ids=["deep-list", "deep-object", "surrogate-content", "surrogate-part", "surrogate-prompt", "surrogate-model",
        "max-tokens-true", "temperature-true", "prompt-bools", "tree-budget-true", "seed-float"])
def test_hostile_json_is_400_naming_the_field(server, http, path, body, param):
    tracebacks = _tracebacks(server)
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert server.health()[0] == 200
    assert _tracebacks(server) == tracebacks


def _tracebacks(server) -> int:
    return server.log_tail(chars=10**9).count("Traceback")

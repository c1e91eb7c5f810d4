"""ddtree-serve against hostile and careless clients (issue 12): one real server on the tiny models, as
deployed (an API key, no test faults), and every input below sent to it.

For each input: an answer (no hang: every request has a timeout), never a 5xx, a client error in the
OpenAI shape with `param` naming the field where there is one, no traceback in the server's log, and
/health 200 afterwards. The module's figures (inputs, 5xx, tracebacks, hangs) go to the reliability
report (faultlab.FIGURES) and docs/reliability.md.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
from faultlab import FIGURES

from ddtree_devtools.server_process import HOST, ServerProcess

pytestmark = pytest.mark.slow

KEY = "sk-hostile-test"
AUTH = {"authorization": f"Bearer {KEY}"}
MODEL = "tiny"
MAX_BODY = 4 * 2**20  # the default --max-body
DEEP = 100_000
ANY = object()  # an error whose param is not checked (no single field is to blame)
TALLY = {"inputs": 0, "5xx": 0, "tracebacks": 0, "hangs": 0, "unhealthy_after": 0}


@dataclass(frozen=True)
class Attack:
    id: str
    path: str
    body: bytes
    status: int
    param: object = None  # the expected error.param (ANY: not checked)
    headers: tuple[tuple[str, str], ...] = ()
    method: str = "POST"


def chat(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}).encode()


def completion(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "1\n2\n", "max_tokens": 4, **fields}).encode()


def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


C, T = "/v1/chat/completions", "/v1/completions"
ATTACKS = [
    # -- JSON that the parser accepts but no client means, or that it rejects ---------------------------
    Attack("deep-list-messages", C, b'{"messages": ' + b"[" * DEEP + b"]" * DEEP + b"}", 400, "messages"),
    Attack("deep-object-stop", T, b'{"prompt": "1", "stop": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}", 400, "stop"),
    Attack("deep-top-level-array", T, b"[" * DEEP + b"]" * DEEP, 400),
    Attack("deep-template-variable", C, chat(chat_template_kwargs={"x": json.loads("[" * 900 + "]" * 900)}), 400,
           "chat_template_kwargs"),
    Attack("template-variable-16-deep", C, chat(chat_template_kwargs={"x": json.loads("[" * 16 + "]" * 16)}), 200),
    Attack("not-json", C, b"{not json", 400),
    Attack("truncated-json", C, chat()[:-5], 400),
    Attack("empty-body", C, b"", 400),
    Attack("json-array", C, b"[1, 2]", 400),
    Attack("json-string", C, b'"hello"', 400),
    Attack("json-null", C, b"null", 400),
    Attack("invalid-utf8", C, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    Attack("nul-bytes", C, chat(messages=user("a\x00b")), 200),
    Attack("5000-digit-integer", C, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}", 400),
    Attack("max-tokens-1e400", C, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}', 400, "max_tokens"),
    Attack("temperature-nan", C, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "temperature"),
    Attack("temperature-infinity", C, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', 400, "temperature"),
    Attack("top-p-nan", T, b'{"prompt": "1", "top_p": NaN}', 400, "top_p"),
    # -- lone surrogates: no tokenizer encodes them, no response can echo them ---------------------------
    Attack("surrogate-content", C, chat(messages=user("hi \ud800")), 400, "messages[0].content"),
    Attack("surrogate-low-content", C, chat(messages=user("\udfff")), 400, "messages[0].content"),
    Attack("surrogate-content-part", C, chat(messages=user([{"type": "text", "text": "x\ud800"}])), 400, "messages[0].content[0].text"),
    Attack("surrogate-prompt", T, completion(prompt="\ud800 1 2"), 400, "prompt"),
    Attack("surrogate-model", C, chat(model="tiny\ud800"), 400, "model"),
    Attack("surrogate-stop", T, completion(stop=["ok", "\ud800"]), 400, "stop[1]"),
    Attack("surrogate-name", C, chat(messages=[{"role": "user", "content": "hi", "name": "\ud800"}]), 400, "messages[0].name"),
    Attack("surrogate-template-kwarg", C, chat(chat_template_kwargs={"x": "\ud800"}), 400, "chat_template_kwargs.x"),
    Attack("surrogate-key", C, chat(**{"\ud800": 1}), 400, "\\ud800"),
    Attack("surrogate-pair-is-fine", C, chat(messages=user("smile \U0001F600")), 200),
    # -- types are strict: refused, never coerced ---------------------------------------------------------
    Attack("max-tokens-true", C, chat(max_tokens=True), 400, "max_tokens"),
    Attack("max-tokens-string", C, chat(max_tokens="5"), 400, "max_tokens"),
    Attack("max-tokens-float", C, chat(max_tokens=5.0), 400, "max_tokens"),
    Attack("max-completion-tokens-true", C, chat(max_completion_tokens=True), 400, "max_completion_tokens"),
    Attack("temperature-true", C, chat(temperature=True), 400, "temperature"),
    Attack("temperature-string", C, chat(temperature="0.5"), 400, "temperature"),
    Attack("top-p-true", C, chat(top_p=True), 400, "top_p"),
    Attack("seed-true", C, chat(seed=True), 400, "seed"),
    Attack("seed-float", C, chat(seed=1.5), 400, "seed"),
    Attack("n-true", C, chat(n=True), 400, "n"),
    Attack("stream-string", C, chat(stream="yes"), 400, "stream"),
    Attack("stream-options-usage-int", C, chat(stream=True, stream_options={"include_usage": 1}), 400, "stream_options.include_usage"),
    Attack("prompt-bools", T, completion(prompt=[True, False]), 400, "prompt[0]"),
    Attack("prompt-floats", T, completion(prompt=[1.5, 2.0]), 400, "prompt[0]"),
    Attack("prompt-number", T, completion(prompt=5), 400, "prompt"),
    Attack("prompt-nested-bools", T, completion(prompt=[[True]]), 400, "prompt[0][0]"),
    Attack("tree-budget-true", T, completion(speculative={"tree_budget": True}), 400, "speculative.tree_budget"),
    Attack("tree-budget-string", T, completion(speculative={"tree_budget": "8"}), 400, "speculative.tree_budget"),
    Attack("messages-object", C, chat(messages={"role": "user", "content": "hi"}), 400, "messages"),
    Attack("role-number", C, chat(messages=[{"role": 5, "content": "hi"}]), 400, "messages[0].role"),
    Attack("content-number", C, chat(messages=user(5)), 400, "messages[0].content"),
    Attack("stop-number", T, completion(stop=5), 400, "stop"),
    Attack("model-number", C, chat(model=5), 400, "model"),
    # -- values out of range, fields the server cannot honour -------------------------------------------
    Attack("max-tokens-zero", C, chat(max_tokens=0), 400, "max_tokens"),
    Attack("max-tokens-negative", C, chat(max_tokens=-1), 400, "max_tokens"),
    Attack("max-tokens-huge", C, chat(max_tokens=10**30), 400, "max_tokens"),
    Attack("temperature-negative", C, chat(temperature=-1), 400, "temperature"),
    Attack("temperature-too-high", C, chat(temperature=3), 400, "temperature"),
    Attack("top-p-zero", C, chat(top_p=0), 400, "top_p"),
    Attack("seed-2-to-the-64", C, chat(seed=2**64), 400, "seed"),
    Attack("tree-budget-zero", T, completion(speculative={"tree_budget": 0}), 400, "speculative.tree_budget"),
    Attack("tree-budget-million", T, completion(speculative={"tree_budget": 10**6}), 400, "speculative.tree_budget"),
    # -- issue 23 -------------------------------------------------------------------------------------------
    Attack("tree-budget-1025", T, completion(speculative={"tree_budget": 1025}), 400, "speculative.tree_budget"),
    Attack("tree-budget-over-the-cap", T, completion(speculative={"tree_budget": 65}), 400, "speculative.tree_budget"),
    Attack("tree-budget-under-the-cap", T, completion(speculative={"tree_budget": 32}), 200),
    Attack("logit-bias-superscript-key", T, completion(logit_bias={"\u00b2": 1}), 400, "logit_bias"),
    Attack("logit-bias-arabic-digit-key", T, completion(logit_bias={"\u0663": 1}), 400, "logit_bias"),
    Attack("logit-bias-5000-digit-key", T, completion(logit_bias={"9" * 5000: 1}), 400, "logit_bias"),
    Attack("tool-call-arguments-5000-deep", C, chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "f", "arguments": '{"a": ' + "[" * 5000 + "]" * 5000 + "}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "ok"}]), 400, "messages[1].tool_calls[0].function.arguments"),
    Attack("tool-call-arguments-100-deep", C, chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "f", "arguments": '{"a": ' + "[" * 100 + "]" * 100 + "}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "ok"}]), 400, "messages[1].tool_calls[0].function.arguments"),
    Attack("min-tokens-over-the-room-left", T, json.dumps({"prompt": [1] * 2000, "min_tokens": 100}).encode(), 400,
           "min_tokens"),
    Attack("prompt-text-far-over-the-context", T, completion(prompt="x " * 1_500_000), 400, "prompt"),
    Attack("chat-text-far-over-the-context", C, chat(messages=user("x " * 1_500_000)), 400, "messages"),
    Attack("tool-tags-in-content", C, chat(messages=[
        {"role": "user", "content": "<tool_call>{}</tool_call><tool_response>x</tool_response><think></think>"},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "f", "arguments": '{"a": "</tool_call>"}'}}]},
        {"role": "tool", "tool_call_id": "1", "content": "</tool_response><|im_end|>"}]), 200),
    Attack("placeholder-characters-in-content", C,
           chat(messages=user("".join(chr(0x100000 + i) for i in range(16)))), 200),
    Attack("mode-unknown", T, completion(speculative={"mode": "beam"}), 400, "speculative.mode"),
    Attack("speculative-extra-field", T, completion(speculative={"mode": "ar", "x": 1}), 400, "speculative.x"),
    Attack("stop-17-strings", T, completion(stop=[str(i) for i in range(17)]), 400, "stop"),
    Attack("n-2", C, chat(n=2), 400, "n"),
    Attack("best-of-3", T, completion(best_of=3), 400, "best_of"),
    Attack("top-logprobs-21", C, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    Attack("tool-name-with-space", C, chat(tools=[{"type": "function", "function": {"name": "a b"}}]), 400,
           "tools[0].function.name"),
    Attack("tools-not-functions", C, chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), 400,
           "tools[0].type"),
    Attack("tool-choice-unknown-function", C, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                   tool_choice={"type": "function", "function": {"name": "g"}}),
           400, "tool_choice"),
    Attack("tool-choice-required-without-tools", C, chat(tool_choice="required"), 400, "tool_choice"),
    Attack("tool-call-arguments-not-json", C, chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "ok"}]), 400, "messages[1].tool_calls[0].function.arguments"),
    Attack("presence-penalty", C, chat(presence_penalty=0.5), 400, "presence_penalty"),
    Attack("response-format-json", C, chat(response_format={"type": "json_object"}), 400, "response_format"),
    Attack("logit-bias-not-a-token", T, completion(logit_bias={"x": 1}), 400, "logit_bias"),
    Attack("logit-bias-outside-vocab", T, completion(logit_bias={"99999999": 1}), 400, "logit_bias"),
    Attack("stop-token-outside-vocab", T, completion(stop_token_ids=[-1]), 400, "stop_token_ids"),
    Attack("top-k-string", T, completion(top_k="5"), 400, "top_k"),
    Attack("echo", T, completion(echo=True), 400, "echo"),
    Attack("suffix", T, completion(suffix="x"), 400, "suffix"),
    Attack("template-kwarg-tokenize", C, chat(chat_template_kwargs={"tokenize": True}), 400, "chat_template_kwargs"),
    Attack("template-kwarg-conversation", C, chat(chat_template_kwargs={"conversation": []}), 400, "chat_template_kwargs"),
    Attack("model-unknown", C, chat(model="gpt-4"), 404, "model"),
    Attack("model-path-traversal", C, chat(model="../../etc/passwd"), 404, "model"),
    Attack("messages-empty", C, chat(messages=[]), 400, "messages"),
    Attack("role-unknown", C, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    Attack("content-image", C, chat(messages=user([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}])), 400, "messages[0].content[0]"),
    Attack("prompt-empty", T, completion(prompt=""), 400, "prompt"),
    Attack("prompt-empty-list", T, completion(prompt=[]), 400, "prompt"),
    Attack("prompt-two-prompts", T, completion(prompt=["a", "b"]), 400, "prompt"),
    Attack("prompt-token-out-of-vocab", T, completion(prompt=[99_999_999]), 400, "prompt"),
    Attack("prompt-token-negative", T, completion(prompt=[-1]), 400, "prompt"),
    Attack("prompt-longer-than-context", T, completion(prompt=[1] * 5000), 400, "prompt"),
    Attack("prompt-plus-max-tokens-over-context", T, completion(prompt=[1] * 2000, max_tokens=100), 400, "max_tokens"),
    Attack("ten-thousand-messages", C, chat(messages=user("count to ten " * 20) * 10_000), 400, "messages"),
    # -- size ------------------------------------------------------------------------------------------
    Attack("body-over-the-limit", T, b'{"prompt": "' + b"x" * MAX_BODY + b'"}', 413),
    Attack("body-20-mb", C, b'{"messages": [{"role": "user", "content": "' + b"x" * 20 * 2**20 + b'"}]}', 413),
    # -- HTTP ------------------------------------------------------------------------------------------
    Attack("get-on-post-endpoint", C, b"", 405, method="GET"),
    Attack("delete-models", "/v1/models", b"", 405, method="DELETE"),
    Attack("unknown-path", "/v1/engines", b"", 404, method="GET"),
    Attack("path-traversal", "/v1/../../etc/passwd", b"", 404, method="GET"),
    Attack("fault-endpoint-in-production", "/_test/fault", b'{"kill_worker": true}', 404),
    Attack("wrong-content-type", C, chat(), 200, headers=(("content-type", "text/plain"),)),
    # -- authentication --------------------------------------------------------------------------------
    Attack("no-key", C, chat(), 401, headers=(("authorization", ""),)),
    Attack("wrong-key", C, chat(), 401, headers=(("authorization", "Bearer sk-wrong"),)),
    Attack("bearer-without-token", C, chat(), 401, headers=(("authorization", "Bearer"),)),
    Attack("basic-auth", C, chat(), 401, headers=(("authorization", "Basic dXNlcjpwYXNz"),)),
    Attack("key-prefix", C, chat(), 401, headers=(("authorization", f"Bearer {KEY[:-1]}"),)),
    Attack("key-10k-chars", C, chat(), 401, headers=(("authorization", "Bearer " + "k" * 10_000),)),
    Attack("metrics-without-key", "/metrics", b"", 401, method="GET", headers=(("authorization", ""),)),
]


@pytest.fixture(scope="module")
def server(tiny_models):
    args = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
            "--served-model-name", MODEL, "--max-queue", "2"]
    with ServerProcess(args, env={"DDTREE_API_KEY": KEY}) as srv:
        srv.wait_ready()
        yield srv
        FIGURES["runtime_hostile_inputs"] = dict(TALLY)


@pytest.fixture
def judge(server):
    """After the test's inputs: no new traceback in the log, and the server healthy (counted)."""
    before = _tracebacks(server)
    yield
    tracebacks = _tracebacks(server) - before
    TALLY["tracebacks"] += tracebacks
    code, _ = server.health()
    TALLY["unhealthy_after"] += code != 200
    assert tracebacks == 0, server.log_tail()
    assert code == 200, server.log_tail()


def _tracebacks(server: ServerProcess) -> int:
    return server.log_tail(chars=10**9).count("Traceback")


def _send(server: ServerProcess, method: str, path: str, **kwargs) -> httpx.Response:
    """One hostile request, counted; a timeout is a hang."""
    TALLY["inputs"] += 1
    try:
        r = httpx.request(method, server.url + path, timeout=60, **kwargs)
    except httpx.TimeoutException:
        TALLY["hangs"] += 1
        raise
    TALLY["5xx"] += r.status_code >= 500
    return r


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.id for a in ATTACKS])
def test_hostile_request(server, judge, attack: Attack):
    headers = {"content-type": "application/json", **AUTH, **dict(attack.headers)}
    headers = {k: v for k, v in headers.items() if v}
    r = _send(server, attack.method, attack.path, content=attack.body or None, headers=headers)
    assert r.status_code == attack.status, r.text[:500]
    if r.status_code >= 400 and attack.path != "/metrics":
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if attack.param is not ANY:
            assert error["param"] == attack.param, error
    if r.status_code == 401:
        assert r.headers["www-authenticate"] == "Bearer"


def test_chunked_body_over_the_limit(server, judge):
    def chunks():
        for _ in range(20):
            yield b"x" * 2**19  # 10 MiB in all, no Content-Length
    r = _send(server, "POST", C, content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_body_cut_off_mid_upload(server, judge):
    TALLY["inputs"] += 1
    gone = _count(server, f'ddtree_requests_total{{endpoint="{C}",status="499"}}')
    with socket.create_connection((HOST, server.port), timeout=10) as s:
        s.sendall(f"POST {C} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{{\"messages\": [".encode())
    _eventually(lambda: _count(server, f'ddtree_requests_total{{endpoint="{C}",status="499"}}') == gone + 1)


def test_garbage_instead_of_http(server, judge):
    TALLY["inputs"] += 1
    with socket.create_connection((HOST, server.port), timeout=10) as s:
        s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 GARBAGE\r\n\r\n")  # a TLS hello, then noise
        reply = s.recv(4096)
    assert reply == b"" or reply.startswith(b"HTTP/1.1 400")


def test_oversized_header(server, judge):
    """uvicorn refuses headers past 16 KB with a 400 and closes, often before the client has sent the
    rest (then the client sees a reset instead of the answer): either is a refusal."""
    try:
        r = _send(server, "GET", "/v1/models", headers={**AUTH, "x-junk": "j" * 200_000})
    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
        return
    assert r.status_code == 400


def test_stream_abandoned_after_the_first_chunk(server, judge):
    TALLY["inputs"] += 1
    body = {"model": MODEL, "prompt": "1\n2\n3\n4\n", "max_tokens": 2000, "stream": True, "temperature": 0,
            "speculative": {"mode": "ar"}}
    with httpx.stream("POST", server.url + T, json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    _wait_idle(server)


def test_burst_past_the_queue_is_429s_and_200s(server, judge):
    """Twelve clients at once against --max-queue 2: each is served or told when to come back."""
    body = {"model": MODEL, "prompt": "1\n2\n3\n4\n", "max_tokens": 64, "temperature": 0, "speculative": {"mode": "ar"}}
    answers: list[httpx.Response] = []
    clients = [threading.Thread(target=lambda: answers.append(_send(server, "POST", T, json=body, headers=AUTH)))
               for _ in range(12)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(120)
    assert len(answers) == 12 and {r.status_code for r in answers} <= {200, 429}
    for r in answers:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "queue_full"


def test_the_engine_answers_as_before_after_all_of_it(server, judge):
    """Last in the module: greedy text unchanged in every mode, nothing left queued or running."""
    body = {"model": MODEL, "prompt": "1\n2\n3\n", "max_tokens": 12, "temperature": 0}
    texts = {mode: _send(server, "POST", T, json={**body, "speculative": {"mode": mode}}, headers=AUTH).json()
             for mode in ("ar", "dflash", "ddtree")}
    assert len({t["choices"][0]["text"] for t in texts.values()}) == 1, texts
    _wait_idle(server)


def _wait_idle(server: ServerProcess) -> None:
    _eventually(lambda: _count(server, "ddtree_engine_busy") == 0 == _count(server, "ddtree_queue_depth"))


def _count(server: ServerProcess, sample: str) -> float:
    for line in httpx.get(server.url + "/metrics", headers=AUTH).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    return 0.0


def _eventually(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.05)

"""End to end on the real tiny models: each emits a tool call in its family's format (qwen3: hermes,
the hybrid qwen3_5: qwen3_coder), which ddtree-serve returns as `tool_calls`; the tool's result goes back
as a `tool` message and the model answers from it; with thinking on, its reasoning comes back as
`reasoning_content`. Through the official `openai` client, streamed and not, and the same greedy tokens
in ar, dflash and ddtree."""

from __future__ import annotations

import json

import openai
import pytest

from ddtree_devtools.server_process import ServerProcess
from ddtree_devtools.tiny_corpus import CITIES, TOOLS

pytestmark = pytest.mark.slow

MODEL = "tiny"
WEATHER = [{"type": "function", "function": TOOLS["get_weather"]}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def client(request, arch):
    models = request.getfixturevalue("tiny_models" if arch == "qwen3" else "tiny_hybrid_models")
    args = ["--target", str(models / "target"), "--draft", str(models / "draft"), "--served-model-name", MODEL,
            "--reasoning-parser", "qwen3"]
    with ServerProcess(args) as srv:
        srv.wait_ready()
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, mode="ddtree", **kw):
    kw = {"model": MODEL, "messages": ASK, "tools": WEATHER, "temperature": 0, "max_tokens": 64, **kw}
    kw = {key: value for key, value in kw.items() if value is not None}  # tools=None: none offered
    extra = {"speculative": {"mode": mode}, **kw.pop("extra_body", {})}
    return client.chat.completions.create(**kw, extra_body=extra)


def _streamed(client, **kw) -> dict:
    reply = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in _chat(client, stream=True, **kw):
        choice = chunk.choices[0]
        reply["content"] += choice.delta.content or ""
        reply["reasoning"] += getattr(choice.delta, "reasoning_content", None) or ""
        for part in choice.delta.tool_calls or []:
            call = reply["calls"].setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
        reply["finish"] = choice.finish_reason or reply["finish"]
    return reply


def _check_city(arguments: str, arch: str) -> None:
    """The call's arguments: the city asked about (the tiny qwen3 copies it from the question; the tiny
    hybrid writes the call's layout but one city of its corpus whatever was asked)."""
    city = json.loads(arguments)["city"]
    assert json.loads(arguments) == {"city": city}
    assert city == "Paris" if arch == "qwen3" else city in CITIES


def _check_answer(content: str, result: str, arch: str) -> None:
    """The answer after the tool's result: from the result (the tiny qwen3 copies it; the tiny hybrid
    answers in the corpus's form but not from the result)."""
    assert content.startswith(f"It is {result} in " if arch == "qwen3" else "It is "), content


def _result_turn(call_id: str, arguments: str, result: str) -> list[dict]:
    return ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


def test_the_model_calls_the_tool_and_answers_from_its_result(client, arch):
    first = _chat(client).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None, first.message
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather"
    _check_city(call.function.arguments, arch)
    final = _chat(client, messages=_result_turn(call.id, call.function.arguments, "rainy")).choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls
    _check_answer(final.message.content, "rainy", arch)


def test_the_tool_loop_streamed(client, arch):
    first = _streamed(client)
    assert first["finish"] == "tool_calls" and first["content"] == ""
    [call] = first["calls"].values()
    assert call["id"].startswith("call_") and call["name"] == "get_weather"
    _check_city(call["arguments"], arch)
    final = _streamed(client, messages=_result_turn(call["id"], call["arguments"], "snowy"))
    assert final["finish"] == "stop" and not final["calls"]
    _check_answer(final["content"], "snowy", arch)


def test_tool_calls_are_the_same_in_every_mode(client):
    replies = [_chat(client, mode).choices[0] for mode in ("ar", "dflash", "ddtree")]
    calls = {json.dumps([(c.function.name, c.function.arguments) for c in r.message.tool_calls or []])
             for r in replies}
    assert len(calls) == 1 and replies[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_thinking_on_returns_the_reasoning_apart(client, stream):
    kw = {"messages": [{"role": "user", "content": "What is 2+3?"}], "tools": None,
          "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    if stream:
        reply = _streamed(client, **kw)
        reasoning, content = reply["reasoning"], reply["content"]
    else:
        message = _chat(client, **kw).choices[0].message
        reasoning, content = message.reasoning_content, message.content
    assert reasoning == "2 plus 3 makes 5.\n" and content == "5"


def test_tool_choice_none_answers_without_calling(client):
    reply = _chat(client, tool_choice="none").choices[0]
    assert not reply.message.tool_calls and reply.finish_reason in ("stop", "length")

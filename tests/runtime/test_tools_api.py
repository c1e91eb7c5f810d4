"""Tool calls and reasoning through the official ``openai`` client, on crafted model output.

The real server (app, worker, routes, parsers, the tiny tokenizer with the tiny Qwen-style chat
templates) runs in-process with a scripted engine in place of the model: its replies are written here,
so every parser path (a call, a forced call's continuation, a malformed call, reasoning) is reached on
purpose. That the tiny models themselves emit such text is for the end-to-end tests on the models.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from transformers import AutoTokenizer

from ddtree_runtime.engine.api import EngineInfo, RequestLimits
from ddtree_runtime.engine.types import BatchStats, RoundOutput, WarmUp
from ddtree_runtime.server.app import create_app
from ddtree_runtime.server.config import ServerConfig
from ddtree_devtools.server_process import HOST, free_port
from ddtree_devtools.tiny_templates import CHAT_TEMPLATES

pytestmark = pytest.mark.slow

MODEL = "tiny"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALLS = {  # the weather call as each family's template writes it
    "qwen3": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"Île\\"", "days": 2}}\n</tool_call>',
    "qwen3_5": '<tool_call>\n<function=get_weather>\n<parameter=city>\nParis "Île"\n</parameter>\n'
               '<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>',
}
ANSWER = "It is sunny in Paris."
REASONING = "The user wants the weather; the tool knows it."
REASONED = REASONING + "\n"  # as vLLM returns it: the newline before </think> is kept


class ScriptedEngine:
    """Stands in for the Engine: replies with text chosen from the prompt, a few tokens a round, through
    the server's interface to the engine (engine/api.ServedEngine): submit, step, cancel, has_work, its
    queue's has_room, queue_depth and queued, and what it is (info, stats, capacity, a warm-up that runs
    nothing)."""

    can_serve, slots = True, 16

    def __init__(self, tokenizer, arch: str) -> None:
        self.tokenizer = tokenizer
        self.info = EngineInfo(MODEL, arch, "draft", "none", RequestLimits(
            max_context=2048, vocab_size=len(tokenizer), has_drafter=True, mode="ddtree", tree_budget=16,
            block_size=4, page_size=16, pool_pages=1024))
        self.stats = BatchStats()
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.prompts: list[str] = []
        self.running: dict[int, object] = {}  # request id -> its rounds, for the batching API below

    def capacity(self) -> dict[str, int]:
        return {"pages_total": self.info.limits.pool_pages, "pages_used": 0}

    def warm_up(self) -> WarmUp:
        return WarmUp(0.0, (), 0, 0)

    def submit(self, prompt_ids, params) -> int:
        request_id = len(self.prompts)
        self.running[request_id] = self.generate(prompt_ids, params)
        return request_id

    # its queue: none, every request runs at once
    queue_depth = 0

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def has_room(self, arriving: int = 0) -> bool:
        return True

    def queued(self, request_id: int) -> bool:
        return False

    def step(self):
        outputs = [(request_id, next(rounds)) for request_id, rounds in list(self.running.items())]
        for request_id, out in outputs:
            if out.finished:
                del self.running[request_id]
        return outputs

    def cancel(self, request_id: int) -> None:
        self.running.pop(request_id, None)

    def reply(self, prompt: str) -> str:
        call = CALLS[self.info.arch]
        for k in range(len(call), 0, -1):  # a forced call: the prompt holds its opening
            if call.startswith("<tool_call>") and prompt.endswith(call[:k]) and k >= len("<tool_call>"):
                return call[k:]
        if "<tool_response>" in prompt.rsplit("<|im_start|>user", 1)[-1]:
            return ANSWER
        if "Break it" in prompt:
            return '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
        if "<tools>" not in prompt:
            return "I cannot look that up."
        thinking = "" if prompt.endswith("<think>\n\n</think>\n\n") else f"<think>\n{REASONING}\n</think>\n\n"
        if prompt.endswith("<think>\n"):  # the template opened the block: the model writes from inside
            thinking = f"{REASONING}\n</think>\n\n"
        return thinking + call

    def generate(self, prompt_ids, params):
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        self.prompts.append(prompt)
        ids = self.tokenizer.encode(self.reply(prompt), add_special_tokens=False) + [self.eos]
        ids = ids[:params.max_new_tokens]

        def rounds():
            done = 0
            while done < len(ids):
                step = ids[done:done + (1 if done == 0 else 3)]
                done += len(step)
                last = done == len(ids)
                reason = ("stop" if ids[-1] == self.eos else "length") if last else None
                yield RoundOutput(step, len(step) - 1 if done > len(step) else 0, last, reason)
        return rounds()


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def served(request, tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models / "target")
    tokenizer.chat_template = CHAT_TEMPLATES[request.param]
    engine = ScriptedEngine(tokenizer, request.param)
    port = free_port()
    config = ServerConfig(target_dir=str(tiny_models / "target"), draft_dir=None, host=HOST, port=port,
                          reasoning_parser="qwen3", served_model_name=MODEL)
    server = uvicorn.Server(uvicorn.Config(create_app(config, lambda _: engine), host=HOST, port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    yield client, engine
    server.should_exit = True
    thread.join(10)


def _chat(client, stream=False, **kw):
    kw = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "temperature": 0, "max_tokens": 200, **kw}
    if not stream:
        return client.chat.completions.create(**kw).choices[0]
    return _gather(client.chat.completions.create(stream=True, **kw))


def _gather(stream) -> dict:
    """A streamed reply put together as clients do: text joined, tool calls by index."""
    reply = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in stream:
        choice = chunk.choices[0]
        delta = choice.delta
        reply["content"] += delta.content or ""
        reply["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        for part in delta.tool_calls or []:
            call = reply["calls"].setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] += (part.function.name or "") if part.function else ""
            call["arguments"] += (part.function.arguments or "") if part.function else ""
        reply["finish"] = choice.finish_reason or reply["finish"]
    return reply


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_full_tool_loop(served, stream):
    client, engine = served
    first = _chat(client, stream)
    if stream:
        assert first["finish"] == "tool_calls" and first["content"] == "" and first["reasoning"] == ""
        [call] = first["calls"].values()
        call_id, name, arguments = call["id"], call["name"], call["arguments"]
    else:
        assert first.finish_reason == "tool_calls" and first.message.content is None
        assert first.message.reasoning_content is None  # the tiny templates think only when asked
        [call] = first.message.tool_calls
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
        assert call.type == "function"
    assert call_id.startswith("call_") and name == "get_weather"
    assert json.loads(arguments) == {"city": 'Paris "Île"', "days": 2}
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 24°C"},
    ]
    final = _chat(client, stream, messages=history)
    content = final["content"] if stream else final.message.content
    assert content == ANSWER and (final["finish"] if stream else final.finish_reason) == "stop"
    # the call and its result reached the model through its own template
    prompt = engine.prompts[-1]
    assert CALLS[engine.info.arch] in prompt
    assert "<tool_response>\nsunny, 24°C\n</tool_response>" in prompt


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_none_hides_the_tools(served, stream):
    client, engine = served
    reply = _chat(client, stream, tool_choice="none")
    assert "<tools>" not in engine.prompts[-1]
    if stream:
        assert reply["content"] == "I cannot look that up." and not reply["calls"] and reply["finish"] == "stop"
    else:
        assert reply.message.content == "I cannot look that up." and not reply.message.tool_calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_tool_choice_start_the_reply_with_the_call(served, choice, stream):
    client, engine = served
    reply = _chat(client, stream, tool_choice=choice)
    assert engine.prompts[-1].endswith("<tool_call>\n") or "<tool_call>\n" in engine.prompts[-1][-60:]
    if stream:
        [call] = reply["calls"].values()
        assert reply["finish"] == "tool_calls" and call["name"] == "get_weather"
        assert json.loads(call["arguments"])["days"] == 2
    else:
        [call] = reply.message.tool_calls
        assert reply.finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["days"] == 2


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_thinking_on_gives_reasoning_content_apart_from_the_call(served, stream):
    client, engine = served
    reply = _chat(client, stream, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    if stream:
        assert reply["reasoning"] == REASONED and reply["content"] == "" and len(reply["calls"]) == 1
    else:
        assert reply.message.reasoning_content == REASONED and reply.message.content is None
        assert len(reply.message.tool_calls) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_malformed_call_comes_back_as_content(served, stream):
    client, _ = served
    reply = _chat(client, stream, messages=[{"role": "user", "content": "Break it"}])
    content = reply["content"] if stream else reply.message.content
    assert content.startswith("<tool_call>") and '"city": }' in content
    assert (reply["finish"] if stream else reply.finish_reason) == "stop"
    assert not (reply["calls"] if stream else reply.message.tool_calls)


def test_usage_counts_the_returned_tokens(served):
    client, _ = served
    whole = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=50,
                                           tools=[WEATHER], tool_choice="none", stop=["look"])
    assert whole.choices[0].message.content == "I cannot "
    tokens = served[1].tokenizer.encode("I cannot look", add_special_tokens=False)
    assert whole.usage.completion_tokens == len(tokens)

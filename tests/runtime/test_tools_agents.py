"""A real agent framework as the client: the OpenAI Agents SDK (`openai-agents`) runs an agent with one
function tool against ddtree-serve on the tiny Qwen3 models, through its Chat Completions model; the
model calls the tool, the SDK runs it and sends the result back, and the model answers from it.
Skipped where the SDK is not installed."""

from __future__ import annotations

import json

import pytest

from ddtree_devtools.server_process import ServerProcess
from ddtree_devtools.tiny_corpus import TOOLS

agents = pytest.importorskip("agents")

pytestmark = pytest.mark.slow


def test_an_agent_calls_its_function_tool_and_answers(tiny_models):
    import openai

    calls: list[dict] = []

    async def get_weather(context, arguments: str) -> str:
        calls.append(json.loads(arguments))
        return "rainy"

    weather = agents.FunctionTool(name="get_weather", description="", strict_json_schema=False,
                                  params_json_schema=TOOLS["get_weather"]["parameters"], on_invoke_tool=get_weather)
    args = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"), "--served-model-name",
            "tiny"]
    agents.set_tracing_disabled(True)
    with ServerProcess(args) as srv:
        srv.wait_ready()
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        agent = agents.Agent(name="weather", model=agents.OpenAIChatCompletionsModel("tiny", client),
                             tools=[weather], model_settings=agents.ModelSettings(temperature=0, max_tokens=64))
        result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert calls == [{"city": "Paris"}]
    # the answer is from the tool's result (the tiny model may name another of its corpus's cities)
    assert result.final_output.startswith("It is rainy in "), result.final_output

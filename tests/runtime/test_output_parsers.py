"""The reasoning and tool-call parsers on crafted model output, fed whole and split at every point."""

from __future__ import annotations

import itertools
import json

import pytest

from ddtree_runtime.server.output_parsers import (
    HermesParser,
    Qwen3CoderParser,
    ReasoningParser,
    prompt_opens_thinking,
    tool_schemas,
)

TOOLS = tool_schemas([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "metric": {"type": "boolean"}, "ratio": {"type": "number"},
                                         "filters": {"type": "object"}, "tags": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "run", "parameters": {"type": "object",
                                                                   "properties": {"cmd": {"type": "string"}}}}},
])


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def feed_tools(parser_cls, pieces: list[str]):
    parser = parser_cls(TOOLS, make_id=_ids())
    content, calls = [], []
    for piece in pieces:
        text, new = parser.push(piece)
        content.append(text)
        calls += new
    text, new = parser.finish()
    content.append(text)
    return "".join(content), [(c.name, json.loads(c.arguments), c.id) for c in calls + new]


def splits(text: str):
    """The text whole, cut in two at every point, and one character at a time."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


def feed_reasoning(pieces: list[str], starts_inside: bool = False) -> tuple[str, str]:
    parser = ReasoningParser(starts_inside)
    out = [parser.push(p) for p in pieces] + [parser.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


# -- reasoning -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, starts_inside, want", [
    ("<think>\nadd them</think>\n\nThe sum is 5.", False, ("add them", "The sum is 5.")),
    ("The sum is 5.", False, ("", "The sum is 5.")),
    ("add them\n</think>\n\n5", True, ("add them\n", "5")),
    ("<think>\nstill thinking", False, ("still thinking", "")),             # cut off by max_tokens
    ("5 is not <think>", False, ("", "5 is not <think>")),                 # only the reply's start thinks
    ("<thi", False, ("", "<thi")),                                          # a tag's prefix that never became one
    ("a </think> b", False, ("", "a </think> b")),
])
def test_reasoning_split_at_every_point(text, starts_inside, want):
    for pieces in splits(text):
        assert feed_reasoning(pieces, starts_inside) == want, pieces


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


# -- hermes (Qwen3) ------------------------------------------------------------------------------

HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich \\"old town\\"", '
              '"days": 3, "filters": {"a": [1, {"b": null}]}}}\n</tool_call>\n<tool_call>\n'
              '{"name": "run", "arguments": "{\\"cmd\\": \\"ls -la\\"}"}\n</tool_call>\n')


def test_hermes_two_calls_at_every_split():
    want_calls = [("get_weather", {"city": 'Zürich "old town"', "days": 3, "filters": {"a": [1, {"b": None}]}}, "call_0"),
                  ("run", {"cmd": "ls -la"}, "call_1")]
    for pieces in splits(HERMES_TWO):
        assert feed_tools(HermesParser, pieces) == ("Let me check.\n", want_calls), pieces


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',   # broken JSON
    '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',   # not an offered tool
    '<tool_call>\n["get_weather"]\n</tool_call>',                                  # not an object
    '<tool_call>\n{"name": "run", "arguments": {"cmd": "ls"',                     # never closed
])
def test_hermes_malformed_is_content(text):
    for pieces in splits(text):
        assert feed_tools(HermesParser, pieces) == (text, []), pieces


def test_plain_text_with_angle_brackets_passes_through():
    text = "a <tool> and <tool_cal but no call; x < y"
    for pieces in splits(text):
        assert feed_tools(HermesParser, pieces) == (text, [])


# -- qwen3_coder (Qwen3-Coder, Qwen3.5/3.6) ------------------------------------------------------

CODER = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
         "<parameter=days>\n7\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
         "<parameter=ratio>\n0.5\n</parameter>\n<parameter=filters>\n{\"min\": {\"t\": -3}}\n</parameter>\n"
         "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=run>\n<parameter=cmd>\necho \"hi\" && cat <<EOF\n  x\nEOF\n</parameter>\n"
         "</function>\n</tool_call>")


def test_qwen3_coder_typed_parameters_at_every_split():
    want = ("", [("get_weather", {"city": "São Paulo", "days": 7, "metric": True, "ratio": 0.5,
                                  "filters": {"min": {"t": -3}}, "tags": ["a", "b"]}, "call_0"),
                 ("run", {"cmd": 'echo "hi" && cat <<EOF\n  x\nEOF'}, "call_1")])
    for pieces in splits(CODER):
        assert feed_tools(Qwen3CoderParser, pieces) == want, pieces


def test_qwen3_coder_untyped_values_stay_text():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=days>\nseven\n</parameter>\n"
            "<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>")
    assert feed_tools(Qwen3CoderParser, [text]) == ("", [("get_weather", {"days": "seven", "extra": "42"}, "call_0")])


def test_qwen3_coder_missing_parameter_close():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n"
            "</function>\n</tool_call>")
    assert feed_tools(Qwen3CoderParser, [text]) == ("", [("get_weather", {"city": "Oslo", "days": 2}, "call_0")])


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</tool_call>",  # no </function>
    "<tool_call>\n<function=nope>\n</function>\n</tool_call>",                                   # unknown tool
    "<tool_call>\nfree text <function=run>\n</function>\n</tool_call>",                          # text before it
    "<tool_call>\n<function=run>\n<parameter=cmd>\nls",                                         # cut off
])
def test_qwen3_coder_malformed_is_content(text):
    for pieces in splits(text):
        assert feed_tools(Qwen3CoderParser, pieces) == (text, []), pieces


def test_content_before_a_call_is_released_before_the_call_completes():
    parser = Qwen3CoderParser(TOOLS, make_id=_ids())
    assert parser.push("I will run it.\n<tool_") == ("I will run it.\n", [])
    assert parser.push("call>\n<function=run>\n<parameter=cmd>\nls\n") == ("", [])
    text, calls = parser.push("</parameter>\n</function>\n</tool_call>")
    assert text == "" and [c.as_dict()["function"] for c in calls] == [{"name": "run", "arguments": '{"cmd": "ls"}'}]

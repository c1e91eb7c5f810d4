"""The tiny corpus's tool-use and thinking conversations are exactly what the tiny chat templates
render for the same messages (what the models learn is what the server will prompt them with), and
each fits one training window."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import pytest

from ddtree_devtools import tiny, tiny_corpus
from ddtree_devtools.tiny_templates import CHAT_TEMPLATES


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def arch_tokenizer(request):
    docs = tiny_corpus.documents(3000, 0, request.param)
    return request.param, tiny.build_tokenizer(docs, Path(tempfile.mkdtemp()), request.param)


def _call(name: str, city: str) -> dict:
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": {"city": city}}}


def test_tool_use_conversations_are_the_templates_rendering(arch_tokenizer):
    arch, tok = arch_tokenizer
    rng = random.Random(11)
    seen = set()
    for _ in range(40):
        head, tail = tiny_corpus.tool_use(rng, arch)
        tools = [{"type": "function", "function": tiny_corpus.TOOLS[name]} for name in tiny_corpus.TOOLS
                 if json.dumps(tiny_corpus.TOOLS[name]) in head]
        [tool] = tools
        name = tool["function"]["name"]
        question = head.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        city = question.rstrip("?").split()[-1]
        messages = [{"role": "user", "content": question}]
        if "<tool_response>" in head:
            result = head.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
            messages += [{"role": "assistant", "content": "", "tool_calls": [_call(name, city)]},
                         {"role": "tool", "tool_call_id": "c", "content": result}]
            seen.add("answer")
        else:
            seen.add("call")
        rendered = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert rendered == head
        if tail.startswith("<tool_call>"):  # the call is the template's own rendering of it
            reply = {"role": "assistant", "content": "", "tool_calls": [_call(name, city)]}
            whole = tok.apply_chat_template(messages + [reply], tools=tools, tokenize=False)
            assert whole == head.removesuffix("<think>\n\n</think>\n\n") + tail
        assert len(tok.encode(head + tail, add_special_tokens=False)) <= tiny.TRAIN_LEN
    assert seen == {"call", "answer"}


def test_thinking_conversations_are_the_templates_rendering(arch_tokenizer):
    arch, tok = arch_tokenizer
    head, tail = tiny_corpus.thinking(random.Random(3), arch)
    question = head.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    rendered = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=True)
    assert rendered == head
    assert (head + tail).count("<think>") == 1 and "</think>\n\n" in tail


def test_tool_tags_are_whole_tokens_but_not_special(arch_tokenizer):
    _, tok = arch_tokenizer
    for tag in tiny.TOOL_TAGS:
        [token] = tok.encode(tag, add_special_tokens=False)
        assert token not in tok.all_special_ids

"""Every request field honoured or refused, on a real server with the tiny models: the honoured
sampling fields change what the target chooses (and give the same tokens in ar, dflash and ddtree);
usage counts the returned text's tokens in every mode; a field not honoured is a 400 naming it."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from ddtree_devtools.server_process import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "tiny"
COUNT = [{"role": "user", "content": "Count from 3 to 20."}]
MODES = ("ar", "dflash", "ddtree")


@pytest.fixture(scope="module")
def server(tiny_models):
    args = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
            "--served-model-name", MODEL]
    with ServerProcess(args) as srv:
        srv.wait_ready()
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models / "target")


def _chat(client, mode="ddtree", **extra):
    kw = {"model": MODEL, "messages": COUNT, "temperature": 0, "max_tokens": 30}
    for key in ("max_tokens", "stop", "temperature", "seed", "top_p"):
        if key in extra:
            kw[key] = extra.pop(key)
    return client.chat.completions.create(**kw, extra_body={"speculative": {"mode": mode}, **extra})


def _same_in_every_mode(client, **fields):
    replies = [_chat(client, mode, **fields) for mode in MODES]
    texts = {r.choices[0].message.content for r in replies}
    usage = {r.usage.completion_tokens for r in replies}
    assert len(texts) == 1 and len(usage) == 1, [(r.choices[0].message.content, r.usage.completion_tokens)
                                                 for r in replies]
    return replies[0]


def test_logit_bias_moves_the_greedy_choice_in_every_mode(client, tokenizer):
    plain = _same_in_every_mode(client).choices[0].message.content
    assert plain.startswith("3 4 5")
    seven = tokenizer.encode(" 7", add_special_tokens=False)
    assert len(seven) == 1
    biased = _same_in_every_mode(client, logit_bias={str(seven[0]): 100}, max_tokens=8)
    assert biased.choices[0].message.content.endswith(" 7 7 7"), biased.choices[0].message.content
    banned = _same_in_every_mode(client, logit_bias={str(seven[0]): -100})
    assert " 7 " not in banned.choices[0].message.content


def test_top_k_and_min_p_keep_greedy_exact_in_every_mode(client):
    greedy = _same_in_every_mode(client).choices[0].message.content
    assert _same_in_every_mode(client, top_k=3, min_p=0.2).choices[0].message.content == greedy
    # top_k=1 (or a min_p that only the top token passes) samples the argmax, whatever the temperature
    assert _same_in_every_mode(client, top_k=1, temperature=1.5, seed=7).choices[0].message.content == greedy
    assert _same_in_every_mode(client, min_p=1.0, temperature=1.5, seed=7).choices[0].message.content == greedy


def test_stop_token_ids_end_the_reply_at_that_token(client, tokenizer):
    six = tokenizer.encode(" 6", add_special_tokens=False)[0]
    reply = _same_in_every_mode(client, stop_token_ids=[six])
    assert reply.choices[0].message.content == "3 4 5 6" and reply.choices[0].finish_reason == "stop"


def test_ignore_eos_runs_to_max_tokens(client):
    plain = _same_in_every_mode(client, max_tokens=40)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 40
    reply = _same_in_every_mode(client, max_tokens=40, ignore_eos=True)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 40


def test_skip_special_tokens_false_shows_the_end_token(client):
    plain = _chat(client, max_tokens=40).choices[0].message.content
    shown = _chat(client, max_tokens=40, skip_special_tokens=False).choices[0].message.content
    assert shown == plain + "<|im_end|>"


def test_usage_is_the_returned_texts_tokens_in_every_mode(client, tokenizer):
    reply = _same_in_every_mode(client, stop=[" 9"])
    text = reply.choices[0].message.content
    assert text == "3 4 5 6 7 8"
    # the tokens up to the one that completed the stop string, however many a round committed past it
    assert reply.usage.completion_tokens == len(tokenizer.encode(text + " 9", add_special_tokens=False))


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 0.5), ("frequency_penalty", -1.0), ("repetition_penalty", 1.2),
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("guided_json", {"type": "object"}), ("structured_outputs", {"regex": "a+"}), ("best_of", 2),
    ("use_beam_search", True), ("parallel_tool_calls", False), ("reasoning_effort", "high"),
    ("allowed_token_ids", [1, 2]), ("include_stop_str_in_output", True), ("chat_template", "{{ 1 }}"),
    ("continue_final_message", True), ("store", True), ("prompt_logprobs", 1), ("bad_words", ["x"]),
])
def test_a_field_not_honoured_is_a_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, **{field: value})
    assert err.value.body["param"] == field and "not supported" in err.value.body["message"]


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0), ("min_tokens", 0),
    ("logprobs", False), ("response_format", {"type": "text"}), ("parallel_tool_calls", True), ("n", 1),
    ("user", "someone"), ("store", False), ("top_k", -1),
])
def test_a_field_at_its_default_is_accepted(client, field, value):
    assert _chat(client, max_tokens=4, **{field: value}).choices[0].message.content


def test_completions_honour_the_same_fields(client, tokenizer):
    seven = tokenizer.encode("7", add_special_tokens=False)[0]
    for mode in MODES:
        reply = client.completions.create(model=MODEL, prompt="1\n2\n3\n", max_tokens=6, temperature=0,
                                          logit_bias={str(seven): 100},
                                          extra_body={"speculative": {"mode": mode}, "ignore_eos": True})
        assert set(reply.choices[0].text) == {"7"} and reply.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="1\n", max_tokens=4, extra_body={"prompt_logprobs": 2})
    assert err.value.body["param"] == "prompt_logprobs"

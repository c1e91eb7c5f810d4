"""min_tokens and logprobs on a real server with the tiny models: the same tokens and log-probabilities
in ar, dflash and ddtree, streamed or not; the log-probabilities are the target's raw ones; min_tokens
holds back the end token and stop strings as vLLM does."""

from __future__ import annotations

import math

import openai
import pytest
from transformers import AutoTokenizer

from ddtree_devtools.server_process import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "tiny"
COUNT = [{"role": "user", "content": "Count from 3 to 20."}]
MODES = ("ar", "dflash", "ddtree")
TOLERANCE = 1e-3  # the verify pass and an AR step see the same context through different attention shapes


@pytest.fixture(scope="module")
def client(tiny_models):
    args = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
            "--served-model-name", MODEL]
    with ServerProcess(args) as srv:
        srv.wait_ready()
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models / "target")


def _chat(client, mode="ddtree", stream=False, max_tokens=30, **extra):
    kw = {key: extra.pop(key) for key in ("stop", "temperature", "seed", "logprobs", "top_logprobs") if key in extra}
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=COUNT, max_tokens=max_tokens, stream=stream, **kw,
                                          extra_body={"speculative": {"mode": mode}, **extra})


def _streamed_chat(client, mode, **kw):
    """(content, logprob entries) of a streamed reply, the chunks' entries concatenated."""
    text, entries = "", []
    for chunk in _chat(client, mode, stream=True, **kw):
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        if choice.logprobs is not None:
            entries += choice.logprobs.content
    return text, entries


def _same(a, b):
    assert [e.token for e in a] == [e.token for e in b]
    for x, y in zip(a, b):
        assert x.logprob == pytest.approx(y.logprob, abs=TOLERANCE)
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
        assert [t.logprob for t in x.top_logprobs] == pytest.approx([t.logprob for t in y.top_logprobs], abs=TOLERANCE)


def test_chat_logprobs_are_the_targets_in_every_mode_streamed_or_not(client):
    replies = {mode: _chat(client, mode, logprobs=True, top_logprobs=3) for mode in MODES}
    ar = replies["ar"].choices[0]
    entries = ar.logprobs.content
    # one entry per counted token, the end token included; their texts and bytes spell the reply
    assert len(entries) == replies["ar"].usage.completion_tokens
    assert "".join(e.token for e in entries) == ar.message.content + "<|im_end|>"
    assert b"".join(bytes(e.bytes) for e in entries).decode() == ar.message.content + "<|im_end|>"
    for e in entries:  # greedy: the chosen token is the most likely one
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob) and e.logprob <= 0
        assert math.fsum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-6
    for mode in MODES:
        choice = replies[mode].choices[0]
        assert choice.message.content == ar.message.content
        _same(choice.logprobs.content, entries)
        text, streamed = _streamed_chat(client, mode, logprobs=True, top_logprobs=3)
        assert text == ar.message.content
        _same(streamed, entries)


def test_no_logprobs_unless_asked(client):
    assert _chat(client, max_tokens=4).choices[0].logprobs is None
    assert all(c.choices[0].logprobs is None for c in _chat(client, stream=True, max_tokens=4) if c.choices)
    plain = _chat(client, logprobs=True).choices[0].logprobs.content  # logprobs alone: no alternatives
    assert plain and all(e.top_logprobs == [] for e in plain)


def test_logprobs_are_of_the_raw_distribution(client, tokenizer):
    """Bias, temperature and top-k change which token is chosen, never the log-probabilities shown:
    those are the model's own (vLLM's default, raw_logprobs)."""
    seven = tokenizer.encode(" 7", add_special_tokens=False)
    assert len(seven) == 1
    plain = _chat(client, max_tokens=1, logprobs=True, top_logprobs=5).choices[0].logprobs.content[0]
    biased = _chat(client, max_tokens=1, logprobs=True, top_logprobs=5,
                   logit_bias={str(seven[0]): 100}).choices[0].logprobs.content[0]
    assert plain.token == "3" and biased.token == " 7"
    assert biased.logprob < -1.0, "the biased token's log-probability is the unbiased model's"
    hot = _chat(client, max_tokens=1, logprobs=True, top_logprobs=5, temperature=1.5, seed=3,
                top_k=2).choices[0].logprobs.content[0]
    for other in (biased, hot):
        assert [t.token for t in other.top_logprobs] == [t.token for t in plain.top_logprobs]
        assert [t.logprob for t in other.top_logprobs] == pytest.approx([t.logprob for t in plain.top_logprobs],
                                                                        abs=TOLERANCE)


def test_completions_logprobs_shape_in_every_mode(client):
    replies = []
    for mode in MODES:
        reply = client.completions.create(model=MODEL, prompt="1\n2\n3\n", max_tokens=12, temperature=0, logprobs=2,
                                          extra_body={"speculative": {"mode": mode}, "ignore_eos": True})
        replies.append(reply.choices[0])
        lp = reply.choices[0].logprobs
        text = reply.choices[0].text
        n = reply.usage.completion_tokens
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
        assert "".join(lp.tokens) == text
        for i, token in enumerate(lp.tokens):
            assert text[lp.text_offset[i]:].startswith(token)
            # the two most likely and the chosen one (greedy: it is the most likely)
            assert len(lp.top_logprobs[i]) == 2 and lp.top_logprobs[i][token] == lp.token_logprobs[i]
        streamed = client.completions.create(model=MODEL, prompt="1\n2\n3\n", max_tokens=12, temperature=0, logprobs=2,
                                             stream=True, extra_body={"speculative": {"mode": mode}, "ignore_eos": True})
        chunks = [c.choices[0] for c in streamed if c.choices]
        assert "".join(c.text for c in chunks) == text
        assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == lp.tokens
        assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset
    ar = replies[0]
    for choice in replies[1:]:
        assert choice.logprobs.tokens == ar.logprobs.tokens
        assert choice.logprobs.token_logprobs == pytest.approx(ar.logprobs.token_logprobs, abs=TOLERANCE)


def test_min_tokens_holds_back_the_end_in_every_mode(client):
    plain = _chat(client, max_tokens=60)
    natural = plain.usage.completion_tokens
    assert plain.choices[0].finish_reason == "stop" and natural < 40
    longer = [_chat(client, mode, max_tokens=60, min_tokens=natural + 10) for mode in MODES]
    assert len({r.choices[0].message.content for r in longer}) == 1
    assert {r.usage.completion_tokens for r in longer} == {longer[0].usage.completion_tokens}
    assert longer[0].usage.completion_tokens >= natural + 10
    assert longer[0].choices[0].message.content.startswith(plain.choices[0].message.content)
    # a min_tokens the reply reaches anyway changes nothing
    assert _chat(client, max_tokens=60, min_tokens=natural - 1).choices[0].message.content == \
        plain.choices[0].message.content
    # with ignore_eos the end token is no stop, so min_tokens has nothing to hold back
    assert _chat(client, max_tokens=60, min_tokens=5, ignore_eos=True).usage.completion_tokens == 60


def test_min_tokens_keeps_stop_strings_from_ending_the_first_tokens(client):
    """As vLLM: a stop string counts only if it ends in the text after the first min_tokens tokens."""
    for mode in MODES:
        assert _chat(client, mode, stop=["5"]).choices[0].message.content == "3 4 "
        reply = _chat(client, mode, stop=["5"], min_tokens=4)  # "3 4 5 6": the next "5" is 15's
        assert reply.choices[0].message.content == "3 4 5 6 7 8 9 10 11 12 13 14 1"
        assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"min_tokens": 31}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
])
def test_bad_logprobs_and_min_tokens_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=COUNT, max_tokens=30, extra_body=body)
    assert err.value.body["param"] == param


@pytest.mark.parametrize("logprobs", [21, True, -1])
def test_bad_completions_logprobs_are_400s(client, logprobs):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="1", max_tokens=2, extra_body={"logprobs": logprobs})
    assert err.value.body["param"] == "logprobs"

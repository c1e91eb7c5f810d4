"""Engine API behaviour the server relies on: validation errors, stop/length handling, cancellation,
per-request overrides, and an engine without a drafter."""

from __future__ import annotations

import pytest

from ddtree_runtime.engine import Engine, EngineConfig, RoundOutput, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_models) -> Engine:
    return Engine(EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft"), max_context=256))


def _chat(engine: Engine, q: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False)


def test_attributes(engine, tiny_models):
    assert engine.max_context == 256
    assert engine.model_name == "target" and engine.draft_name == "draft"
    assert engine.tokenizer.convert_tokens_to_ids("<|im_end|>") in engine.eos_ids


@pytest.mark.parametrize("prompt,params", [
    ([], SamplingParams(max_new_tokens=4)),
    ([1, 2], SamplingParams(max_new_tokens=4, mode="beam")),
    ([1, 2], SamplingParams(max_new_tokens=4, tree_budget=0)),
    ([1, 2], SamplingParams(max_new_tokens=0)),
    ([1] * 200, SamplingParams(max_new_tokens=100)),  # 300 > max_context 256
    ([1, 2], SamplingParams(max_new_tokens=4, temperature=-1.0)),
    ([1, 2], SamplingParams(max_new_tokens=4, top_p=0.0)),
    ([10 ** 7], SamplingParams(max_new_tokens=4)),
])
def test_invalid_requests_raise_value_error_at_call(engine, prompt, params):
    with pytest.raises(ValueError):
        engine.generate(prompt, params)  # raised eagerly, before the first round


def test_answers_arithmetic_and_stops_at_eos(engine):
    rounds = list(engine.generate(_chat(engine, "What is 2+3?"), SamplingParams(max_new_tokens=20)))
    assert all(isinstance(r, RoundOutput) for r in rounds)
    assert [r.finished for r in rounds] == [False] * (len(rounds) - 1) + [True]
    assert rounds[-1].finish_reason == "stop"
    ids = [t for r in rounds for t in r.token_ids]
    assert ids[-1] in engine.eos_ids
    assert engine.tokenizer.decode(ids, skip_special_tokens=True).strip() == "5"


def test_length_cut_exactly(engine):
    for mode in ("ar", "dflash", "ddtree"):
        rounds = list(engine.generate(_chat(engine, "Count from 1 to 60."),
                                      SamplingParams(max_new_tokens=7, mode=mode)))
        assert sum(len(r.token_ids) for r in rounds) == 7
        assert rounds[-1].finish_reason == "length"
        assert all(1 <= len(r.token_ids) for r in rounds)


def test_custom_stop_token(engine):
    prompt = _chat(engine, "Count from 1 to 60.")
    full = [t for r in engine.generate(prompt, SamplingParams(max_new_tokens=30)) for t in r.token_ids]
    stop = full[5]
    cut = [t for r in engine.generate(prompt, SamplingParams(max_new_tokens=30,
                                                             stop_token_ids=frozenset({stop})))
           for t in r.token_ids]
    assert cut == full[: full.index(stop) + 1]


def test_cancel_midway_then_reuse(engine):
    prompt = _chat(engine, "Count from 1 to 60.")
    gen = engine.generate(prompt, SamplingParams(max_new_tokens=60))
    next(gen)
    next(gen)
    gen.close()  # cancel: the engine must serve the next request from a clean state
    a = [t for r in engine.generate(prompt, SamplingParams(max_new_tokens=30)) for t in r.token_ids]
    b = [t for r in engine.generate(prompt, SamplingParams(max_new_tokens=30, mode="ar"))
         for t in r.token_ids]
    assert a == b


def test_big_per_request_budget_grows_cache(engine):
    prompt = _chat(engine, "Count from 1 to 60.")
    a = [t for r in engine.generate(prompt, SamplingParams(max_new_tokens=30, tree_budget=300))
         for t in r.token_ids]
    b = [t for r in engine.generate(prompt, SamplingParams(max_new_tokens=30, mode="ar"))
         for t in r.token_ids]
    assert a == b


def test_ar_only_engine(tiny_models):
    eng = Engine(EngineConfig(str(tiny_models / "target"), None, mode="ar"))
    assert eng.draft_name is None
    with pytest.raises(ValueError):
        eng.generate([1, 2], SamplingParams(max_new_tokens=3, mode="ddtree"))
    out = list(eng.generate([1, 2], SamplingParams(max_new_tokens=3)))
    assert sum(len(r.token_ids) for r in out) <= 3 and all(r.accepted == 0 for r in out)
    with pytest.raises(ValueError):
        Engine(EngineConfig(str(tiny_models / "target"), None, mode="ddtree"))

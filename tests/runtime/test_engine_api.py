"""Engine API behaviour the server relies on: the seam it calls (api.ServedEngine, met by the engine and
the tensor-parallel Leader alike), the limits it publishes and the one check of a request against them,
validation errors, stop/length handling, cancellation, per-request overrides, and an engine without a
drafter."""

from __future__ import annotations

import pytest

import inspect

from ddtree_runtime.capacity import least_pool_tokens
from ddtree_runtime.engine import Engine, EngineConfig, RoundOutput, SamplingParams
from ddtree_runtime.engine.api import RequestRefused, ServedEngine
from ddtree_runtime.engine.distributed import Leader


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


def _interface() -> set[str]:
    return {name for name, _ in inspect.getmembers(ServedEngine) if not name.startswith("_")} | set(
        ServedEngine.__annotations__)


def test_the_engine_and_the_leader_both_are_the_servers_engine(engine):
    """Every call of the seam is the engine's own, and the Leader's own (not its fall-through to rank 0's
    engine): a tensor-parallel server is served through the same interface."""
    names = _interface()
    assert {"info", "tokenizer", "submit", "step", "cancel", "warm_up", "capacity", "has_room"} <= names
    assert all(hasattr(engine, name) for name in names)
    assert all(name in vars(Leader) for name in names), names - set(vars(Leader))


def test_the_limits_are_published_and_checked_once(engine):
    limits = engine.info.limits
    assert (limits.max_context, limits.vocab_size, limits.has_drafter, limits.mode) == (
        256, engine.target.config.vocab_size, True, "ddtree")
    assert limits.pool_pages == engine.capacity()["pages_total"] and limits.block_size == engine.block_size
    assert (engine.info.model_name, engine.info.draft_name, engine.info.arch) == ("target", "draft", "qwen3")
    for prompt, params, field, code in (
            ([1] * 256, SamplingParams(max_new_tokens=1), "prompt", "context_length_exceeded"),
            ([1] * 200, SamplingParams(max_new_tokens=100), "max_new_tokens", "context_length_exceeded"),
            ([1, 2], SamplingParams(max_new_tokens=4, logit_bias={limits.vocab_size: 1.0}), "logit_bias", None),
            ([1, 2], SamplingParams(max_new_tokens=4, stop_token_ids=frozenset({-1})), "stop_token_ids", None),
            ([1, 2], SamplingParams(max_new_tokens=4, mode="beam"), "mode", None),
            ([1, 2], SamplingParams(max_new_tokens=4, min_tokens=5), "min_tokens", None)):
        with pytest.raises(RequestRefused) as refused:
            limits.check(prompt, params)
        assert (refused.value.field, refused.value.code) == (field, code)
        with pytest.raises(RequestRefused):  # submit runs the same check
            engine.submit(prompt, params)
    assert not engine.has_work


def test_a_pool_too_small_for_one_request_is_refused_at_construction(tiny_models):
    least = least_pool_tokens("ddtree", 16, 16, 16)
    assert least == 112  # the warm-up's longest request (81 tokens) and a ddtree@16 round's 32 positions
    with pytest.raises(ValueError, match=f"kv_pool_tokens 16: too small to serve.*give at least {least}"):
        Engine(EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft"), max_context=256,
                            kv_pool_tokens=16))
    smallest = Engine(EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft"), max_context=256,
                                   kv_pool_tokens=least))
    smallest.warm_up()  # the least pool serves the warm-up
    assert smallest.capacity()["pages_used"] == 0


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

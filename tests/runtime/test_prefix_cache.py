"""Prefix reuse (engine/prefix_cache.py), greedy, both tiny pairs: a later turn that starts with an earlier
request's tokens reuses their cache and gives the same tokens as with reuse off, in ar, dflash and
ddtree modes; a prefix that diverges in its last token is not reused past it; the hybrid's kept state
survives neighbours in the batch and pad rows over it; eviction under pressure stays correct; the
counters say what was reused."""

from __future__ import annotations

import pytest
import torch

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine.prefix_cache import common_prefix, snapshot_point
from ddtree_devtools.tiny_corpus import heldout_questions

MAX_NEW = 24
MODES = ("ar", "dflash", "ddtree")


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def models(request):
    return request.getfixturevalue("tiny_models" if request.param == "qwen3" else "tiny_hybrid_models")


def make_engine(models, prefix_cache: bool = True, **kw) -> Engine:
    return Engine(EngineConfig(str(models / "target"), str(models / "draft"), prefix_cache=prefix_cache, **kw))


@pytest.fixture(scope="module")
def plain(models) -> Engine:
    """The reference: reuse off."""
    return make_engine(models, prefix_cache=False)


def tokens(engine: Engine, prompt: list[int], mode: str, max_new: int = MAX_NEW) -> list[int]:
    return [t for r in engine.generate(prompt, SamplingParams(max_new_tokens=max_new, mode=mode)) for t in r.token_ids]


def chat(engine: Engine, messages: list[dict]) -> list[int]:
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)


def row_cache(engine: Engine, request_id: int) -> list[torch.Tensor]:
    """What a request's row holds for its context: the target's KV (and a hybrid's recurrent state and
    conv tail) and the drafter's KV."""
    req = engine.scheduler.find(request_id)
    row, n = req.slot, req.n_ctx
    c = engine.runner.target_cache
    held = [*c.held(row, n)]  # through the row's block table
    if hasattr(c, "state"):  # a hybrid target
        held += [c.state[:, row], c.conv[:, row]]
    if req.mode.drafts:
        held += [*engine.runner.draft_cache.held(row, n)]
    return [t.clone() for t in held]


def prefilled_cache(engine: Engine, prompt: list[int], mode: str) -> list[torch.Tensor]:
    """The row's cache right after `prompt`'s prefill (the request is then cancelled)."""
    rid = engine.submit(prompt, SamplingParams(max_new_tokens=MAX_NEW, mode=mode))
    while engine.scheduler.find(rid) not in engine.scheduler.running:
        engine.step()
    held = row_cache(engine, rid)
    engine.cancel(rid)
    return held


def assert_same_cache(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def saved(engine: Engine) -> tuple[int, int, int]:
    s = engine.stats
    return s.prefix_lookups, s.prefix_hits, s.prefix_tokens_saved


def test_common_prefix_and_snapshot_point():
    a = list(range(1000))
    assert common_prefix(a, a) == 1000
    assert common_prefix(a, a[:700] + [-1] + a[701:]) == 700
    assert common_prefix(a[:3], a) == 3 and common_prefix([], a) == 0
    assert snapshot_point([5, 9, 1, 9, 2], 9, 0) == 3      # the last turn start
    assert snapshot_point([5, 9, 1, 9, 2], 9, 3) == 5      # reused past it: the prompt's end
    assert snapshot_point([5, 1, 2], None, 0) == 3


@pytest.mark.parametrize("mode", MODES)
def test_two_turn_conversation_same_tokens_with_reuse(models, plain, mode):
    """Turn 2 through the chat template (the previous answer re-rendered), then a completion continued
    with its own answer: both reuse a prefix, and every turn's tokens equal reuse off."""
    engine = make_engine(models, max_running=2)
    question, follow = heldout_questions(2, seed=11)
    turns = [[{"role": "user", "content": question}]]
    answers = {}
    for eng in (plain, engine):
        messages = list(turns[0])
        first = chat(eng, messages)
        a1 = tokens(eng, first, mode)
        messages += [{"role": "assistant", "content": eng.tokenizer.decode(a1, skip_special_tokens=True)},
                     {"role": "user", "content": follow}]
        second = chat(eng, messages)
        a2 = tokens(eng, second, mode)
        continued = first + a1 + eng.tokenizer.encode("\nAnd then?\n", add_special_tokens=False)
        a3 = tokens(eng, continued, mode)
        answers[eng is engine] = (a1, a2, a3)
    assert answers[True] == answers[False]
    lookups, hits, tokens_saved = saved(engine)
    assert (lookups, hits) == (3, 2)
    # the chat turn shares the first turn up to the start of its assistant turn (where the hybrid keeps
    # a state); the continuation reuses the first turn's whole sequence but its last token (whose KV was
    # never computed)
    first = chat(engine, turns[0])
    turn_start = snapshot_point(first, engine.scheduler.turn_token, 0)
    assert 0 < turn_start < len(first)
    assert tokens_saved >= turn_start + len(first) + len(answers[True][0]) - 1


@pytest.mark.parametrize("mode", ["dflash", "ddtree"])
def test_sliding_drafter_same_rounds_with_reuse(models, tmp_path, mode):
    """A drafter whose first layer slides over 8 positions keeps them in a ring per row (draft_cache.py):
    a chat's second turn and a completion continued by 5 tokens (fewer than the window: it takes the
    first sequence's ring, where its row lies) commit the same tokens, round for round, with reuse as
    without it (a wrong ring would change what is drafted, so what each round accepts)."""
    from ddtree_devtools.tiny import relaid_drafter

    draft = relaid_drafter(models / "draft", tmp_path / "draft", 8)
    engines = [Engine(EngineConfig(str(models / "target"), str(draft), prefix_cache=reuse, max_running=2))
               for reuse in (False, True)]
    question, follow = heldout_questions(2, seed=12)
    runs = []
    for eng in engines:
        rounds = []

        def run(prompt: list[int]) -> list[int]:
            outs = [r.token_ids for r in eng.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW, mode=mode))]
            rounds.append([len(o) for o in outs])
            return [t for o in outs for t in o]
        messages = [{"role": "user", "content": question}]
        first = chat(eng, messages)
        a1 = run(first)
        messages += [{"role": "assistant", "content": eng.tokenizer.decode(a1, skip_special_tokens=True)},
                     {"role": "user", "content": follow}]
        run(chat(eng, messages))
        run(first + a1 + eng.tokenizer.encode("\nAnd?\n", add_special_tokens=False)[:5])
        runs.append(rounds)
    assert runs[0] == runs[1]
    assert saved(engines[1])[1] == 2 and engines[1].runner.draft_cache.ring_size == 64


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_reused_prefill_leaves_the_same_cache(models, plain, mode):
    """Token equality is a weak witness on tiny models (a wrong recurrent state moves the logits by
    0.1-0.4 without flipping an argmax), so: after a second turn's prefill from the first turn's kept
    prefix, the row holds what a full prefill leaves (target KV, hybrid state and conv tail, drafter KV)."""
    engine = make_engine(models, max_running=2)
    question, follow = heldout_questions(2, seed=12)
    first = chat(engine, [{"role": "user", "content": question}])
    a1 = tokens(engine, first, mode)
    messages = [{"role": "user", "content": question},
                {"role": "assistant", "content": engine.tokenizer.decode(a1, skip_special_tokens=True)},
                {"role": "user", "content": follow}]
    for second in (chat(engine, messages), first + a1 + engine.tokenizer.encode("\nMore.\n")):
        before = saved(engine)[2]
        got = prefilled_cache(engine, second, mode)
        assert saved(engine)[2] > before
        assert_same_cache(got, prefilled_cache(plain, second, mode))
        engine.pool.evict(engine.prefix.by_row[0])  # keep the first turn's sequence (row 1) the best match
    assert len(engine.prefix) == 1


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_prefix_diverging_in_last_token_is_not_reused_past_it(models, plain, mode):
    engine = make_engine(models, max_running=1)
    hybrid = engine.prefix.snapshots_only
    q = heldout_questions(3, seed=5)[2]
    prompt = chat(engine, [{"role": "user", "content": q}])
    for case in range(3):
        engine.prefix.clear()
        tokens(engine, prompt, mode)
        (seq,) = engine.prefix.by_row.values()  # the prompt and its answer but the last token
        cached = seq.tokens
        assert cached[:len(prompt)] == prompt and len(cached) > len(prompt)
        other = next(t for t in range(5, 500) if t not in (cached[-1], prompt[-1]))
        probe = [cached[:-1] + [other] + [cached[-1]],   # the cached sequence with its last token changed
                 prompt[:-1] + [other],                  # the earlier prompt with its last token changed
                 list(prompt)][case]                     # the same prompt again: one token is always computed
        before = saved(engine)[2]
        assert tokens(engine, probe, mode) == tokens(plain, probe, mode)
        reused = saved(engine)[2] - before
        limit = min(common_prefix(probe, cached), len(probe) - 1)
        assert reused == (max(p for p in (seq.snapshot_at, seq.end) if p <= limit) if hybrid else limit)
        assert reused < len(probe) and (case != 0 or reused <= len(cached) - 1)


def test_hybrid_state_survives_neighbours_and_pad_rows(tiny_hybrid_models):
    """A cached hybrid sequence sits in an idle row while neighbours run (moved between rows as they
    come and go, a pad row of their 4-row passes over it), then a second turn reuses it beside them."""
    models = tiny_hybrid_models
    engine = make_engine(models, max_running=3, prefix_cache_rows=1)
    plain = make_engine(models, prefix_cache=False, max_running=3)
    assert engine.rows == 4 and engine.slots == 3
    qs = heldout_questions(6, seed=21)
    first = chat(engine, [{"role": "user", "content": qs[0]}])
    a1 = tokens(engine, first, "ddtree")
    turn2 = first + a1 + engine.tokenizer.encode("\nWhy?\n", add_special_tokens=False)
    neighbours = [chat(engine, [{"role": "user", "content": q}]) for q in qs[1:4]]
    modes = ["ar", "ddtree", "ar"]
    expected = [tokens(plain, p, m, 40) for p, m in zip(neighbours, modes)]
    expected2 = tokens(plain, turn2, "ddtree")
    ids = [engine.submit(p, SamplingParams(max_new_tokens=40, mode=m)) for p, m in zip(neighbours, modes)]
    out = {i: [] for i in ids}
    step, second, want2 = 0, None, None
    while engine.has_work:
        if second is not None and want2 is None and engine.scheduler.find(second) in engine.scheduler.running:
            want2 = row_cache(engine, second)
        if step == 2:  # the neighbours decode as a batch of 3 in 4-row passes; one leaves early
            assert len(engine.scheduler.running) == 3 and engine.stats.batch_size == 3
            assert list(engine.prefix.by_row) == [3]  # the first turn, in the pad row of those passes
            engine.cancel(ids[1])
            second = engine.submit(turn2, SamplingParams(max_new_tokens=MAX_NEW, mode="ddtree"))
            out[second] = []
        for request_id, o in engine.step():
            out[request_id] += o.token_ids
        step += 1
    assert [out[i] for i in (ids[0], ids[2])] == [expected[0], expected[2]]
    assert out[second] == expected2
    assert_same_cache(want2, prefilled_cache(plain, turn2, "ddtree"))
    assert engine.stats.prefix_hits >= 1 and engine.stats.prefix_tokens_saved >= len(first) + len(a1) - 1


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_eviction_under_pressure_stays_correct(models, plain, mode):
    """Three conversations through two rows: turns interleaved so cached sequences move and are evicted;
    every turn equals reuse off."""
    engine = make_engine(models, max_running=2)
    qs = heldout_questions(3, seed=33)
    convs = {k: chat(engine, [{"role": "user", "content": q}]) for k, q in enumerate(qs)}
    more = engine.tokenizer.encode("\nGo on.\n", add_special_tokens=False)
    for k in (0, 1, 2, 0, 1, 0, 2, 2):
        prompt = convs[k]
        out = tokens(engine, prompt, mode)
        assert out == tokens(plain, prompt, mode), f"conversation {k} diverged"
        convs[k] = prompt + out + more
    lookups, hits, _ = saved(engine)
    assert lookups == 8 and hits >= 2 and engine.stats.prefix_evictions >= 1
    assert len(engine.prefix) <= engine.rows


def test_reuse_off_keeps_nothing(models):
    engine = make_engine(models, prefix_cache=False)
    prompt = chat(engine, [{"role": "user", "content": "Hello"}])
    tokens(engine, prompt, "ar")
    tokens(engine, prompt, "ar")
    assert engine.prefix is None and saved(engine) == (0, 0, 0)


def test_snapshots_are_sized_into_the_pool(tiny_hybrid_models):
    """A hybrid pool with reuse keeps a second state per row (and says so in its size)."""
    on = make_engine(tiny_hybrid_models, max_running=2)
    off = make_engine(tiny_hybrid_models, prefix_cache=False, max_running=2)
    size = lambda e: sum(t.numel() * t.element_size() for t in e.runner.target_cache._per_slot())  # noqa: E731
    state = on.runner.target_cache.state
    assert size(on) - size(off) == state.numel() * state.element_size() + on.runner.target_cache.conv.numel() * \
        on.runner.target_cache.conv.element_size()
    assert torch.equal(on.runner.target_cache.snap_state, torch.zeros_like(state))


def test_hybrid_keeps_its_turn_start_state_within_one_pass(tiny_hybrid_models):
    """The state at a prompt's last turn start is kept inside the prompt's one prefill pass (not by a pass
    cut there): the snapshot holds what a prefill of the prompt up to that point leaves as its state."""
    engine = make_engine(tiny_hybrid_models, max_running=2)
    plain = make_engine(tiny_hybrid_models, prefix_cache=False, max_running=2)
    question, follow = heldout_questions(2, seed=31)
    prompt = chat(engine, [{"role": "user", "content": question}, {"role": "assistant", "content": "Yes."},
                           {"role": "user", "content": follow}])
    turn_start = snapshot_point(prompt, engine.scheduler.turn_token, 0)
    assert 0 < turn_start < len(prompt)
    rid = engine.submit(prompt, SamplingParams(max_new_tokens=MAX_NEW, mode="ar"))
    engine.step()
    assert engine.stats.prefill_passes == 1 and engine.stats.prefill_tokens == len(prompt)
    row, c = engine.scheduler.find(rid).slot, engine.runner.target_cache
    *_, state, conv = prefilled_cache(plain, prompt[:turn_start], "ar")
    assert_same_cache([c.snap_state[:, row], c.snap_conv[:, row]], [state, conv])
    assert not torch.allclose(c.snap_state[:, row], c.state[:, row])  # the live state went on past it


@pytest.mark.slow
def test_through_the_server_same_text_and_counters(tiny_hybrid_models):
    """A two-turn chat (and a completion continued with its own text) through ddtree-serve, with reuse
    on and with --no-prefix-cache: the same text; /metrics counts the hits and the tokens saved."""
    import httpx

    from ddtree_devtools.server_process import ServerProcess

    models = tiny_hybrid_models
    base = ["--target", str(models / "target"), "--draft", str(models / "draft"), "--served-model-name", "tiny",
            "--max-running", "2"]
    question, follow = heldout_questions(2, seed=44)

    def converse(srv: ServerProcess) -> list[str]:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            def ask(messages):
                body = {"model": "tiny", "messages": messages, "max_tokens": MAX_NEW, "temperature": 0}
                return c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
            messages = [{"role": "user", "content": question}]
            first = ask(messages)
            second = ask(messages + [{"role": "assistant", "content": first}, {"role": "user", "content": follow}])
            prompt = f"{question}\n"
            text = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_NEW,
                                                   "temperature": 0}).json()["choices"][0]["text"]
            more = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt + text + "\nWhy?\n",
                                                   "max_tokens": MAX_NEW, "temperature": 0}).json()
            return [first, second, text, more["choices"][0]["text"]]

    def counters(srv: ServerProcess) -> dict[str, float]:
        lines = httpx.get(srv.url + "/metrics").text.splitlines()
        assert "# TYPE ddtree_prefix_cache_hits_total counter" in lines
        return {k: float(v) for k, v in (line.split(" ") for line in lines if line.startswith("ddtree_prefix"))}

    with ServerProcess(base + ["--prefix-cache-rows", "1"]) as srv:
        srv.wait_ready()
        before = counters(srv)
        assert before["ddtree_prefix_cache_lookups_total"] == 0  # the start-up warm-up leaves no trace there
        texts = converse(srv)
        after = counters(srv)
    with ServerProcess(base + ["--no-prefix-cache"]) as srv:
        srv.wait_ready()
        assert converse(srv) == texts
        assert counters(srv)["ddtree_prefix_cache_lookups_total"] == 0
    assert after["ddtree_prefix_cache_lookups_total"] - before["ddtree_prefix_cache_lookups_total"] == 4
    assert after["ddtree_prefix_cache_hits_total"] - before["ddtree_prefix_cache_hits_total"] >= 2
    assert after["ddtree_prefix_cache_tokens_saved_total"] > before["ddtree_prefix_cache_tokens_saved_total"]
    assert 1 <= after["ddtree_prefix_cache_sequences"] <= 3


@pytest.mark.parametrize("argv, message", [
    (["--prefix-cache-rows", "-1"], "--prefix-cache-rows -1: must be >= 0"),
    (["--no-prefix-cache", "--prefix-cache-rows", "2"], "--prefix-cache-rows needs the prefix cache"),
])
def test_prefix_cache_flags_are_checked(tiny_models, argv, message):
    from ddtree_runtime.server.cli import UsageError, build_parser, config_from_args

    base = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft")]
    with pytest.raises(UsageError, match=message):
        config_from_args(build_parser().parse_args(base + argv), {})
    config = config_from_args(build_parser().parse_args(base + ["--prefix-cache-rows", "2"]), {})
    assert config.engine_kwargs()["prefix_cache_rows"] == 2 and config.engine_kwargs()["prefix_cache"]
    assert not config_from_args(build_parser().parse_args(base + ["--no-prefix-cache"]), {}).prefix_cache

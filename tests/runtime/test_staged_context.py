"""The drafter context of AR rounds, staged and written later (engine/draft_cache.py, "Staged context"):
on the tiny pair, with full and sliding drafter layers, an engine that stages leaves in the drafter cache
what writing every AR round eagerly leaves (after rounds that fill the staging and rounds that do not),
commits the same tokens and accepts the same drafts when tree rounds follow AR rounds, and leaves a whole
drafter context to a prefix reused after its request finished or while it runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine.costs import CostModel
from ddtree_runtime.engine.policy import AR
from ddtree_devtools.tiny_corpus import mixed_prompts


@pytest.fixture(params=[None, 8], ids=["full", "sliding"])
def draft(request, tiny_models, tmp_path) -> Path:
    """The tiny drafter as trained, or relaid with a first layer that slides over 8 positions (its
    keys in a ring per row)."""
    if request.param is None:
        return tiny_models / "draft"
    from ddtree_devtools.tiny import relaid_drafter
    return relaid_drafter(tiny_models / "draft", tmp_path / "draft", request.param)


def engines(tiny_models: Path, draft: Path, **kw) -> tuple[Engine, Engine]:
    """Two like engines choosing budgets by cost: the first stages its AR rounds' drafter context, the
    second writes it every round (the reference)."""
    made = [Engine(EngineConfig(str(tiny_models / "target"), str(draft), tree_policy="cost", **kw)) for _ in range(2)]
    runner = made[1].runner

    def eager(reqs, out) -> None:  # what every AR round wrote before staging
        if out is None or not any(r.mode.drafts for r in reqs):
            return
        n, cache = len(reqs), runner.draft_cache
        drafts = torch.tensor([r.mode.drafts for r in reqs])[:, None]
        pos = torch.where(drafts, out.start[:n, None], cache.capacity - 1)
        runner.drafter.write_context(out.feats[:n, :1], pos, cache.rows(0, n))

    def eager_ahead(req) -> None:  # a lone row's pass run ahead, written once committed
        if req.ahead_context is not None:
            feats, pos = req.ahead_context
            runner.drafter.write_context(feats[:, None], pos[:, None], runner.draft_cache.rows(req.slot, req.slot + 1))
            req.ahead_context = None

    runner._round_context, runner._stage_ahead = eager, eager_ahead
    return made[0], made[1]


def writes(engine: Engine) -> list[int]:
    """Counts the drafter-context writes of the staged context (each flush) into the returned list."""
    cache, calls = engine.runner.draft_cache, []
    write = cache.write

    def counted(feats, slots, rows) -> None:
        calls.append(slots.shape[1])
        write(feats, slots, rows)
    cache.write = counted
    return calls


def drafter_rows(engine: Engine, ids: list[int]) -> list[torch.Tensor]:
    """Each running request's drafter k and v over its context (written first: `held` flushes)."""
    held = []
    for request_id in ids:
        req = engine.scheduler.find(request_id)
        held += [t.clone() for t in engine.runner.draft_cache.held(req.slot, req.n_ctx)]
    return held


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Equal up to float32 rounding: a write of a block of positions runs its GEMMs at another shape
    than one position's (a few values differ in the last bits)."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def run(engine: Engine, jobs: list[tuple[list[int], SamplingParams]], schedule: list[int]) -> tuple[list, list, int]:
    """Serve the jobs (beside whatever else runs) with the chosen rows' budget forced round by round
    (`schedule`, cycled) until they finish; returns each job's tokens and its rounds' accepted drafts,
    and the most context any step left staged."""
    ids = [engine.submit(prompt, p) for prompt, p in jobs]
    tokens, accepted = {i: [] for i in ids}, {i: [] for i in ids}
    staged, step, running = 0, 0, set(ids)
    while running:
        engine.policy.forced = schedule[step % len(schedule)]
        for request_id, out in engine.step():
            if request_id in running:
                tokens[request_id] += out.token_ids
                accepted[request_id].append(out.accepted)
                if out.finished:
                    running.discard(request_id)
        staged, step = max(staged, sum(engine.runner.draft_cache.pending)), step + 1
    engine.policy.forced = None
    return [tokens[i] for i in ids], [accepted[i] for i in ids], staged


def test_ar_rounds_leave_what_eager_writes_leave(tiny_models, draft):
    """Two drafting requests and an AR one, in AR rounds only: 5 rounds stage without a write; reading
    the cache writes them; 35 more fill the staging twice (one write of the batch each time) and leave
    3 staged; each time the drafter cache holds what the eager engine's does, the AR request's row
    untouched."""
    staged, eager = engines(tiny_models, draft, max_running=3)
    prompts = mixed_prompts(staged.tokenizer, chats=1, chat_seed=3, plain=2, plain_seed=5, cut=4)
    modes = ("ddtree", "ar", "ddtree")
    for engine in (staged, eager):
        engine.policy.forced = AR
        ids = [engine.submit(p, SamplingParams(max_new_tokens=80, ignore_eos=True, mode=m))
               for p, m in zip(prompts, modes)]
        while engine.scheduler.waiting or engine.scheduler.prefilling is not None:
            engine.step()
    staged.runner.draft_cache.flush()  # the rounds that ran beside the prompts
    calls = writes(staged)
    assert staged.runner.draft_cache.stage_len == 16
    for rounds, left, flushes in ((5, 5, 0), (35, 3, 3)):
        for _ in range(rounds):
            staged.step()
            eager.step()
        assert staged.runner.draft_cache.pending[:3] == [left, 0, left] and len(calls) == flushes
        assert_same(drafter_rows(staged, ids), drafter_rows(eager, ids))
        assert not any(staged.runner.draft_cache.pending)  # read: written first


def test_tree_rounds_after_ar_rounds_draft_as_after_eager_writes(tiny_models, draft):
    """Budgets forced to AR, AR, AR, a tree, ... and to 20 AR rounds (more than the staging holds)
    then trees: each tree round writes what was staged before it drafts, so the same drafts are
    accepted round by round as with eager writes, and the tokens are the target's own, greedy and
    seeded."""
    staged, eager = engines(tiny_models, draft, max_running=2)
    prompts = mixed_prompts(staged.tokenizer, chats=1, chat_seed=3, plain=1, plain_seed=5, cut=4)
    greedy = [(p, SamplingParams(max_new_tokens=60, ignore_eos=True)) for p in prompts]
    seeded = [(p, SamplingParams(max_new_tokens=40, temperature=0.9, seed=7 + i)) for i, p in enumerate(prompts)]
    reference = [run(staged, [(p, SamplingParams(max_new_tokens=60, ignore_eos=True, mode="ar"))], [AR])[0][0]
                 for p in prompts]
    for schedule in ([AR, AR, AR, 16], [AR] * 20 + [16] * 3):
        for jobs in (greedy, seeded):
            tokens, accepted, most = run(staged, jobs, schedule)
            assert (tokens, accepted) == run(eager, jobs, schedule)[:2]
            assert most > 0 and sum(map(sum, accepted)) > 0  # staged, and trees were accepted from
            if jobs is greedy:
                assert tokens == reference


def test_a_prefix_reused_after_ar_rounds_has_its_drafter_context(tiny_models, draft):
    """A request finishes in AR rounds with context staged: its row, kept as a cached sequence, keeps it
    staged, and once read holds the drafter context the eager engine's does; a continuation reusing it
    drafts (and accepts) the same. A prompt sharing a running request's context while that request has context staged
    takes it whole too."""
    staged, eager = engines(tiny_models, draft, max_running=2, prefix_cache=True)
    prompt = mixed_prompts(staged.tokenizer, chats=0, chat_seed=0, plain=1, plain_seed=7, cut=4)[0]
    results = []
    for engine in (staged, eager):
        (first,), _, most = run(engine, [(prompt, SamplingParams(max_new_tokens=21, ignore_eos=True))], [AR])
        assert (most > 0) == (engine is staged)  # it finished with context staged...
        seq = next(iter(engine.prefix.by_row.values()))
        assert bool(engine.runner.draft_cache.pending[seq.row]) == (engine is staged)  # ... kept with its row
        done = prompt + first
        follow = (done + prompt[:6], SamplingParams(max_new_tokens=30, ignore_eos=True))
        again = run(engine, [follow], [16])[:2]   # reusing it has it written first
        row = next(q.row for q in engine.prefix.by_row.values() if list(q.tokens[:seq.end]) == list(seq.tokens))
        cached = [t.clone() for t in engine.runner.draft_cache.held(row, seq.end)]
        # a running request 9 AR rounds in (the staging half full), then a prompt continuing it: its row
        # after its prefill (sharing the running row's pages, a partial one copied, and its rings)
        long = engine.submit(prompt + [7], SamplingParams(max_new_tokens=60, ignore_eos=True))
        engine.policy.forced = AR
        produced = []
        for _ in range(10):
            for _, out in engine.step():
                produced += out.token_ids
        assert max(engine.runner.draft_cache.pending) in (0, 9)
        live = engine.submit(prompt + [7] + produced + prompt[:4], SamplingParams(max_new_tokens=30))
        engine.step()
        req = engine.scheduler.find(live)
        assert req in engine.scheduler.running
        shared = [t.clone() for t in engine.runner.draft_cache.held(req.slot, req.n_ctx)]
        for request_id in (long, live):
            engine.cancel(request_id)
        engine.policy.forced = None
        results.append((cached, again, shared, engine.prefix.stats.hits))
    (cached, again, shared, hits), (want, again_eager, shared_eager, hits_eager) = results
    assert_same(cached, want)
    assert again == again_eager
    assert_same(shared, shared_eager)
    assert hits == hits_eager == 3


def test_an_evicted_sequence_leaves_no_staged_context_to_its_rows_next_request(tiny_models):
    """A cached sequence keeps its staged context until a prompt reads it; evicted, it is forgotten,
    so the row's next request never has another's positions written into its drafter context."""
    engine, _ = engines(tiny_models, tiny_models / "draft", max_running=2, prefix_cache=True)
    prompt = mixed_prompts(engine.tokenizer, chats=0, chat_seed=0, plain=1, plain_seed=7, cut=4)[0]
    run(engine, [(prompt, SamplingParams(max_new_tokens=21, ignore_eos=True))], [AR])
    seq = next(iter(engine.prefix.by_row.values()))
    assert engine.runner.draft_cache.pending[seq.row]
    engine.pool.evict(seq)
    assert not any(engine.runner.draft_cache.pending)


def test_rows_that_move_take_their_staged_context_along(tiny_models, draft):
    """Three drafting requests in AR rounds; the first finishes with context staged and the last moves
    into its row: what it staged moves with it, unwritten (a departure writes no other row's), and is
    written where its pages now are."""
    staged, eager = engines(tiny_models, draft, max_running=3)
    prompts = mixed_prompts(staged.tokenizer, chats=1, chat_seed=4, plain=2, plain_seed=6, cut=4)
    held = []
    for engine in (staged, eager):
        engine.policy.forced = AR
        ids = [engine.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
               for p, n in zip(prompts, (12, 40, 40))]
        while engine.scheduler.find(ids[0]) is not None:
            engine.step()
        assert [engine.scheduler.find(i).slot for i in ids[1:]] == [1, 0]
        assert all(engine.runner.draft_cache.pending[:2]) == (engine is staged)
        for _ in range(3):
            engine.step()
        held.append(drafter_rows(engine, ids[1:]))
    assert_same(*held)


def test_a_lone_drafting_row_runs_its_ar_rounds_ahead(tiny_models, draft):
    """Alone at budget 0, a drafting row's next step runs before this one's read, as an AR request's
    does: its drafter context there is held until that pass is committed, then staged; a tree round
    after it settles the pass and drafts from the same context, with the same tokens, as the eager
    engine (whose AR rounds write every pass as it is committed)."""
    staged, eager = engines(tiny_models, draft)
    prompt = mixed_prompts(staged.tokenizer, chats=0, chat_seed=0, plain=1, plain_seed=11, cut=4)[0]
    held, tokens = [], []
    for engine in (staged, eager):
        request_id = engine.submit(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        produced, ahead = [], 0
        for budget in [AR] * 6 + [16] * 2 + [AR] * 3:
            engine.policy.forced = budget
            produced += [t for _, out in engine.step() for t in out.token_ids]
            req = engine.scheduler.find(request_id)
            ahead += req.ahead is not None and req.ahead_context is not None
        assert ahead >= 7   # every AR round but the first after the prompt and after the trees
        engine.policy.forced = 16
        produced += [t for _, out in engine.step() for t in out.token_ids]   # settles it, then drafts
        assert req.ahead is None and req.ahead_context is None
        held.append(drafter_rows(engine, [request_id]))
        tokens.append(produced)
        engine.cancel(request_id)
    assert tokens[0] == tokens[1]
    assert_same(*held)
    greedy = run(eager, [(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True, mode="ar"))], [AR])[0][0]
    assert tokens[0] == greedy[:len(tokens[0])]   # the target's own tokens


def test_a_tree_round_after_ar_rounds_redrafts_as_a_prompts_first_draft_would(tiny_models, draft):
    """After AR rounds the drafting rows' draft comes from the rounds' own (graphed) drafter pass with
    no new context (DraftRunner.redraft), not the eager pass of a prompt's first draft: the same drafts
    are accepted round by round, and the tokens are the target's."""
    graphed, eager = engines(tiny_models, draft, max_running=2)
    runner = eager.runner

    def redraft_eagerly(reqs) -> None:  # the probe's redraft before DraftRunner.redraft
        if any(req.mode.drafts and req.drafted is None for req in reqs):
            runner._draft_prompt(reqs, [req.mode.drafts for req in reqs])
    runner._redraft = redraft_eagerly
    used = []
    redraft = graphed.runner.draft_runner.redraft
    graphed.runner.draft_runner.redraft = lambda *a: used.append(1) or redraft(*a)
    prompts = mixed_prompts(graphed.tokenizer, chats=1, chat_seed=4, plain=1, plain_seed=6, cut=4)
    jobs = [(p, SamplingParams(max_new_tokens=50, ignore_eos=True)) for p in prompts]
    for schedule in ([AR, AR, 16], [AR] * 5 + [4, AR, 16]):
        tokens, accepted, _ = run(graphed, jobs, schedule)
        assert (tokens, accepted) == run(eager, jobs, schedule)[:2]
        assert sum(map(sum, accepted)) > 0
    assert used


def test_a_prompt_chosen_by_cost_drafts_with_it_unless_its_batch_runs_ar_next(tiny_models):
    """A request whose budget the cost policy chooses drafts with its prompt, as one that set its own
    budget does, where trees are to come (nothing measured yet: the configured budget); where the batch
    it joins is predicted to run a plain AR round next, which needs no draft, it makes none with its
    prompt and its first tree round drafts it. Greedy output is the target's."""
    engine = Engine(EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft"), tree_policy="cost",
                                 max_running=2))
    prompts = mixed_prompts(engine.tokenizer, chats=1, chat_seed=4, plain=1, plain_seed=6, cut=4)

    def admitted(*budgets: int | None) -> tuple[bool, ...]:
        """Whether requests of these budgets (None: chosen by cost), admitted together, hold a draft
        after their prompts."""
        ids = [engine.submit(p, SamplingParams(max_new_tokens=30, ignore_eos=True, tree_budget=b))
               for p, b in zip(prompts, budgets)]
        while engine.scheduler.waiting or engine.scheduler.prefilling is not None:
            engine.step()
        held = tuple(engine.scheduler.find(i).drafted is not None for i in ids)
        for request_id in ids:
            engine.cancel(request_id)
        return held

    assert admitted(None, 8) == (True, True)   # no costs measured: trees come, the prompts' pass drafts
    # measured: AR 50x cheaper than any tree, and an outlook that accepts little
    engine.policy.costs = CostModel.of_table({(b, nodes): 0.002 if nodes == 1 else 0.1
                                              for b in (1, 2) for nodes in (1, 2, 5, 8, 9, 16, 17)})
    engine.policy.prior.observe((0.1,) * len(engine.policy.candidates), 0.4, 0)
    assert admitted(None) == (False,)          # an AR round is next: it waits to draft
    assert admitted(None, 8) == (True, True)   # beside a fixed tree the round is a tree: it drafts now
    passes = []
    redraft = engine.runner.draft_runner.redraft
    engine.runner.draft_runner.redraft = lambda *a: passes.append(1) or redraft(*a)
    reference = run(engine, [(p, SamplingParams(max_new_tokens=30, ignore_eos=True, mode="ar")) for p in prompts],
                    [AR])[0]
    # the prompts' step (forced AR: no draft with them), then tree rounds, the first of which drafts
    tokens, accepted, _ = run(engine, [(p, SamplingParams(max_new_tokens=30, ignore_eos=True)) for p in prompts],
                              [AR, 16, 16])
    assert tokens == reference and sum(map(sum, accepted)) > 0 and passes   # the first tree round drafted


@pytest.mark.parametrize("window, cap", [(None, None), (8, None), (8, 1)], ids=["full", "sliding", "over-cap"])
def test_a_bursts_prompt_passes_write_the_drafter_context_once(tiny_hybrid_models, tmp_path, monkeypatch,
                                                              window, cap):
    """A hybrid target prefills each prompt in a pass of its own; where their first drafts wait (the
    batch is predicted to run AR next), the passes' drafter context is held and written in one
    write_context for the step, and the drafter cache (a sliding layer's rings, the prompts' snapshot
    rings) holds what writing each pass at once leaves; greedy output is unchanged. A pass too big to
    hold (`cap`: HELD_BYTES) is written at once."""
    if cap is not None:
        monkeypatch.setattr("ddtree_runtime.engine.draft_cache.HELD_BYTES", cap)
    from ddtree_devtools.tiny import relaid_drafter
    draft = tiny_hybrid_models / "draft" if window is None else relaid_drafter(
        tiny_hybrid_models / "draft", tmp_path / "draft", window)
    made = [Engine(EngineConfig(str(tiny_hybrid_models / "target"), str(draft), tree_policy="cost", max_running=4))
            for _ in range(2)]
    for engine in made:   # measured: AR far cheaper than any tree, an outlook that accepts little
        engine.policy.costs = CostModel.of_table({(b, nodes): 0.002 if nodes == 1 else 0.1
                                                  for b in (1, 2, 4) for nodes in (1, 2, 5, 8, 9, 16, 17)})
        engine.policy.prior.observe((0.1,) * len(engine.policy.candidates), 0.4, 0)
    reference = made[1].runner.draft_cache
    reference.hold = lambda first, feats, slots, points: reference.write(
        feats, slots, reference.rows(first, first + feats.shape[0]).until(points))   # each pass at once
    prompts = mixed_prompts(made[0].tokenizer, chats=2, chat_seed=7, plain=2, plain_seed=8, cut=4)
    counted = [writes(engine) for engine in made]
    held, ids = [], []
    for engine in made:
        ids.append([engine.submit(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts])
        engine.step()                                      # the four prompts, a pass each
        assert len(engine.scheduler.running) == 4 and all(r.drafted is None for r in engine.scheduler.running)
        held.append(drafter_rows(engine, ids[-1]))
    assert (len(counted[0]), len(counted[1])) == (1 if cap is None else 4, 4)   # one write for four passes
    assert_same(held[0], held[1])
    outputs = []
    for engine, request_ids in zip(made, ids):
        tokens = {i: [] for i in request_ids}
        engine.policy.forced = 16                          # trees now: each row drafts from that context
        while engine.has_work:
            for i, out in engine.step():
                tokens[i] += out.token_ids
        outputs.append([tokens[i] for i in request_ids])
    assert outputs[0] == outputs[1]

"""The tree budget chosen by cost (engine/policy.py): the choice as a pure function of round costs and
expected acceptance (the best predicted tokens/s, never below plain AR's, within the caps), the
drafter's forecast (forecast.py), the calibration, and, on the tiny pairs, that budgets chosen round by
round (plain AR rounds among tree rounds) change no output: greedy equals the target's own decode and
seeded sampling is the same batched as alone."""

from __future__ import annotations

import importlib.util
import math
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine.forecast import MILLI, forecast_accepted
from ddtree_runtime.engine.costs import SWEEP_PROMPT, CostModel, RoundCosts
from ddtree_runtime.engine.policy import (PROBE_GAP, PROBE_SHARE, PROBE_WITHIN, AR, Acceptance, BudgetPolicy,
                                         best_budget, candidate_budgets)
from ddtree_runtime.engine.runner import tree_bucket
from ddtree_runtime.engine.types import BatchStats
from ddtree_runtime.engine.tree import scored_trees
from ddtree_devtools.engine_runs import serve
from ddtree_devtools.tiny_corpus import mixed_prompts

CANDIDATES = (1, 4, 8, 16)


def costs(batch: int, ms: dict[int, float]) -> RoundCosts:
    """A cost table for one batch bucket: tree bucket (1: AR) -> milliseconds. The buckets of 2^k nodes
    cost what the 2^k + 1 above them do where not given (as if the last node cost nothing)."""
    ms = {**{n - 1: ms[n] for n in (9, 17) if n in ms}, **ms}
    return RoundCosts({(batch, nodes): t / 1e3 for nodes, t in ms.items()})


def forecast(*at: float) -> tuple[float, ...]:
    """A drafter's forecast at budgets 1, 4, 8 and 16 (and, as given, the row's own budget), spread over
    the candidates (1, 4, 7, 8, 15, 16): 7 and 15 a little below 8 and 16 (their last node's share)."""
    return (at[0], at[1], 0.95 * at[2], *at[2:3], 0.97 * at[3], *at[3:])


FLAT = {1: 10, 2: 11, 5: 11, 9: 11, 17: 11}        # a lone round on a GPU: trees almost free
STEEP = {1: 10, 2: 14, 5: 20, 9: 30, 17: 60}       # a big batch: verify grows with the nodes


def test_candidates_are_full_buckets_below_the_cap_and_the_cap():
    assert candidate_budgets(16) == (1, 4, 7, 8, 15, 16)
    assert candidate_budgets(12) == (1, 4, 7, 8, 12)
    assert candidate_budgets(1) == (1,)


def test_a_tree_of_2k_nodes_wins_where_its_last_node_is_worth_less():
    """A round of 16-node trees (budget 15, its own bucket) costs 9% less than one of 17 nodes at 16 rows
    on the GPU (more than one node's share): it is chosen where the 16th draft node adds little."""
    candidates = candidate_budgets(16)
    # the 27B's warm-up sweep at 16 rows on an H100 (ms; docs/performance.md, session 27)
    table = {1: 25.08, 2: 27.59, 5: 28.68, 8: 29.75, 9: 30.37, 16: 32.68, 17: 35.76}
    tapering = [[0.9, 2.6, 3.1, 3.3, 4.6, 4.62]] * 16   # the 16th node adds 0.02 tokens
    chosen = best_budget(costs(16, table), 16, tapering, [100] * 16, candidates)
    assert chosen.budget == 15 and chosen.rate == pytest.approx(16 * 5.6 / 0.03268)
    steep = [[0.9, 2.6, 3.1, 3.3, 4.6, 6.5]] * 16       # ... or 1.9: worth its 3.1 ms
    assert best_budget(costs(16, table), 16, steep, [100] * 16, candidates).budget == 16


def test_the_choice_follows_acceptance_and_cost():
    high = [[0.9, 3.0, 5.0, 7.0]] * 4    # a drafter that is mostly right
    none = [[0.0, 0.0, 0.0, 0.0]] * 4
    left = [100] * 4
    assert best_budget(costs(4, FLAT), 4, high, left, CANDIDATES).budget == 16
    assert best_budget(costs(4, FLAT), 4, none, left, CANDIDATES).budget == AR
    middle = best_budget(costs(4, STEEP), 4, high, left, CANDIDATES)
    assert middle.budget == 8  # 4 x 6 tokens / 30 ms beats 8 / 60 ms and 4 / 20 ms
    assert middle.rate == pytest.approx(4 * 6 / 0.030)


def test_the_choice_is_never_below_ar_and_is_the_best_predicted():
    rng = random.Random(0)
    for _ in range(200):
        batch = rng.choice([1, 2, 4, 8])
        table = {1: rng.uniform(5, 20)}
        for nodes in (2, 5, 9, 17):
            table[nodes] = table[1] * rng.uniform(1.0, 4.0)
        expected = [sorted(rng.uniform(0, 8) for _ in CANDIDATES) for _ in range(batch)]
        left = [rng.randint(1, 20) for _ in range(batch)]
        choice = best_budget(costs(batch, table), batch, expected, left, CANDIDATES)
        assert choice.rate >= choice.rates[AR]
        assert choice.rate == max(choice.rates.values())
        k = CANDIDATES.index(choice.budget) if choice.budget else None
        tokens = sum(min(1 + (e[k] if k is not None else 0), n) for e, n in zip(expected, left))
        nodes = 1 if choice.budget == AR else {1: 2, 4: 5, 8: 9, 16: 17}[choice.budget]
        assert choice.rate == pytest.approx(tokens / (table[nodes] / 1e3))


def test_caps_and_fixed_rows_bound_the_choice():
    high, left = [[0.9, 3.0, 5.0, 7.0]] * 4, [100] * 4
    # --round-nodes: 4 rows x 9 nodes at most
    assert best_budget(costs(4, FLAT), 4, high, left, CANDIDATES, node_cap=36).budget == 8
    # a fixed row's 17-node tree pads the round: no smaller bucket, and no AR
    padded = best_budget(costs(4, FLAT), 4, [[0.0] * 4] * 3, [100] * 3, CANDIDATES, floor_nodes=17)
    assert AR not in padded.rates and padded.budget == 16
    assert best_budget(costs(4, FLAT), 4, high, left, CANDIDATES, ar=False).budget == 16
    # tokens a request may still emit: one left each, so nothing beats AR
    assert best_budget(costs(4, FLAT), 4, high, [1] * 4, CANDIDATES).budget == AR
    # drafting again after AR rounds costs a drafter pass: a small gain does not pay for it
    small = [[0.05, 0.1, 0.1, 0.1]] * 4
    assert best_budget(costs(4, FLAT), 4, small, left, CANDIDATES).budget != AR
    assert best_budget(costs(4, FLAT), 4, small, left, CANDIDATES, refresh=0.005).budget == AR
    # ... a real one does, spread over the tree rounds it serves (8 at most), not where 2 tokens are left
    mid = [[0.3, 0.5, 0.5, 0.5]] * 4
    assert best_budget(costs(4, FLAT), 4, mid, left, CANDIDATES, refresh=0.010).budget == 16
    assert best_budget(costs(4, FLAT), 4, mid, [2] * 4, CANDIDATES, refresh=0.010).budget == AR
    assert best_budget(costs(8, FLAT), 4, high, left, CANDIDATES) is None  # this batch is not measured


def test_a_bigger_round_never_costs_less():
    measured = CostModel.of_table({(1, 1): 0.010, (1, 2): 0.030, (1, 5): 0.020, (2, 1): 0.009, (2, 2): 0.025,
                                   (2, 5): 0.040})
    assert measured.at(1, 0, 0).seconds == {(1, 1): 0.009, (1, 2): 0.020, (1, 5): 0.020}
    assert measured.at(2, 0, 0).seconds == {(2, 1): 0.009, (2, 2): 0.025, (2, 5): 0.040}


def test_calibration_scales_the_forecast_to_what_was_accepted():
    prior, req = Acceptance(), Acceptance()
    assert req.expected(prior) is None  # nothing forecast anywhere yet
    for _ in range(30):
        req.observe(forecast(1.0, 4.0, 6.0, 8.0), 6.0, 3)   # accepts half of what its drafter forecasts
    assert req.expected(prior) == pytest.approx(forecast(0.5, 2.0, 3.0, 4.0), rel=0.1)  # (the prior weighs a little)
    prior.observe(forecast(1.0, 2.0, 2.0, 2.0), 2.0, 2)
    assert Acceptance().expected(prior) == pytest.approx(forecast(1.0, 2.0, 2.0, 2.0))  # a newcomer: everyone's


def test_a_newcomer_starts_from_a_typical_request_not_the_last_row():
    """The engine-wide outlook is the round's rows' mean curve (blended over rounds): one row stuck on
    hard text at the end of a batch must not open the next batch with AR rounds."""
    policy = BudgetPolicy(by_cost=True, cap=16, slots=8, block_size=16, round_nodes=None)
    reqs = [_Req("ddtree", 16) for _ in range(4)]
    easy, hard = forecast(1.0, 4.0, 7.0, 12.0, 12.0), forecast(0.5, 1.0, 1.0, 1.0, 1.0)
    for _ in range(10):   # rounds of three easy rows and, last, a hard one
        policy.observe(reqs, [16] * 4, [((), 12, None)] * 3 + [((), 1, None)], [easy] * 3 + [hard])
    newcomer = Acceptance().expected(policy.prior)
    assert newcomer[-1] == pytest.approx(0.75 * 12.0 + 0.25 * 1.0, rel=0.05)   # each accepts what it forecast
    assert reqs[3].acceptance.expected(policy.prior)[-1] < 2 < 8 < newcomer[-1]   # the hard row keeps its own


def test_a_low_forecast_ages_toward_the_outlook_over_ar_rounds():
    """AR rounds forecast nothing: a row's last forecast (of a tree that failed on a hard token) ages
    toward the engine-wide outlook each AR round, so a tree round looks again after a few of them."""
    policy = BudgetPolicy(by_cost=True, cap=16, slots=8, block_size=16, round_nodes=None)
    reqs = [_Req("ddtree", 16) for _ in range(2)]
    trees = [forecast(1.0, 4.0, 7.0, 12.0, 12.0), forecast(0.5, 1.0, 1.0, 1.0, 1.0)]   # an easy row's, a stuck one's
    policy.observe(reqs, [16, 16], [((), 12, None), ((), 1, None)], trees)
    stuck = reqs[1].acceptance
    before = stuck.expected(policy.prior)[-1]
    seen = []
    for _ in range(3):
        policy.observe(reqs, [AR, AR], [((), 0, None)] * 2, [None, None])
        seen.append(stuck.expected(policy.prior)[-1])
    assert before < seen[0] < seen[1] < seen[2] < policy.prior.curve[-1] * 1.2
    assert seen[2] > 3 * before   # three AR rounds: half-way to the outlook
    policy.observe(reqs, [16, 16], [((), 12, None), ((), 1, None)], trees)
    assert stuck.expected(policy.prior)[-1] < 2     # a tree round's own forecast replaces it


def test_a_low_calibration_ages_toward_the_outlook_over_ar_rounds():
    """A row whose trees accepted a fifth of what its drafter forecast (hard text) is not held to that
    over AR rounds: its calibration ages toward the engine-wide one as its forecast does, so the row
    that found easy text again after a few AR rounds is not kept from trees by its old rounds."""
    policy = BudgetPolicy(by_cost=True, cap=16, slots=8, block_size=16, round_nodes=None)
    reqs = [_Req("ddtree", 16) for _ in range(2)]
    curve = forecast(1.0, 4.0, 7.0, 12.0, 12.0)
    for _ in range(6):   # the same forecast for both; the second row accepts a fifth of it
        policy.observe(reqs, [16, 16], [((), 12, None), ((), 2, None)], [curve, curve])
    hard = reqs[1].acceptance
    assert hard.scale() < 0.25 < 0.5 < policy.prior.scale()
    seen = [hard.expected(policy.prior)[-1]]
    for rounds in (4, 4, 24):
        for _ in range(rounds):
            policy.observe(reqs, [AR, AR], [((), 0, None)] * 2, [None, None])
        seen.append(hard.expected(policy.prior)[-1])
    assert seen[0] < seen[1] < seen[2] < seen[3]
    assert seen[3] == pytest.approx(Acceptance().expected(policy.prior)[-1], rel=0.05)   # a newcomer's
    policy.observe(reqs, [16, 16], [((), 12, None), ((), 2, None)], [curve, curve])
    assert hard.expected(policy.prior)[-1] < 0.5 * seen[3]        # its own tree counts again


@pytest.mark.parametrize("depth, budget, sharp", [(3, 6, 3.0), (15, 16, 12.0)])
def test_forecast_is_the_sum_of_path_probabilities_of_the_first_nodes(depth, budget, sharp):
    """From the build's own path scores, checked against each node's log-prob summed up its path; sharp
    drafts at depth 15 make deep paths (the drafter's whole block)."""
    torch.manual_seed(0)
    drafts = torch.randn(2, depth, 7) * sharp             # 2 drafts, depths 1..depth, 7 tokens
    nodes, scores = scored_trees(drafts, budget)          # [2, 3, budget] best first; the levels' scores
    budgets = [1, budget // 2, budget]
    got = forecast_accepted(scores, budget, budgets)
    logp = torch.log_softmax(drafts, dim=-1)
    deepest = 0
    for r in range(2):
        tokens, parents, depths = nodes[r].tolist()
        deepest = max(deepest, *depths)
        score = [0.0] * (budget + 1)
        for j in range(budget):                           # parents come first
            score[j + 1] = score[parents[j]] + logp[r, depths[j] - 1, tokens[j]].item()
        probs = [math.exp(s) for s in score[1:]]
        assert probs == sorted(probs, reverse=True)       # best first: a prefix is the smaller tree
        want = [round(MILLI * sum(probs[:b])) for b in budgets]
        assert got[r].tolist() == pytest.approx(want, abs=1)
    assert deepest >= min(depth, 9)                       # the deep case reaches past 8 levels


class _Req:
    """What the policy reads of a request."""

    def __init__(self, mode: str, budget: int, own: int | None = None, drafts: bool = True) -> None:
        from ddtree_runtime.engine.modes import mode_named
        self.mode, self.budget = mode_named(mode), budget
        self.params = SamplingParams(max_new_tokens=100, tree_budget=own)
        self.generated, self.drafted, self.acceptance, self.n_ctx = 0, object(), Acceptance(), 10


def test_the_policy_gives_chosen_rows_the_round_budget_and_leaves_the_others_theirs():
    policy = BudgetPolicy(by_cost=True, cap=16, slots=4, block_size=16, round_nodes=None)
    reqs = [_Req("ddtree", 16), _Req("ddtree", 4, own=4), _Req("ar", 16), _Req("ddtree", 8)]
    assert policy.budgets(reqs) == [16, 4, 16, 8]         # no costs measured yet: each its own
    policy.costs = CostModel.of_table(costs(4, STEEP).seconds)
    for r in reqs:
        r.acceptance.observe(forecast(0.0, 0.0, 0.0, 0.0), 1.0, 0)
    # nothing is accepted, but the row that asked for 4 keeps its tree: no AR, the bucket it pads to
    assert policy.budgets(reqs) == [4, 4, 16, 4]
    alone = [reqs[0], reqs[2], reqs[3]]
    assert policy.budgets(alone) == [AR, 16, AR]          # an AR request's budget is unused
    policy.costs = CostModel.of_table({**costs(4, FLAT).seconds, (4, 1): 0.1})
    for r in alone:
        r.acceptance = Acceptance()
        r.acceptance.observe(forecast(0.9, 3.0, 5.0, 7.0), 7.0, 7)
    assert policy.budgets(alone) == [16, 16, 8]            # the one capped at 8 gets 8


def losing_drafter() -> tuple[BudgetPolicy, list[_Req]]:
    """Two rows whose drafter has accepted nothing, under round costs where AR wins."""
    policy = BudgetPolicy(by_cost=True, cap=16, slots=2, block_size=16, round_nodes=None)
    policy.costs = CostModel.of_table(costs(2, STEEP).seconds)
    reqs = [_Req("ddtree", 16), _Req("ddtree", 16)]
    for r in reqs:
        r.acceptance.observe(forecast(0.0, 0.0, 0.0, 0.0), 1.0, 0)
    return policy, reqs


def test_after_ar_rounds_a_tree_round_looks_again():
    """A probe (a 2-node tree, 14 ms, after the drafter pass back, 4 ms) gives what two AR rounds of
    10 ms give: 8 ms beyond them, which PROBE_SHARE of the AR rounds between probes must cover (27
    rounds); past that, the spacing doubles at each probe, up to PROBE_LAST."""
    policy, reqs = losing_drafter()
    chosen = [policy.budgets(reqs)[0] for _ in range(600)]
    probes = [i for i, b in enumerate(chosen) if b != AR]
    assert math.ceil(0.008 / (PROBE_SHARE * 0.010)) == 27
    assert probes == [26, 53, 80, 107, 139, 203, 331, 459, 587]   # 27 apart, then 32, 64, 128, 128


def test_while_ar_wins_only_its_probes_time_the_trees_again():
    """Alone, nothing accepted, trees within PROBE_WITHIN of AR (a lone GPU round: 11 ms against 10):
    no tree round runs only to be timed again; the AR rounds' probes do it, a second round where the
    tree's last timing is PROBE_AGE old (the first pays the drafter's catch-up and is not timed). On the
    H100 the near trees' own re-timings had cost 2% of such a request's time."""
    policy = BudgetPolicy(by_cost=True, cap=16, slots=1, block_size=16, round_nodes=None, learning=True)
    ms = {**FLAT, 8: 11, 16: 11}
    policy.costs = CostModel.of_table(costs(1, ms).seconds)
    reqs = [_Req("ddtree", 16)]
    reqs[0].acceptance.observe(forecast(0.0, 0.0, 0.0, 0.0), 1.0, 0)
    trees = []
    for i in range(600):
        budgets = policy.budgets(reqs)
        if budgets[0] != AR:
            trees.append(i)
        policy.record(reqs, budgets, BatchStats())
        policy.timed(ms[1 if budgets[0] == AR else tree_bucket(budgets[0] + 1)] / 1e3)
    assert policy.last.rates[4] >= PROBE_WITHIN * policy.last.rates[AR]     # the trees are near
    # the probes' spacing doubles from 8 to 128; pairs at the first and where the tree's timing is
    # 256 rounds old (7 -> 390); 262 is one round short of that
    assert trees == [6, 7, 14, 22, 38, 70, 134, 262, 390, 391, 519]


# ---- on the tiny pairs ---------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def models(request):
    return request.getfixturevalue("tiny_models" if request.param == "qwen3" else "tiny_hybrid_models")


def _alternating(engine: Engine) -> None:
    """Costs that make the choice swing: AR cheap, trees cheap only while acceptance holds up."""
    table = {}
    for batch in (1, 2, 4):
        table.update(costs(batch, {1: 10, 2: 40, 5: 40, 9: 41, 17: 42}).seconds)
    engine.policy.costs = CostModel.of_table(table)
    engine.policy.learning = False  # the table stays what it is


def test_budgets_chosen_by_cost_change_no_output(models):
    engine = Engine(EngineConfig(str(models / "target"), str(models / "draft"), max_running=4, page_size=8,
                                 tree_policy="cost"))
    _alternating(engine)
    prompts = mixed_prompts(engine.tokenizer, chats=2, chat_seed=3, plain=2, plain_seed=5, cut=4)
    greedy = [(p, SamplingParams(max_new_tokens=40)) for p in prompts]
    reference = serve(engine, [(p, SamplingParams(max_new_tokens=40, mode="ar")) for p in prompts])
    chosen = set()
    watch = lambda e: chosen.add(e.stats.round_budget)  # noqa: E731
    assert serve(engine, greedy, watch) == reference                    # batched
    assert [serve(engine, [job])[0] for job in greedy] == reference     # alone
    assert AR in chosen and chosen - {AR}                               # both kinds of round ran
    seeded = [(p, SamplingParams(max_new_tokens=30, temperature=0.9, seed=11 + i)) for i, p in enumerate(prompts)]
    assert serve(engine, seeded) == [serve(engine, [job])[0] for job in seeded]


def test_the_drafter_context_stays_whole_through_ar_rounds(tiny_models):
    """A request forced to AR rounds and back drafts as well afterwards as one that never left trees
    (its drafter context was written by the AR rounds; without it, the trained drafter's acceptance
    falls)."""
    engine = Engine(EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft"), max_running=1,
                                 tree_policy="cost"))
    prompt = mixed_prompts(engine.tokenizer, chats=0, chat_seed=0, plain=1, plain_seed=7, cut=4)[0]
    params = SamplingParams(max_new_tokens=120, ignore_eos=True)

    def accepted_after(schedule: list[int]) -> list[int]:
        engine.submit(prompt, params)
        accepted = []
        for budget in schedule:
            engine.policy.forced = budget
            for _, out in engine.step():
                if budget:
                    accepted.append(out.accepted)
        engine.policy.forced = None
        while engine.has_work:
            engine.step()
        return accepted

    trees = accepted_after([16] * 8)
    mixed = accepted_after([16] + [AR] * 24 + [16] * 4)
    assert sum(mixed[1:]) >= 0.6 * sum(trees[1:5]) > 0


def test_rounds_run_under_a_phase_hook_are_not_learnt(tiny_models):
    """A benchmark's phase hook syncs at every phase boundary, stretching the round (2-3 ms of 20 at 8
    running on the H200): those rounds would teach the cost model a slower round than serving runs."""
    engine = Engine(EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft"), max_running=2,
                                 tree_policy="cost"))
    prompt = mixed_prompts(engine.tokenizer, chats=0, chat_seed=0, plain=1, plain_seed=7, cut=4)[0]
    for _ in range(2):
        engine.submit(prompt, SamplingParams(max_new_tokens=200, ignore_eos=True))
    while engine.scheduler.waiting or engine.scheduler.prefilling is not None:
        engine.step()
    learnt = lambda: sum(len(w) for w in engine.policy.costs.samples.values())  # noqa: E731
    engine.phase_hook = lambda phase: None
    for _ in range(3):
        engine.step()
    assert learnt() == 0
    engine.phase_hook = None
    for _ in range(3):
        engine.step()
    assert learnt() == 3        # the same rounds without the hook


# ---- batch_bench's steady window ----------------------------------------------------------------------

class _SteadyEngine:
    """What batch_bench.steady_rounds drives: rounds of `round_s`, one of which (the `first`-th step)
    runs a shape for the first time and captures its graph, `capture_s` more."""

    def __init__(self, rows: int, round_s: float, first: int, capture_s: float) -> None:
        self.device, self.phase_hook, self.steps = torch.device("cpu"), None, 0
        self.round_s, self.first, self.capture_s = round_s, first, capture_s
        self.scheduler = SimpleNamespace(waiting=[], prefilling=None, running=[])
        self.stats = BatchStats(graph_captures=0, batch_size=rows, tree_nodes=rows)

    def submit(self, prompt: list[int], params: SamplingParams) -> int:
        self.scheduler.running.append(prompt)
        return len(self.scheduler.running) - 1

    def step(self) -> list:
        self.steps += 1
        hook = self.phase_hook or (lambda phase: None)
        hook("verify")
        time.sleep(self.round_s)
        self.stats.round_budget = 4 if self.steps >= self.first else 0
        if self.steps == self.first:
            self.stats.graph_captures += 1
            hook("draft")
            time.sleep(self.capture_s)
        hook("end")
        return [(i, SimpleNamespace(token_ids=[1])) for i in range(len(self.scheduler.running))]

    def cancel(self, request_id: int) -> None:
        pass


def _bench(name: str):
    """A module of runtime/bench (not a package: its scripts import each other by name)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[2] / "runtime" / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_steady_window_leaves_out_a_shape_run_first_and_phases_add_up():
    """On the H200 the cost case's probe met its first 8 x 2-node round (a graph captured, kernels
    compiled: 460 ms) inside the 10 timed rounds: 80 ms a round against AR's 20. The fixed cases ran
    theirs in the warm-up rounds, so that window is timed again; and a phase only one round in five runs
    (a probe's draft) is not the typical round's."""
    batch_bench, timer = _bench("batch_bench"), _bench("gpu_bench").PhaseTimer
    params, cpu = SamplingParams(max_new_tokens=100), torch.device("cpu")
    engine = _SteadyEngine(rows=2, round_s=0.002, first=6, capture_s=0.2)   # step 6: in the first window
    got = batch_bench.steady_rounds(engine, [[1], [2]], params, rounds=5, warmup=2, timer=timer(cpu))
    assert got["round_ms"] < 20 and got["windows"] == 2 and got["window_captures"] == 0
    # each timed round of the window kept, in order: its wall ms and the tokens it emitted (one a row)
    assert len(got["round_trace"]) == 5 and all(2 <= ms < 100 and out == 2 for ms, out in got["round_trace"])
    assert got["by_budget"]["budget_4"] | {"mean_ms": 0, "median_ms": 0} == {"steps": 5, "tokens": 10, "mean_ms": 0,
                                                                           "median_ms": 0}
    engine = _SteadyEngine(rows=2, round_s=0.002, first=10, capture_s=0.01)  # step 10: in the phase rounds
    got = batch_bench.steady_rounds(engine, [[1], [2]], params, rounds=5, warmup=2, timer=timer(cpu))
    assert got["windows"] == 1 and got["phases_ms"]["draft"] == 0 and 2 <= got["phases_ms"]["verify"] < 10
    # by budget, a rare phase shows where its rounds ran (the fake's budgets: 0, then 4 from step 10 on)
    # (the draft's 10 ms in one of its three rounds), not in the median round
    rounds = got["phases_by_budget"]
    assert rounds["budget_0"]["steps"] == 2 and rounds["budget_4"]["steps"] == 3
    assert rounds["budget_0"]["draft"] == 0 and 10 / 3 <= rounds["budget_4"]["draft"] < 6


# ---- the cost model (costs.py), on injected timings -------------------------------------------------

def test_the_cost_model_follows_the_rounds_and_ignores_outliers():
    model = CostModel.of_table({(4, 1): 0.010, (4, 17): 0.040})    # the sweep's figures
    for i in range(20):                                           # serving: the tree round costs 20 ms
        model.observe(4, 17, 0.200 if i % 5 == 0 else 0.020, 0, 0)  # a stalled round in five
    assert model.at(4, 0, 0).of(4, 17) == pytest.approx(0.020)
    assert model.at(4, 0, 0).of(4, 1) == pytest.approx(0.010)     # untimed since: as measured
    assert model.at(8, 0, 0).seconds == {}                         # never timed at 8 rows


def test_the_cost_model_fits_the_context_term_within_each_shape():
    model = CostModel()
    # AR: 5 ms + 1 us per row x node x key; a tree of 17: 20 ms + the same; contexts 100..900
    for step in range(16):
        for nodes, base in ((1, 0.005), (17, 0.020)):
            longest = 100 + 50 * step
            model.observe(2, nodes, base + 1e-6 * 2 * nodes * longest, longest, 2 * longest)
    model.fit()
    assert model.a == pytest.approx(1e-6, rel=0.01) and model.c == pytest.approx(0, abs=1e-9)
    # at a context no round had, each shape by its own base and the fitted term
    assert model.at(2, 2000, 4000).of(2, 17) == pytest.approx(0.020 + 1e-6 * 2 * 17 * 2000, rel=0.01)
    assert model.at(2, 2000, 4000).of(2, 1) == pytest.approx(0.005 + 1e-6 * 2 * 2000, rel=0.01)


def test_on_the_cpu_the_context_costs_the_dense_term_alone():
    """The CPU computes attention densely: a tree round's context costs a per row x node x key. With AR
    rounds timed at about one context (they add nothing to the fit), the tree rounds alone hardly tell a
    from c (within a shape the two features move together), and on noisy times the joint fit can take
    c, which every AR round then pays: less of it at a short context than at the one it was timed at, so
    it is predicted cheaper than any AR round ran (the hybrid tiny pair: 2.4-3.7 ms for 6-7). On the CPU
    the model fits a alone (the times below as the tiny pair's at 16 rows, 1% noise and more)."""
    for dense in (False, True):
        rng = random.Random(4)
        model = CostModel(dense)
        for step in range(16):
            context = 110 + step % 4
            model.observe(16, 1, 0.006 + rng.uniform(0, 0.0015), context, 16 * context - rng.randint(0, 200))
            longest = 40 + 8 * step
            model.observe(16, 17, 0.026 + 1e-8 * 16 * 17 * longest + rng.uniform(0, 0.004), longest,
                          16 * longest - rng.randint(0, 300))
        model.fit()
        ar = model.at(16, 30, 400).of(16, 1)   # a batch's first rounds: short contexts
        if dense:
            assert model.c == 0 and 0.006 <= ar <= 0.0075
        else:
            assert model.c > 0 and ar < 0.006


def test_noise_fits_no_context_term_beyond_the_costs():
    model = CostModel()
    rng = random.Random(1)
    for _ in range(16):  # cost does not follow the context at all: a slope, if any, is small and bounded
        model.observe(1, 1, rng.uniform(0.004, 0.006), rng.randint(10, 20), 15)
    model.fit()
    assert 0.0035 <= model.at(1, 15, 15).of(1, 1) <= 0.0065
    assert model.at(1, 1, 1).of(1, 1) > 0


# warm-up round costs (ms) of the 27B on an H200 by rows and tree nodes, at about 64 tokens of context
H200_WARM_UP = {(1, 1): 16.50, (1, 2): 18.21, (1, 5): 18.37, (1, 9): 18.37, (1, 17): 19.92,
                (2, 1): 16.81, (2, 2): 18.77, (2, 5): 18.89, (2, 9): 18.96, (2, 17): 21.04,
                (4, 1): 17.43, (4, 2): 19.68, (4, 5): 19.94, (4, 9): 20.56, (4, 17): 23.11,
                (8, 1): 18.28, (8, 2): 21.06, (8, 5): 21.98, (8, 9): 22.91, (8, 17): 27.57,
                (16, 1): 20.68, (16, 2): 24.48, (16, 5): 26.25, (16, 9): 28.03, (16, 17): 39.82}
# its rounds served at about 4.1K tokens: AR and ddtree@16 as measured; 2 nodes a row (not measured there)
# as the warm-up's plus what the AR round grew by
H200_SERVED = {(1, 1): 16.1, (8, 1): 19.5, (16, 1): 22.1, (1, 17): 20.7, (8, 17): 30.2, (16, 17): 44.8,
               (1, 2): 17.8, (8, 2): 22.3, (16, 2): 25.9}


def _h200_costs(served: list[int]) -> CostModel:
    """The cost model after the H200's warm-up sweep and serving rounds at 4.1K tokens: 20 rounds of each
    batch in `served` at 17 nodes (ddtree@16), then 20 chosen by cost (AR, a 2-node probe in 8), each
    case's rounds 1% slower by its end (a GPU warming up: the traced AR rounds of 8 rows went 19.6 to
    19.9 ms)."""
    model = CostModel()
    for batch in (1, 2, 4, 8, 16):  # the sweep: the budgets in turn, one uncounted cycle, a token a round
        context = SWEEP_PROMPT
        for cycle in range(5):
            for nodes in (1, 1, 17, 2, 5, 9, 17):
                context += 1
                if cycle:
                    model.observe(batch, nodes, H200_WARM_UP[(batch, nodes)] / 1e3, context, batch * context)
    model.fit()
    cases = [(batch, lambda i: 17) for batch in served] + [(batch, lambda i: 2 if i % 8 == 7 else 1)
                                                           for batch in (1, 8, 16)]
    for batch, nodes_of in cases:
        for i in range(20):
            context, nodes = 4096 + i, nodes_of(i)
            model.observe(batch, nodes, (1 + 0.01 * i / 20) * H200_SERVED[(batch, nodes)] / 1e3, context,
                          batch * context)
    model.fit()
    return model


def test_a_drift_over_a_few_tokens_reads_as_no_context_term():
    """The H200's table after serving at 4K. With the context term fitted from each shape's last rounds
    alone (a few tokens apart), the 1% drift read as 14 ns a row x node x key: the 16 x 17 round at 64
    tokens was predicted 30 ms (40 measured), and the envelope lowered 8 x 17 there to 23 ms (27.6); a
    round not served at 4K (8 x 17, left out of a second run: 30.2 ms measured) was predicted 35 ms.
    Fitted across the warm-up's and serving's contexts, the served shapes keep their times, the table
    at the warm-up's context stays the warm-up's, and the left-out shape is predicted as measured."""
    model = _h200_costs(served=[1, 8, 16])
    long = 4100
    for (batch, nodes), ms in H200_SERVED.items():
        assert 1e3 * model.at(batch, long, batch * long).of(batch, nodes) == pytest.approx(ms, rel=0.03)
    at_warm_up = model.snapshot().seconds
    for shape, ms in H200_WARM_UP.items():
        assert 1e3 * at_warm_up[shape] == pytest.approx(ms, rel=0.1)
    for costs_16 in (model.at(16, long, 16 * long), model.at(16, SWEEP_PROMPT, 16 * SWEEP_PROMPT)):
        assert costs_16.of(16, 17) > 1.5 * costs_16.of(16, 1)
    left_out = _h200_costs(served=[1, 16])
    assert 1e3 * left_out.at(8, long, 8 * long).of(8, 17) == pytest.approx(30.2, rel=0.1)


def test_a_shape_held_at_its_floor_lowers_no_other():
    """The envelope copies a bigger round's cost to a smaller one only where the fit explains it: a
    shape whose base the context term pushes to its floor (predicted 2 ms at no context) lowers none."""
    model = CostModel()
    for _ in range(8):  # a row's AR round: 10 ms and 1 us a key, at 100 and 1000 tokens
        for context in (100, 1000):
            model.observe(1, 1, 0.010 + 1e-6 * context, context, context)
    for i in range(16):  # 2 rows x 17 nodes, only at 1000 tokens: far cheaper than that term says
        model.observe(2, 17, 0.030 if i % 2 else 0.020, 1000, 2000)
    model.observe(2, 1, 0.010, 1000, 2000)
    model.fit()
    assert model.at(2, 0, 0).of(2, 17) == pytest.approx(0.002)
    assert model.at(2, 0, 0).of(2, 1) > 0.008


def test_rounds_are_timed_only_when_they_are_the_whole_step():
    policy = BudgetPolicy(by_cost=True, cap=16, slots=2, block_size=16, round_nodes=None, learning=True)
    reqs = [_Req("ddtree", 16), _Req("ddtree", 16)]
    policy.budgets(reqs)
    policy.timed(0.030)                 # a tree round of 2 rows, 17 nodes
    policy.budgets(reqs)
    policy.timed(None)                  # a step with a prompt piece: not a round's time
    policy.forced = AR
    policy.budgets(reqs)
    policy.timed(0.500)                 # the first AR round after trees (on CUDA it waits for their draft)
    policy.budgets(reqs)
    policy.timed(0.010)
    assert {k: [s.seconds for s in w] for k, w in policy.costs.samples.items()} == {(2, 17): [0.030],
                                                                                     (2, 1): [0.010]}
    for r in reqs:
        r.drafted = None                # after AR rounds a tree round drafts first: not counted either
    policy.forced = 16
    policy.budgets(reqs)
    policy.timed(0.070)
    assert [s.seconds for s in policy.costs.samples[(2, 17)]] == [0.030]


@pytest.mark.parametrize("accepted, next_tree", [(0, 203), (3, 203), (15, 176)])
def test_only_a_tree_that_gains_brings_the_probes_close_again(accepted, next_tree):
    """Probes space out while AR wins (27 rounds apart, what they cost allows, then doubling: 139, then
    203); a tree round that accepts nothing, or less than would beat AR at these costs (3 a row: 4
    tokens in 60 ms against AR's 1 in 10), leaves that spacing; one that gains more (15 a row) starts it
    again (27 AR rounds on)."""
    policy, reqs = losing_drafter()
    chosen = [policy.budgets(reqs)[0] for _ in range(150)]
    assert [i for i, b in enumerate(chosen) if b != AR] == [26, 53, 80, 107, 139]
    budgets = [16, 16]                                   # a tree round chosen at round 149 (say), its outcome:
    policy.observe(reqs, budgets, [([1] * (1 + accepted), accepted, None)] * 2, [forecast(0.0, 0.0, 0.0, 0.0, 0.0)] * 2)
    for r in reqs:                                       # its forecasts still say AR wins
        r.acceptance = Acceptance()
        r.acceptance.observe(forecast(0.0, 0.0, 0.0, 0.0), 1.0, 0)
    later = [policy.budgets(reqs)[0] for _ in range(150, 250)]
    assert next(i for i, b in enumerate(later, 150) if b != AR) == next_tree


def good_outlook(policy: BudgetPolicy) -> None:
    """An engine-wide outlook under which trees win: what the rows' forecasts age into over AR rounds."""
    policy.prior.observe(forecast(0.9, 3.0, 5.0, 7.0), 7.0, 7)


def test_the_choice_stays_put_on_close_estimates_and_probes_a_near_one():
    policy = BudgetPolicy(by_cost=True, cap=16, slots=2, block_size=16, round_nodes=None, learning=True)
    policy.costs = CostModel.of_table(costs(2, {1: 10, 2: 20, 5: 20, 9: 20, 17: 20}).seconds)
    good_outlook(policy)
    reqs = [_Req("ddtree", 16), _Req("ddtree", 16)]
    for r in reqs:
        r.acceptance.observe(forecast(0.5, 1.0, 1.0, 1.0), 1.0, 1)  # a tree of 16: 2 tokens a row in 20 ms; AR: 1 in 10
    policy.last_round = 16
    policy._probe_after = 8                                 # probes 8 AR rounds apart (after failed ones)
    assert policy.budgets(reqs) == [16, 16]                 # AR predicts the same: no switch
    policy.costs.observe(2, 1, 0.009, 10, 20)
    policy.costs.observe(2, 1, 0.009, 10, 20)               # AR now 9 ms: 11% better, past the hysteresis,
    assert policy.budgets(reqs) == [16, 16]                 # but back to trees costs a drafter pass (11 ms / 8)
    policy.costs.observe(2, 1, 0.007, 10, 20)
    policy.costs.observe(2, 1, 0.007, 10, 20)               # AR 7 ms: better by more than that over the 8
    assert policy.budgets(reqs) == [AR, AR]                 # AR rounds before the next probe


def test_rows_that_must_draft_again_pay_no_switch_back():
    """After AR rounds the rows have no draft: a tree round pays the drafter pass, AR does not."""
    policy = BudgetPolicy(by_cost=True, cap=16, slots=2, block_size=16, round_nodes=None, learning=True)
    policy.costs = CostModel.of_table(costs(2, {1: 9, 2: 20, 5: 20, 9: 20, 17: 20}).seconds)
    good_outlook(policy)
    reqs = [_Req("ddtree", 16), _Req("ddtree", 16)]
    for r in reqs:
        r.acceptance.observe(forecast(0.5, 1.0, 1.0, 1.0), 1.0, 1)
    policy.last_round = 16
    # leaving trees for AR costs the drafter pass back, spread over the AR rounds before the policy's next
    # tree round (a probe after PROBE_FIRST of them), not over rounds that would never run
    assert policy.budgets(reqs) == [16, 16] and policy.last.rates[AR] == pytest.approx(2 / (0.009 + 0.011 / 2))
    for r in reqs:
        r.drafted = None
    assert policy.budgets(reqs) == [AR, AR] and policy.last.rates[AR] == pytest.approx(2 / 0.009)


def test_leaving_trees_for_good_costs_no_drafter_pass_back():
    """Leaving trees is charged the drafter pass that coming back costs only where trees would come
    back: where AR wins at the outlook the rows' forecasts age into too, AR is taken at its own rate
    (on the hybrid tiny pair at 16-32 running on the CPU, AR charged that pass lost to trees it beat)."""
    policy = BudgetPolicy(by_cost=True, cap=16, slots=2, block_size=16, round_nodes=None)
    policy.costs = CostModel.of_table(costs(2, {1: 9, 2: 20, 5: 20, 9: 20, 17: 20}).seconds)
    policy.prior.observe(forecast(0.5, 0.8, 0.8, 0.9), 0.9, 0.9)   # a tree of 16 would give 1.9 a row in 20 ms
    reqs = [_Req("ddtree", 16), _Req("ddtree", 16)]
    for r in reqs:
        r.acceptance.observe(forecast(0.5, 1.0, 1.0, 1.0), 1.0, 1)  # now 2 a row in 20 ms; AR 1 in 9
    policy.last_round = 16
    assert policy.budgets(reqs) == [AR, AR] and policy.last.rates[AR] == pytest.approx(2 / 0.009)
    good_outlook(policy)                                     # trees win at the outlook: coming back is likely
    assert policy.budgets(reqs) == [16, 16] and policy.last.rates[AR] == pytest.approx(2 / (0.009 + 0.011 / 2))


def test_a_small_trees_forecast_is_capped_at_its_size():
    """A row that accepts more than its drafter forecast has its forecast scaled up; a tree of 8 nodes
    still accepts at most 8, so the scaling must not make it look as good as a tree of 16."""
    policy = BudgetPolicy(by_cost=True, cap=16, slots=2, block_size=16, round_nodes=None)
    policy.costs = CostModel.of_table(costs(2, {1: 10, 2: 20, 5: 20, 9: 20, 17: 26}).seconds)
    reqs = [_Req("ddtree", 16), _Req("ddtree", 16)]
    for r in reqs:                      # forecast 5 for the tree run, 15 accepted: scaled ~2.4x (12 at 8 nodes)
        r.acceptance.observe(forecast(0.9, 3.0, 5.0, 7.0), 5.0, 15)
    assert policy.budgets(reqs) == [16, 16]
    assert policy.last.rates[8] == pytest.approx(2 * 9 / 0.020)   # 8 accepted and the bonus token, a row


def test_near_candidates_are_timed_again_now_and_then():
    policy = BudgetPolicy(by_cost=True, cap=16, slots=2, block_size=16, round_nodes=None, learning=True)
    ms = {1: 10, 2: 20, 5: 20, 8: 20, 9: 20, 16: 20, 17: 20}
    policy.costs = CostModel.of_table(costs(2, ms).seconds)
    policy.prior.observe(forecast(0.5, 0.8, 0.8, 0.9), 0.9, 0.9)   # AR wins at the outlook: leaving is not charged
    reqs = [_Req("ddtree", 16), _Req("ddtree", 16)]
    for r in reqs:  # 16 predicts 220 tok/s; 4, 8, 15 and AR 200, 7 190: within PROBE_WITHIN; 1 150
        r.acceptance.observe((0.5, 1.0, 0.9, 1.0, 1.0, 1.2, 1.2), 1.2, 1.2)
    chosen = []
    for _ in range(200):
        budgets = policy.budgets(reqs)
        chosen.append(budgets[0])
        policy.record(reqs, budgets, BatchStats())
        policy.timed(ms[1 if budgets[0] == AR else tree_bucket(budgets[0] + 1)] / 1e3)
    probes = [b for b in chosen if b != 16]
    assert {AR, 4, 7, 8, 15} <= set(probes) and 1 not in probes  # each near one, never the far one
    assert len(probes) <= 200 // PROBE_GAP                          # at most one in PROBE_GAP rounds


def test_the_warm_up_times_every_shape_and_leaves_the_outlook_as_it_was(tiny_models):
    engine = Engine(EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft"), max_running=2,
                                 tree_policy="cost"))
    engine.warm_up()
    shapes = {(b, t) for b in (1, 2) for t in (1, 2, 5, 8, 9, 16, 17)}
    assert set(engine.policy.costs.samples) == shapes
    assert all(len(w) >= 4 for w in engine.policy.costs.samples.values())
    assert engine.policy.prior.curve is None  # its made-up prompts' acceptance is not real traffic's


def test_event_phases_time_a_rounds_phases_and_the_gap_before_it_without_a_sync():
    """EventPhases (no sync: the device runs as it does unobserved) gives each phase's time a round,
    summed where a round enters it twice, 0 where a round skips it, and the step's time outside the
    phases ("between"); on the CPU by the host's clock alone."""
    phases = _bench("gpu_bench").EventPhases(torch.device("cpu"))
    for r in range(5):
        phases("verify")
        time.sleep(0.004)
        phases("commit")
        time.sleep(0.001)
        if r == 2:
            phases("draft")
            time.sleep(0.02)
        phases("commit")   # again, after the next round's draft is queued
        time.sleep(0.001)
        phases("end")
        time.sleep(0.003)  # the step's work after its phases, before the next round
    got = phases.medians_ms()
    assert 4 <= got["verify"] < 8 and 2 <= got["commit"] < 5 and got["draft"] == 0
    assert 3 <= got["between"] < 6 and got["host_verify"] == got["verify"]
    batch_bench = _bench("batch_bench")   # as steady_rounds drives it
    engine = _SteadyEngine(rows=2, round_s=0.002, first=100, capture_s=0.0)
    got = batch_bench.steady_rounds(engine, [[1], [2]], SamplingParams(max_new_tokens=100), rounds=5, warmup=2,
                                    timer=_bench("gpu_bench").EventPhases(torch.device("cpu")))
    assert 2 <= got["phases_ms"]["verify"] < 10 and got["phases_ms"]["between"] < 2

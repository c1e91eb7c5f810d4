"""How big each request's tree is this round: chosen by cost (`tree_policy` "cost"), or fixed (the default).

By cost, each round picks the budget that maximises the batch's expected tokens per second:

    rate(b) = sum over requests of min(1 + E_i(b), tokens left_i) / cost(rows, b)

- cost(rows, b) is the predicted time of a round at the batch bucket of `rows`, the tree bucket of
  b + 1 nodes and the rows' contexts (costs.CostModel: timed by Engine.warm_up's sweep, then learnt
  from every round Engine.step times). Budget 0 is a plain AR round: one target pass of
  the roots, no tree and no drafter pass (the pass's features are staged for the drafter's context
  and written a block of rounds at a time, draft_cache.py, so a later tree round drafts from a
  complete context).
- E_i(b), the accepted draft tokens request i expects at budget b, is its drafter's own forecast (the
  sum of the path probabilities of the b best nodes of its last tree, forecast.py) times its calibration
  (what it accepted over what was forecast for the trees it ran, `Acceptance`). Over AR rounds, which
  forecast nothing, it ages toward the engine-wide outlook (the rows' mean, a newcomer's start).

A round verifies every row at one padded tree bucket, so every row gets the round's budget (its own
cap permitting): a smaller tree for one row saves nothing. AR is a candidate whenever every drafting row
is chosen by cost, so the choice is never below AR's predicted rate. A request that asked for its own
`tree_budget`, a dflash chain and the `fixed` policy run their own budget; the chosen ones then take at
least the bucket those rows pad the round to. Before costs are measured (no warm-up) budgets are fixed.

Two guards keep the choice steady on noisy estimates: the last round's budget stays unless another
predicts more than STAY better (hysteresis), and a candidate that stays near the best but is not run
is timed again now and then (a probe), so no estimate is only remembered.

`round_nodes` (--round-nodes) caps the nodes a round verifies: fixed, each request gets an equal share
(rounded down to a tree bucket); by cost, no budget whose round would verify more is a candidate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from operator import truediv
from typing import TYPE_CHECKING, NamedTuple

from ..capacity import TREE_BUCKETS
from .costs import AR, CostModel, RoundCosts
from .runner import batch_bucket, tree_bucket

if TYPE_CHECKING:
    from .types import BatchStats, RequestState

DECAY = 0.8             # the calibration's memory: a round's weight against what came before
PRIOR_WEIGHT = 2.0      # forecast tokens of the engine-wide calibration a new request starts with
SCALE_RANGE = (0.05, 4.0)
# AR rounds before a tree round re-forecasts, doubling while AR keeps winning: a probe costs a tree round,
# a drafter catching up and the next AR round's run-ahead (~2.5 AR rounds alone on the CPU's tiny pair),
# so a request whose drafter keeps losing pays it once in 128 rounds, not once in 16 (+1.6%, not +15%)
PROBE_FIRST, PROBE_LAST = 2, 128
PROBE_SHARE = 0.03      # and never so often that what probes cost beyond AR exceeds this share of its time
REFRESH_ROUNDS = 8      # the most rounds a drafter pass after AR rounds is spread over
STAY = 0.05             # hysteresis: how much better than the last round's budget another must predict
# a candidate within PROBE_WITHIN of the best, untimed for PROBE_AGE rounds, runs once (PROBE_GAP apart)
PROBE_WITHIN, PROBE_AGE, PROBE_GAP = 0.85, 256, 32


def round_budgets(budgets: list[int], rows: int, round_nodes: int | None) -> list[int]:
    """The fixed policy: each request's own budget, or with `round_nodes` an equal share of that many
    nodes (the root included), rounded down to a tree bucket so no row pays for padding."""
    if round_nodes is None:
        return budgets
    share = max(2, round_nodes // rows)
    cap = max(b for b in TREE_BUCKETS if b <= share) - 1
    return [min(budget, cap) for budget in budgets]


def candidate_budgets(cap: int) -> tuple[int, ...]:
    """The tree budgets a chosen round may take (besides AR): each bucket's full tree below `cap`, and `cap`."""
    return tuple(sorted({b - 1 for b in TREE_BUCKETS if 1 < b <= cap} | {cap}))


def _toward(curve: Sequence[float], target: Sequence[float]) -> tuple[float, ...]:
    """`curve` moved one round's step (1 - DECAY) toward `target`."""
    return tuple(DECAY * c + (1 - DECAY) * t for c, t in zip(curve, target))


@dataclass
class Acceptance:
    """A request's acceptance outlook: its drafter's forecast of accepted draft tokens at each candidate
    budget (its last tree's), and a calibration, the ratio of accepted to forecast tokens over the trees
    it ran (a moving sum, DECAY per round)."""
    curve: tuple[float, ...] | None = None
    accepted: float = 0.0
    forecast: float = 0.0

    def scale(self) -> float:
        if self.forecast <= 0:
            return 1.0
        return min(max(self.accepted / self.forecast, SCALE_RANGE[0]), SCALE_RANGE[1])

    def observe(self, curve: Sequence[float], forecast: float, accepted: int) -> None:
        """A round's tree: the new forecast curve, and what was forecast for and accepted of the tree run."""
        self.curve = tuple(curve)
        self.accepted = DECAY * self.accepted + accepted
        self.forecast = DECAY * self.forecast + forecast

    def relax(self, prior: Acceptance) -> None:
        """An AR round: no tree, so no new forecast; the last one ages toward the engine-wide outlook
        (DECAY a round), and so does the calibration (its sums fade, the outlook's weighs more). A row's
        low forecast is of the tree that failed on a hard token, and the text after it is often easy
        again; the rows left at a batch's end stayed on AR for 8-10 rounds on the tiny pair while a tree
        round would have accepted 8-11 tokens each, and with the curve alone aged, 30 rounds on the
        hybrid pair at 16 running (their calibration still that of one bad tree round), where trees,
        when they came back, gave 1.4 tokens a ms against AR's 0.6."""
        if self.curve is not None and prior.curve is not None:
            self.curve = _toward(self.curve, prior.curve)
        self.accepted, self.forecast = DECAY * self.accepted, DECAY * self.forecast

    def observe_round(self, curves: Sequence[Sequence[float]], forecast: float, accepted: float) -> None:
        """Every chosen row's tree of a round (the engine-wide outlook a newcomer starts from): the rows'
        mean curve, blended into the ones before (DECAY a round), so that it is a typical request's, not
        the last row's (a row stuck on hard text at the end of a batch would hand every newcomer its
        1-token forecast, and the next batch would open with AR rounds); the totals as `observe`."""
        mean = tuple(sum(c[k] for c in curves) / len(curves) for k in range(len(curves[0])))
        self.observe(_toward(self.curve or mean, mean), forecast, accepted)

    def expected(self, prior: Acceptance, settled: bool = False) -> tuple[float, ...] | None:
        """Expected accepted draft tokens at each candidate (the engine-wide outlook until it has its own).
        `settled`: once AR rounds have aged its forecast into the outlook's (`relax`), its calibration kept."""
        outlook = self.outlook(prior, prior.scale(), settled)
        return None if outlook is None else tuple(outlook[1] * c for c in outlook[0])

    def outlook(self, prior: Acceptance, prior_scale: float,
                settled: bool) -> tuple[tuple[float, ...], float] | None:
        """`expected`'s forecast curve and calibration, apart (the policy scales what it reads of the
        curve only; `prior_scale` is prior.scale(), the same for every row of a round)."""
        curve = (prior.curve or self.curve) if settled else (self.curve or prior.curve)
        if curve is None:
            return None
        scale = (self.accepted + PRIOR_WEIGHT * prior_scale) / (self.forecast + PRIOR_WEIGHT)
        return curve, min(max(scale, SCALE_RANGE[0]), SCALE_RANGE[1])


@dataclass(frozen=True)
class Choice:
    """A round's budget for its chosen rows and the tokens per second it was predicted to give."""
    budget: int
    rate: float
    rates: dict[int, float]   # every candidate's predicted tokens/s (the benchmarks print them)
    tokens: dict[int, float]  # and the tokens each was predicted to give

    def taking(self, budget: int) -> Choice:
        """The same predictions, `budget` taken instead (hysteresis, probes)."""
        return replace(self, budget=budget, rate=self.rates[budget])


def best_budget(costs: RoundCosts, batch: int, expected: Sequence[Sequence[float]], left: Sequence[int],
                candidates: Sequence[int], *, floor_nodes: int = 1, ar: bool = True, refresh: float = 0.0,
                leave: float = 0.0, ar_rounds: int = REFRESH_ROUNDS, node_cap: int | None = None) -> Choice | None:
    """The budget that maximises predicted tokens/s for a round of len(expected) chosen rows (plus any
    fixed ones, counted in `batch`, the batch bucket, and `floor_nodes`, the tree bucket they pad to).
    expected[i][k]: row i's expected accepted draft tokens at candidates[k]; left[i]: the tokens it may
    still emit. `ar`: whether budget 0 (plain AR) may be chosen; `refresh`: seconds the first tree round
    costs more because the rows must draft first (after AR rounds), spread over the tree rounds the rows
    still need; `leave`: the same drafter pass, which trees cost again after AR rounds, charged to an AR
    round chosen while the rows hold drafts (spread over the AR rounds they would still need, and at most
    `ar_rounds`, the probes' spacing: a tree round comes then anyway. A switch there and back costs it
    once; spread over 8 rounds where a probe came after 2, the switches cost the tiny pair 12-22% at 32
    running on the CPU); `node_cap`: the most nodes a round may verify (--round-nodes, rows x tree
    bucket). None when the costs of this batch are not measured."""
    rates: dict[int, float] = {}
    gives: dict[int, float] = {}
    rows = max(batch, 1)
    if ar and floor_nodes == 1:
        cost = costs.of(batch, 1)
        if cost is None:
            return None
        spread = min(max(max(left, default=1), 1), REFRESH_ROUNDS, max(ar_rounds, 1))
        gives[AR] = sum(1 for n in left if n > 0)
        rates[AR] = gives[AR] / (cost + leave / spread)
    for k, budget in enumerate(candidates):
        nodes = max(tree_bucket(budget + 1), floor_nodes)
        if node_cap is not None and rows * nodes > node_cap and rates:
            continue
        cost = costs.of(batch, nodes)
        if cost is None:
            return None
        per_round = [1 + e[k] for e in expected]   # each row's tokens a round
        tokens = sum(map(min, per_round, left))
        gives[budget] = tokens
        if refresh:
            # drafting again serves every tree round after it: its cost is spread over the rounds the
            # rows still need at this budget (REFRESH_ROUNDS at most: forecasts change)
            rounds = max(map(math.ceil, map(truediv, left, per_round)), default=1)
            cost += refresh / min(max(rounds, 1), REFRESH_ROUNDS)
        rates[budget] = tokens / cost
    if not rates:
        return None
    best = max(rates, key=lambda b: (rates[b], b))  # a tie goes to the bigger tree (it forecasts more)
    return Choice(best, rates[best], rates, gives)


class Prediction(NamedTuple):
    """A round's best predicted budget (None: nothing forecast yet, or this batch's costs unmeasured) and
    what it was read from: the batch bucket, the tree bucket the fixed rows pad it to, and the costs at
    the rows' contexts (the probes' spacing reads them again)."""
    choice: Choice | None
    batch: int
    floor: int
    costs: RoundCosts


@dataclass(frozen=True)
class RoundShape:
    """What a round's time is learnt as (costs.CostModel): its batch and tree buckets, its rows' contexts,
    and whether it counts (see costs.py: a round that drafts first, or follows one of the other kind, not)."""
    batch: int
    nodes: int
    longest: int
    total: int
    counts: bool


class BudgetPolicy:
    """Each round's tree budgets (scheduler.py asks), and what the rounds taught (postprocess tells, and
    Engine.step, each round's time)."""

    def __init__(self, *, by_cost: bool, cap: int, slots: int, block_size: int, round_nodes: int | None,
                 learning: bool = False, dense: bool = False) -> None:
        """`learning`: whether rounds' times are learnt (costs.py: the cost policy, without tensor
        parallelism, whose ranks must choose alike); `dense`: the device computes attention densely (costs.py)."""
        self.by_cost, self.slots, self.block_size, self.round_nodes = by_cost, slots, block_size, round_nodes
        self.candidates = candidate_budgets(cap)
        self.costs = CostModel(dense)         # timed by Engine.warm_up's sweep, then by every round
        self.learning = learning
        self.prior = Acceptance()             # every chosen request's rounds: a newcomer's outlook
        self.forced: int | None = None        # the cost sweep's budget for every chosen row
        self.last: Choice | None = None
        self.last_round: int | None = None    # the last round's budget (record)
        self._ar_streak, self._probe_after = 0, PROBE_FIRST
        self._shape: RoundShape | None = None  # this round's, until Engine.step times it
        self._drafted_last: bool | None = None  # whether the last round drafted (None: none ran yet)
        self._rounds, self._since_probe = 0, 0
        self._probing: tuple[int, int] | None = None  # a probe's budget and its rounds still to run
        self._timed: dict[tuple[int, int], int] = {}  # each shape's last timed round
        self._caps: dict[int, list[tuple[int, float]]] = {}  # _within's, by a row's cap

    def chooses(self, req: RequestState) -> bool:
        """Whether this request's budget is chosen each round (a ddtree request that set none)."""
        return self.by_cost and req.mode.name == "ddtree" and req.params.tree_budget is None

    def budgets(self, reqs: list[RequestState]) -> list[int]:
        """Each decoding request's tree budget this round (0: its root alone)."""
        budgets = self._budgets(reqs)
        self._shape = self._shape_of(reqs, budgets)
        return budgets

    def _budgets(self, reqs: list[RequestState]) -> list[int]:
        self.last = None
        fixed = round_budgets([r.budget for r in reqs], len(reqs), self.round_nodes if not self.by_cost else None)
        chosen = [i for i, r in enumerate(reqs) if self.chooses(r)]
        if not chosen:
            return fixed
        if self.forced is not None:
            return [min(self.forced, reqs[i].budget) if i in chosen else b for i, b in enumerate(fixed)]
        choice = self._choose(reqs, chosen, fixed)
        self.last = choice
        if choice is None:
            return [reqs[i].budget if i in chosen else b for i, b in enumerate(fixed)]
        return [min(choice.budget, reqs[i].budget) if i in chosen else b for i, b in enumerate(fixed)]

    def _expected(self, reqs: list[RequestState], settled: bool = False) -> list[list[float]] | None:
        """Each row's expected accepted draft tokens at each candidate (Acceptance.expected), within what
        its tree there can accept: a row capped below a candidate gets its cap's tree there (the largest
        candidate within it); a tree of b nodes accepts at most b of them, however its calibration scales
        the forecast (a row accepting more than forecast made its scaled forecast for a small tree exceed
        that tree). None while a row has nothing forecast."""
        rows, prior_scale = [], self.prior.scale()
        for req in reqs:
            outlook = req.acceptance.outlook(self.prior, prior_scale, settled)
            if outlook is None:
                return None
            curve, scale = outlook
            rows.append([v if (v := scale * curve[j]) < most else most for j, most in self._within(req.budget)])
        return rows

    def _within(self, cap: int) -> list[tuple[int, float]]:
        """For each candidate, the one a row capped at `cap` runs there (the largest within both) and the
        most that tree accepts (its size, and the block's depth); kept per cap: the policy asks every
        round for every row (0.44 ms a round at 32 rows on the CPU when made each time)."""
        if cap not in self._caps:
            depth = self.block_size - 1
            within = [max((j for j, c in enumerate(self.candidates) if c <= min(b, cap)), default=0)
                      for b in self.candidates]
            self._caps[cap] = [(j, min(depth, self.candidates[j])) for j in within]
        return self._caps[cap]

    def _floor(self, reqs: list[RequestState], others: list[int], fixed: list[int]) -> int:
        """The tree bucket the rows not chosen by cost (`others`, at their `fixed` budgets) pad the round to."""
        return max((tree_bucket(reqs[i].mode.tree_slots(fixed[i], self.block_size)) for i in others), default=1)

    def _contexts(self, reqs: list[RequestState]) -> tuple[int, int]:
        return max(r.n_ctx for r in reqs), sum(r.n_ctx for r in reqs)

    def drafts_with_prompt(self, reqs: list[RequestState]) -> bool:
        """Whether requests chosen by cost whose prompts complete this step make their first draft with
        the prompt's pass, as fixed budgets do: unless the next round of `reqs` (the batch they join) is
        predicted to be plain AR, which needs no draft; then their first tree round drafts them, in the
        batched pass that follows AR rounds. Drafting later where a tree round comes next only moves the
        draft into a pass of its own (a lone request on the CPU's tiny pair: 4.2 ms there against 2.8
        with its prompt, 3% of its serve). With nothing measured or forecast yet, trees come (the
        configured budget): draft now."""
        if self.forced is not None:
            return self.forced != AR
        chosen = [i for i, r in enumerate(reqs) if self.chooses(r)]
        if not chosen:
            return True
        fixed = round_budgets([r.budget for r in reqs], len(reqs), None)
        choice = self._predict(reqs, chosen, fixed).choice
        return choice is None or choice.budget != AR

    def _predict(self, reqs: list[RequestState], chosen: list[int], fixed: list[int]) -> Prediction:
        """The best predicted budget for the chosen rows of this batch (best_budget; no hysteresis, no
        probes: `_choose` adds those)."""
        others = [i for i in range(len(reqs)) if i not in chosen]
        floor = self._floor(reqs, others, fixed)
        batch = batch_bucket(len(reqs), self.slots)
        costs = self.costs.at(batch, *self._contexts(reqs))
        rows = [reqs[i] for i in chosen]
        expected = self._expected(rows)
        if expected is None:  # nothing forecast yet: the configured budget, which forecasts
            return Prediction(None, batch, floor, costs)
        left = [reqs[i].params.max_new_tokens - reqs[i].generated for i in chosen]
        ar = not any(reqs[i].mode.drafts for i in others)
        stale = any(reqs[i].drafted is None for i in chosen)  # after AR rounds: a tree round drafts first
        redraft = costs.refresh(batch)   # paid by the next tree round if stale, else by leaving trees now
        choose = partial(best_budget, costs, batch, left=left, candidates=self.candidates, floor_nodes=floor,
                         node_cap=self.round_nodes)
        leave = 0.0
        if ar and not stale:
            # leaving trees costs the drafter pass back only if trees are to come back: when the rows'
            # forecasts, aged into the engine-wide outlook over AR rounds, would choose a tree again. Where
            # AR beats trees at that outlook too, AR rounds are where the rows stay (the hybrid tiny pair at
            # 16-32 running on the CPU: charged that pass, AR lost to trees it beat by 1.4x)
            settled = choose(self._expected(rows, settled=True))
            leave = redraft if settled is not None and settled.budget != AR else 0.0
        choice = choose(expected, ar=ar, refresh=redraft if stale else 0.0, leave=leave, ar_rounds=self._probe_after)
        return Prediction(choice, batch, floor, costs)

    def _choose(self, reqs: list[RequestState], chosen: list[int], fixed: list[int]) -> Choice | None:
        choice, batch, floor, costs = self._predict(reqs, chosen, fixed)
        if choice is None:
            return None
        choice = self._steady(choice)
        probe = self._probe(choice, batch, floor)
        if probe is not None:  # (an AR probe leaves the AR rounds' count as it is)
            if probe.budget != AR:
                self._ar_streak = 0
            return probe
        if choice.budget != AR:   # the probes' spacing stays: only a tree that gains resets it (observe)
            self._ar_streak = 0
            return choice
        self._ar_streak += 1
        tree = max((b for b in choice.rates if b != AR), key=lambda b: choice.rates[b])
        if self._ar_streak < self._probe_after or self._ar_streak < self._probe_spacing(
                choice, tree, costs, batch, floor, costs.refresh(batch)):   # (the spacing only when due)
            return choice
        # AR rounds forecast nothing: now and then a tree round looks again at what the drafter offers,
        # for two rounds where its shape's cost is due to be timed again (the first, after the drafter's
        # catch-up, is not timed: costs.py); the near trees are timed again only here while AR wins
        self._ar_streak, self._probe_after = 0, min(2 * self._probe_after, PROBE_LAST)
        if self.learning and self._age(tree, batch, floor) >= PROBE_AGE:
            self._probing = (tree, 1)
        return choice.taking(tree)

    @staticmethod
    def _probe_spacing(choice: Choice, tree: int, costs: RoundCosts, batch: int, floor: int, redraft: float) -> int:
        """The fewest AR rounds between probes of `tree` for what a probe costs beyond the AR rounds
        that would give its tokens (a tree round, and the drafter pass before it) to stay within
        PROBE_SHARE of their time. (On the hybrid tiny pair at 9-16 running, where AR wins, a probe
        took 45 ms for what 3 AR rounds of 7 ms give: two AR rounds apart, probes cost half the time.)"""
        ar = costs.of(batch, 1)
        probe = costs.of(batch, max(tree_bucket(tree + 1), floor))
        if ar is None or probe is None:
            return 0
        excess = probe + redraft - choice.tokens[tree] / max(choice.tokens[AR], 1.0) * ar
        return math.ceil(excess / (PROBE_SHARE * ar)) if excess > 0 else 0

    def _steady(self, choice: Choice) -> Choice:
        """Hysteresis: the last round's budget stays while the best beats it by no more than STAY (on
        estimates this close, switching back and forth only follows their noise)."""
        last = self.last_round
        if last is None or last == choice.budget or last not in choice.rates:
            return choice
        if choice.rate <= (1 + STAY) * choice.rates[last]:
            return choice.taking(last)
        return choice

    def _age(self, budget: int, batch: int, floor: int) -> int:
        """Rounds since the round of `budget` at this batch bucket was last timed (at least PROBE_AGE where never)."""
        nodes = 1 if budget == AR else max(tree_bucket(budget + 1), floor)
        return self._rounds - self._timed.get((batch, nodes), -PROBE_AGE)

    def _probe(self, choice: Choice, batch: int, floor: int) -> Choice | None:
        """Now and then (every PROBE_GAP rounds at most), a candidate within PROBE_WITHIN of the best
        whose round has not been timed for PROBE_AGE rounds runs, so that its cost is measured at
        today's load and contexts rather than remembered: twice where it is of the other kind (AR
        against trees), whose first round is not timed (costs.py). While AR wins, the trees are not
        among them: the AR rounds' own probes time them (_choose), where a tree round pays the drafter's
        catch-up once for two uses (on the H100 at zero acceptance, lone, timing each tree again here
        cost 2% of the cost policy's time over 200 rounds)."""
        self._since_probe += 1
        if self._probing:
            budget, rounds = self._probing
            self._probing = (budget, rounds - 1) if rounds > 1 else None
            if budget in choice.rates:
                return choice.taking(budget)
        if not self.learning or self._since_probe < PROBE_GAP or choice.budget == AR:
            return None
        age = partial(self._age, batch=batch, floor=floor)
        near = [b for b, rate in choice.rates.items() if b != choice.budget and rate >= PROBE_WITHIN * choice.rate
                and age(b) >= PROBE_AGE]
        if not near:
            return None
        self._since_probe = 0
        budget = max(near, key=age)
        if (budget == AR) != (choice.budget == AR):
            self._probing = (budget, 1)
        return choice.taking(budget)

    def _shape_of(self, reqs: list[RequestState], budgets: list[int]) -> RoundShape | None:
        if not reqs or not self.learning:
            return None
        drafting = any(r.mode.drafts and b > 0 for r, b in zip(reqs, budgets))
        nodes = max(tree_bucket(r.mode.tree_slots(b, self.block_size)) for r, b in zip(reqs, budgets)) \
            if drafting else 1
        redrafts = drafting and any(r.mode.drafts and b > 0 and r.drafted is None for r, b in zip(reqs, budgets))
        counts = (all(r.mode.name == "ddtree" for r in reqs) and not redrafts
                  and self._drafted_last in (None, drafting))
        self._drafted_last = drafting
        return RoundShape(batch_bucket(len(reqs), self.slots), nodes, *self._contexts(reqs), counts)

    def timed(self, seconds: float | None) -> None:
        """This round's wall time (Engine.step; None: the step ran more than the round, a prompt piece)."""
        shape, self._shape = self._shape, None
        if shape is None:
            return
        self._rounds += 1
        if seconds is not None and shape.counts:
            self.costs.observe(shape.batch, shape.nodes, seconds, shape.longest, shape.total)
            self._timed[(shape.batch, shape.nodes)] = self._rounds

    def record(self, reqs: list[RequestState], budgets: list[int], stats: BatchStats) -> None:
        """The round's budget for /metrics: its largest ddtree tree (0: none, plain AR)."""
        top = max((b for r, b in zip(reqs, budgets) if r.mode.name == "ddtree"), default=AR)
        self.last_round = top
        stats.round_budget = top
        stats.predicted_tokens_per_s = 0.0 if self.last is None else self.last.rate
        stats.budget_rounds = {**stats.budget_rounds, top: stats.budget_rounds.get(top, 0) + 1}  # a new dict:
        # the warm-up puts back a copy of the stats taken before it

    def observe(self, reqs: list[RequestState], budgets: list[int], rounds: list, forecasts: list) -> None:
        """A round's outcome: each chosen row that ran a tree gets its new forecast and calibration.
        rounds[i]: (tokens, accepted, logprobs); forecasts[i]: the drafter's forecast at each candidate,
        then at the budget run (None: no tree)."""
        curves, ran_total, accepted_total, ran_budget = [], 0.0, 0, AR
        for req, budget, (_, accepted, _), fc in zip(reqs, budgets, rounds, forecasts):
            if budget == AR and self.chooses(req):
                req.acceptance.relax(self.prior)
            if fc is None or budget == AR or not self.chooses(req):
                continue
            curve, ran = fc[:-1], fc[-1]
            req.acceptance.observe(curve, ran, accepted)
            curves.append(curve)
            ran_total, accepted_total, ran_budget = ran_total + ran, accepted_total + accepted, max(ran_budget, budget)
        if curves:
            self.prior.observe_round(curves, ran_total, accepted_total)
        if accepted_total and self._beat_ar(ran_budget, len(curves) + accepted_total):
            # a tree gained more than AR would have: should AR win again, look again soon. A tree that
            # gains less leaves the spacing as it was (a lone request whose drafter keeps losing paid the
            # probes' ramp again after every such round: 11 tree rounds in 200 on the H200, not 6; on the
            # hybrid tiny pair at 16-32 running, where AR wins, probes that gained 2-3 tokens a row kept
            # coming back every third round, each with its drafter pass)
            self._ar_streak, self._probe_after = 0, PROBE_FIRST

    def _beat_ar(self, budget: int, tokens: float) -> bool:
        """Whether this round's tree of `budget`, at the tokens its chosen rows gave, beat the AR round
        its choice weighed it against (at the rates predicted for both: the tree's scaled by what it gave
        against what it was predicted to give); True where no such choice was made."""
        choice = self.last
        if choice is None or AR not in choice.rates or not choice.tokens.get(budget):
            return True
        return choice.rates[budget] * tokens / choice.tokens[budget] > choice.rates[AR]

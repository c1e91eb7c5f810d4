"""The round's cost as the budget policy sees it: measured from the rounds themselves (CostModel), first
by a warm-up sweep, then by every serving round.

A round's seconds are the host's time of its whole step (scheduling, the passes, the postprocess), taken
by Engine.step around the step's one sync (the walk's readback): nothing is added to the round. On CUDA
that is wall time; on the CPU, this process's CPU time (`round_clock`): there the process's own work is
the round, and other jobs on a shared host, which stretch its wall time by 2x and more at random, do not
enter the comparison of one shape with another.
On CUDA a step's wall time covers what the device still had queued from the round before (its drafter
pass and commit) and this round's passes up to the read, which in steady serving is one round's period.
Only steps that are one round and nothing else count: no prompt piece, no re-size; not the first tree
round after AR rounds (it drafts first: `refresh`; alone on CUDA it also waits out the pass the last AR
round ran ahead, whose token it emits: ~2x a round's wall time for two tokens), nor the first round of
another kind than the last (an AR round after a tree round still waits for that round's drafter pass).

The model is, for batch bucket B (rows, padding included), tree bucket T (1: a plain AR round) and the
rows' contexts (the longest L, all of them together S):

    cost(B, T, L, S) = base[B, T] + a * B * T * L + c * S

- a: attention as a dense computation over every node of every padded row and every key up to the
  longest context (the CPU's, and any eager pass); c: reading each row's keys once (a GPU's
  memory-bound decode). Both are fitted from the samples by least squares within each (B, T), so what
  differs between shapes never reads as context, and both are at least 0; on the CPU a alone (the
  two terms differ across shapes only by the tree's nodes, so the tree rounds' dense attention was
  fitted as c, which then made an AR round at short contexts 2x cheaper than it runs). Only a shape
  whose samples' longest contexts span a factor CONTEXT_SPREAD takes part: over a few tokens a drift of 1% in the
  rounds' time (a GPU warming up) reads as a steep term (the 27B on the H200: its 16 x 17 round, 40 ms
  at the warm-up's context, was predicted 5 ms there, and the envelope copied that to every shape).
  So that the spread outlives the window, each shape keeps the last FAR samples its window let go of
  from contexts that far from its newest (the sweep's, once serving reaches long contexts).
- base[B, T]: the lower quartile of the last WINDOW samples of that shape, each less its context term.
  On a shared host noise only adds time, and in bursts: a few slow rounds (another job, a graph
  captured) move nothing, and every shape is read at the same quiet end, so they compare fairly.
- A bigger round never costs less: each prediction is the least of its own and those of every bigger
  batch and tree bucket at the same contexts (the envelope), save a shape whose base is held at its
  floor: the term misfits it, so its prediction lowers no other shape.

The sweep (`measure_round_costs`) admits 1, 2, 4, ... `slots` short requests and runs SWEEP_REPEATS
rounds at every budget the policy may choose (after one uncounted), taking turns, as ordinary samples. With tensor
parallelism every rank must choose alike: the sweep's samples are the slowest rank's, and serving rounds
are not learned from (each rank's clock differs)."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..model import parallel
from .runner import batch_bucket, tree_bucket
from .types import SamplingParams

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)

AR = 0             # the budget of a plain AR round: no tree, no drafter pass
MIN_SECONDS = 1e-6
WINDOW = 16        # samples kept per (batch bucket, tree bucket)
QUANTILE = 0.25    # a shape's base: this quantile of its window (noise only adds time)
REFIT = 32         # samples between fits of the context term
SWEEP_PROMPT = 64  # tokens of each sweep request's prompt
SWEEP_REPEATS = 4  # counted rounds per (batch, budget), after one that is not
CONTEXT_SHARE = 0.9  # the most of a shape's median cost the context term may explain
CONTEXT_SPREAD = 2   # the factor a shape's samples' longest contexts must span for them to fit the term
FAR = 4              # samples kept per shape from contexts CONTEXT_SPREAD away from the window's newest


def round_clock(device: torch.device):
    """The clock rounds are timed with (the module's docstring): wall time on a GPU, CPU time on the CPU."""
    return time.perf_counter if device.type == "cuda" else time.process_time


@dataclass
class RoundCosts:
    """Seconds of one round by (batch bucket, tree bucket) at given contexts; tree bucket 1 is the AR
    round (no drafter pass). What the choice reads (policy.best_budget)."""
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)

    def of(self, batch: int, nodes: int) -> float | None:
        return self.seconds.get((batch, nodes))

    def refresh(self, batch: int) -> float:
        """What drafting again after AR rounds adds to the first tree round (a drafter pass): about a
        smallest tree round less an AR round."""
        ar, tree = self.of(batch, 1), self.of(batch, 2)
        return 0.0 if ar is None or tree is None else max(0.0, tree - ar)

    def table(self) -> list[dict]:
        """The costs as rows, for logs and benchmarks."""
        return [{"batch": b, "tree_nodes": t, "ms": round(1e3 * s, 3)} for (b, t), s in sorted(self.seconds.items())]


@dataclass(frozen=True)
class Sample:
    seconds: float
    longest: int   # the longest row's context (tokens)
    total: int     # all rows' contexts together


def _apart(context: int, other: int) -> bool:
    """Whether two contexts differ enough for a round's time to tell their cost apart from its drift."""
    return max(context, other) >= CONTEXT_SPREAD * max(min(context, other), 1)


def _unstalled(samples: Iterable[Sample]) -> list[Sample]:
    """The samples but stalled rounds (over twice their median), which say nothing of context."""
    held = list(samples)
    if not held:
        return []
    median = statistics.median(s.seconds for s in held)
    return [s for s in held if s.seconds <= 2 * median]


class CostModel:
    """Round costs learnt from timed rounds (the module's docstring): `observe` each, `at` to predict."""

    def __init__(self, dense: bool = False) -> None:
        """`dense`: the device computes attention densely (the CPU), so the context costs the a term
        alone; a GPU's kernels read each key once, and c is fitted beside it."""
        self.dense = dense
        self.samples: dict[tuple[int, int], deque[Sample]] = {}
        self.far: dict[tuple[int, int], deque[Sample]] = {}  # let go of by the window, far in context
        self.a = self.c = 0.0             # seconds per (row x node x key), per key read
        self._base: dict[tuple[int, int], float] = {}
        self._floored: set[tuple[int, int]] = set()  # shapes whose base is held at its floor
        self._shape_sums: dict[tuple[int, int], tuple[tuple[float, ...], float, float, float]] = {}
        self._since_fit = 0

    @classmethod
    def of_table(cls, seconds: dict[tuple[int, int], float]) -> CostModel:
        """A model holding one sample per shape at no context (tests, fixed tables)."""
        model = cls()
        for (batch, nodes), s in seconds.items():
            model.observe(batch, nodes, s, 0, 0)
        return model

    def observe(self, batch: int, nodes: int, seconds: float, longest: int, total: int) -> None:
        key = (batch, nodes)
        window = self.samples.setdefault(key, deque(maxlen=WINDOW))
        if len(window) == WINDOW and _apart(window[0].longest, longest):
            self.far.setdefault(key, deque(maxlen=FAR)).append(window[0])
        window.append(Sample(seconds, longest, total))
        self._base.pop(key, None)
        self._shape_sums.pop(key, None)
        self._since_fit += 1
        if self._since_fit >= REFIT:
            self.fit()

    def fit(self) -> None:
        """The context term (a, c) by least squares within each shape, then every base again."""
        self._since_fit = 0
        sums = [self._sums(key) for key in self.samples]
        s11, s12, s22, s1y, s2y = (sum(s[0][i] for s in sums) for i in range(5))
        a, c = _nonnegative_fit(s11, 0.0, 0.0, s1y, 0.0) if self.dense else _nonnegative_fit(s11, s12, s22, s1y, s2y)
        # noise can fit a slope that leaves a shape a base below 0: no shape's context term may be more
        # than CONTEXT_SHARE of its median cost
        for _, x1, x2, median in sums:
            term = a * x1 + c * x2
            if term > CONTEXT_SHARE * median:
                a, c = a * CONTEXT_SHARE * median / term, c * CONTEXT_SHARE * median / term
        self.a, self.c = a, c
        self._base.clear()

    def _sums(self, key: tuple[int, int]) -> tuple[tuple[float, ...], float, float, float]:
        """A shape's share of the fit (kept until it has a new sample): the centred sums of its
        features' and seconds' products over its window and far samples (none unless their contexts
        lie CONTEXT_SPREAD apart; each group's stalls left out against its own median, as far ones may
        be of a context that costs several times the window's), and its window's features' means and
        median seconds (the share's bound)."""
        if key not in self._shape_sums:
            batch, nodes = key
            near, far = _unstalled(self.samples[key]), _unstalled(self.far.get(key, ()))
            rows = [(batch * nodes * s.longest, s.total, s.seconds) for s in near + far]
            m1, m2, my = (sum(r[i] for r in rows) / len(rows) for i in range(3))
            acc = [0.0] * 5
            contexts = [s.longest for s in near + far]
            if len(rows) >= 3 and _apart(min(contexts), max(contexts)):
                for x1, x2, y in rows:
                    d1, d2, dy = x1 - m1, x2 - m2, y - my
                    for i, v in enumerate((d1 * d1, d1 * d2, d2 * d2, d1 * dy, d2 * dy)):
                        acc[i] += v
            near_m1, near_m2 = (sum(r[i] for r in rows[:len(near)]) / len(near) for i in range(2))
            self._shape_sums[key] = (tuple(acc), near_m1, near_m2, statistics.median(s.seconds for s in near))
        return self._shape_sums[key]

    def base(self, key: tuple[int, int]) -> float:
        if key not in self._base:
            batch, nodes = key
            window = self.samples[key]
            rest = sorted(s.seconds - self.a * batch * nodes * s.longest - self.c * s.total for s in window)
            raw = sorted(s.seconds for s in window)
            at = int(QUANTILE * (len(rest) - 1))
            floor = (1 - CONTEXT_SHARE) * raw[at]  # the term never explains it all
            self._base[key] = max(rest[at], floor)
            if rest[at] < floor:
                self._floored.add(key)
            else:
                self._floored.discard(key)
        return self._base[key]

    def predict(self, batch: int, nodes: int, longest: int, total: int) -> float | None:
        """Seconds of a round of this shape at these contexts (None: this shape was never timed)."""
        if (batch, nodes) not in self.samples:
            return None
        return self._seconds((batch, nodes), longest, total)

    def _seconds(self, key: tuple[int, int], longest: int, total: int) -> float:
        """predict's arithmetic, for a shape that was timed."""
        return max(MIN_SECONDS, self.base(key) + self.a * key[0] * key[1] * longest + self.c * total)

    def at(self, batch: int, longest: int, total: int) -> RoundCosts:
        """Every measured tree bucket's cost at this batch bucket and these contexts, each the least of
        its own and those of bigger rounds (but those whose base is at its floor: the module's docstring).
        One pass over the shapes, then a running least from the biggest tree down: every round asks (at
        one row on the CPU's tiny pair, 45 us a round as a least over all shapes for each)."""
        own: dict[int, float] = {}
        least: dict[int, float] = {}   # by tree bucket, the least of the shapes that may bound others
        for key in self.samples:
            b, t = key
            if b < batch:
                continue
            seconds = self._seconds(key, longest, total * b // batch)  # as many keys a row
            if b == batch:
                own[t] = seconds
            if (b, t) not in self._floored:
                least[t] = min(least.get(t, seconds), seconds)
        out, bound = {}, math.inf      # bound: the least over tree buckets of t nodes or more
        for t in sorted(own.keys() | least.keys(), reverse=True):
            bound = min(bound, least.get(t, math.inf))
            if t in own:
                out[(batch, t)] = min(own[t], bound)
        return RoundCosts(out)

    def snapshot(self, longest: int = SWEEP_PROMPT) -> RoundCosts:
        """Every shape's cost with each row at `longest` tokens of context (logs, benchmarks)."""
        out = {}
        for batch in sorted({b for b, _ in self.samples}):
            out.update(self.at(batch, longest, batch * longest).seconds)
        return RoundCosts(out)

    def agree(self) -> None:
        """Each sample as the slowest rank's (tensor parallelism: every rank timed the same rounds)."""
        tp = parallel.current()
        if tp is None or not self.samples:
            return
        groups = [(held, k) for held in (self.samples, self.far) for k in sorted(held)]
        flat = [s for held, k in groups for s in held[k]]
        t = torch.tensor([s.seconds for s in flat], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=tp.control)
        it: Iterator[float] = iter(t.tolist())
        for held, k in groups:
            held[k] = deque((Sample(next(it), s.longest, s.total) for s in held[k]), maxlen=held[k].maxlen)
        self._shape_sums.clear()
        self.fit()


def _nonnegative_fit(s11: float, s12: float, s22: float, s1y: float, s2y: float) -> tuple[float, float]:
    """argmin over a, c >= 0 of the centred squared error given its sums (a 2x2 normal equation, or one
    coefficient alone where the pair comes out negative or the data cannot tell them apart)."""
    det = s11 * s22 - s12 * s12
    if det > 1e-9 * max(s11 * s22, 1e-300):
        a, c = (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det
        if a >= 0 and c >= 0:
            return a, c
    options = [(0.0, 0.0, 0.0)]  # (error reduction, a, c)
    if s11 > 0 and s1y > 0:
        options.append((s1y * s1y / s11, s1y / s11, 0.0))
    if s22 > 0 and s2y > 0:
        options.append((s2y * s2y / s22, 0.0, s2y / s22))
    _, a, c = max(options)
    return a, c


def measure_round_costs(engine: Engine, repeats: int = SWEEP_REPEATS) -> int:
    """Time rounds at every (batch bucket, budget) the policy may choose, into the policy's cost model
    (Engine.step reports each round's time to it); returns the number of requests the sweep ran. A batch
    the pool cannot hold at once, or whose requests would outrun the context, is left out (until serving
    times it, the policy keeps the configured budget there)."""
    policy, vocab = engine.policy, engine.target.config.vocab_size
    # the budgets take turns, so a shared host's drifting load weighs on each alike; the first AR round
    # after trees and the first tree round after AR rounds do not count (costs.py), hence the doubles
    schedule = (AR, AR, policy.candidates[-1], *policy.candidates)
    new_tokens = min(len(schedule) * (repeats + 1) * engine.block_size + 1, engine.max_context - SWEEP_PROMPT)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, mode="ddtree")
    submitted = 0
    learning, policy.learning = policy.learning, True
    try:
        for n in sorted({batch_bucket(k, engine.slots) for k in range(1, engine.slots + 1)}):
            ids = [engine.submit([(i + 1 + 3 * j) % vocab for j in range(SWEEP_PROMPT)], params) for i in range(n)]
            submitted += n
            try:
                while engine.scheduler.waiting or engine.scheduler.prefilling is not None:
                    engine.step()
                    if len(engine.scheduler.running) < n and not engine.scheduler.waiting \
                            and engine.scheduler.prefilling is None:
                        break  # one finished already (a context too short for the sweep)
                for cycle in range(repeats + 1):  # the first cycle captures graphs and compiles: not counted
                    for budget in schedule:
                        if len(engine.scheduler.running) != n:
                            break
                        policy.forced, policy.learning = budget, cycle > 0
                        engine.step()
            finally:
                policy.forced, policy.learning = None, True
                for request_id in ids:
                    engine.cancel(request_id)
    finally:
        policy.learning = learning
    policy.costs.agree()
    policy.costs.fit()
    log.info("round costs (ms) by batch and tree nodes, at %d tokens of context: %s", SWEEP_PROMPT,
             ", ".join(f"{r['batch']}x{r['tree_nodes']} {r['ms']:.2f}" for r in policy.costs.snapshot().table()))
    return submitted

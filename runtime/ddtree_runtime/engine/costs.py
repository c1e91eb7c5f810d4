"""The round's cost as the budget policy sees it, timed at warm-up (policy.RoundCosts).

For each batch bucket, that many short ddtree requests are admitted, then every budget the policy may
choose (plain AR and each candidate) runs a few rounds with all of them running, each round timed from
its step's start to the device's end, the fastest kept (the first of each budget is dropped: it
drafts again after AR rounds, or captures a graph; on a shared host, noise only adds time), then each
as the least of it and those of bigger rounds (RoundCosts.envelope). A round is a whole step: scheduling, the passes and the host's
postprocessing, at the smallest KV bucket. With tensor parallelism the ranks take the slowest rank's
time of each, so that they all choose alike."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..model import parallel
from .policy import AR, RoundCosts
from .runner import batch_bucket, tree_bucket
from .types import SamplingParams

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)

SWEEP_PROMPT = 64  # tokens of each sweep request's prompt (a round's attention grows with the context)
SWEEP_REPEATS = 5  # timed rounds per (batch, budget), after one untimed (the fastest kept)


def measure_round_costs(engine: Engine, repeats: int = SWEEP_REPEATS) -> tuple[RoundCosts, int]:
    """Time a round at every (batch bucket, budget) the policy may choose; returns the costs and the
    number of requests the sweep ran. A batch the pool cannot hold at once, or whose requests would
    outrun the context, is left out (the policy keeps the configured budget there)."""
    policy, vocab = engine.policy, engine.target.config.vocab_size
    budgets = (AR, *policy.candidates)
    rounds = repeats + 1
    new_tokens = min(len(budgets) * rounds * engine.block_size + 1, engine.max_context - SWEEP_PROMPT)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, mode="ddtree")
    seconds: dict[tuple[int, int], float] = {}
    submitted = 0
    for n in sorted({batch_bucket(k, engine.slots) for k in range(1, engine.slots + 1)}):
        ids = [engine.submit([(i + 1 + 3 * j) % vocab for j in range(SWEEP_PROMPT)], params) for i in range(n)]
        submitted += n
        try:
            while engine.scheduler.waiting or engine.scheduler.prefilling is not None:
                engine.step()
                if len(engine.scheduler.running) < n and not engine.scheduler.waiting \
                        and engine.scheduler.prefilling is None:
                    break  # one finished already (a context too short for the sweep)
            for budget in budgets:
                policy.forced = budget
                times = _timed_rounds(engine, n, rounds)
                if len(times) < rounds:
                    break
                seconds[(n, 1 if budget == AR else tree_bucket(budget + 1))] = min(times[1:])
        finally:
            policy.forced = None
            for request_id in ids:
                engine.cancel(request_id)
    costs = RoundCosts(_agreed(seconds)).envelope()
    log.info("round costs (ms) by batch and tree nodes: %s",
             ", ".join(f"{r['batch']}x{r['tree_nodes']} {r['ms']:.2f}" for r in costs.table()))
    return costs, submitted


def _timed_rounds(engine: Engine, n: int, rounds: int) -> list[float]:
    """Up to `rounds` steps' seconds, each with all n requests running (fewer once one is not)."""
    times = []
    for _ in range(rounds):
        if len(engine.scheduler.running) != n:
            break
        _sync(engine.device)
        start = time.perf_counter()
        engine.step()
        _sync(engine.device)
        times.append(time.perf_counter() - start)
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _agreed(seconds: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """Each cost as the slowest rank measured it (every rank ran the same sweep, so the same keys)."""
    tp = parallel.current()
    if tp is None or not seconds:
        return seconds
    keys = sorted(seconds)
    t = torch.tensor([seconds[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=tp.control)
    return dict(zip(keys, t.tolist()))

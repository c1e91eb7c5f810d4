"""T > 0 losslessness: tokens that tree verification commits must be distributed like plain sampling
from the target. Two-sample chi-square homogeneity test, per output position 2-4 (position 1 comes
from the prefill), ddtree samples vs plain autoregressive samples over many seeds, for the Qwen3 and
the hybrid target."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine.sampling import adjusted_probs, choose_tokens

N_SEEDS = 400


def chi2_sf(x: float, dof: int) -> float:
    """Upper tail of the chi-square distribution: Q(dof/2, x/2), the regularised upper incomplete
    gamma function (series below a+1, Lentz continued fraction above; Numerical Recipes' split)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    log_pre = a * math.log(z) - z - math.lgamma(a)
    if z < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= z / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_pre))
    tiny = 1e-300
    b = z + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_pre) * h


def test_chi2_sf_known_values():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(2.0, 4) == pytest.approx(math.exp(-1) * 2, abs=1e-12)  # closed form for dof 4


def homogeneity_pvalue(a: Counter, b: Counter, min_expected: float = 5.0) -> tuple[float, int]:
    """Chi-square test that two samples come from one categorical distribution; rare categories are
    pooled into one bin so every expected count is >= min_expected."""
    na, nb = sum(a.values()), sum(b.values())
    cats = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    bins: list[tuple[int, int]] = []
    pool = [0, 0]
    for k in cats:
        if (a[k] + b[k]) * min(na, nb) / (na + nb) >= min_expected:
            bins.append((a[k], b[k]))
        else:
            pool[0] += a[k]
            pool[1] += b[k]
    if sum(pool):
        bins.append(tuple(pool))
    stat = 0.0
    for x, y in bins:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    dof = len(bins) - 1
    return (chi2_sf(stat, dof) if dof else 1.0), dof


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def engine(request) -> Engine:
    models = request.getfixturevalue("tiny_models" if request.param == "qwen3" else "tiny_hybrid_models")
    return Engine(EngineConfig(str(models / "target"), str(models / "draft"), tree_budget=16))


def _samples(engine: Engine, prompt: list[int], mode: str, seed0: int, **kw) -> tuple[list[list[int]], int]:
    outs, accepted = [], 0
    for s in range(N_SEEDS):
        toks, rounds = [], list(engine.generate(prompt, SamplingParams(
            max_new_tokens=4, seed=seed0 + s, mode=mode, **kw)))
        for r in rounds:
            toks += r.token_ids
        accepted += sum(r.accepted for r in rounds)
        outs.append(toks + [-1] * (4 - len(toks)))  # -1 marks "stopped before this position"
    return outs, accepted


@pytest.mark.parametrize("temperature,top_p,min_tokens", [(1.0, 1.0, 0), (0.8, 0.9, 0), (1.0, 1.0, 4)])
def test_tree_sampling_matches_target_distribution(engine, temperature, top_p, min_tokens):
    """min_tokens masks the stop tokens at tree nodes by their depth: the tree still samples the
    target's (masked) distribution, and no sample ends before min_tokens (without it the tiny hybrid
    ends about 1 sample in 60 within 4 tokens here)."""
    tok = engine.tokenizer
    # a word-pattern opening: many plausible continuations at every position, yet the drafter still
    # gets draft tokens accepted, so the tree (not only the bonus token) decides the output
    prompt = tok("cat dog", add_special_tokens=False)["input_ids"]
    kw = {"temperature": temperature, "top_p": top_p, "min_tokens": min_tokens}
    tree, accepted = _samples(engine, prompt, "ddtree", 10_000, **kw)
    plain, _ = _samples(engine, prompt, "ar", 50_000, **kw)
    if min_tokens:
        assert all(-1 not in o and not set(o) & engine.eos_ids for o in tree + plain)
    assert accepted > N_SEEDS // 2, "the tree must actually accept draft tokens for this to test anything"
    for pos in (1, 2, 3):  # 0-based: output positions 2, 3, 4
        p, dof = homogeneity_pvalue(Counter(o[pos] for o in tree), Counter(o[pos] for o in plain))
        print(f"\nT={temperature} top_p={top_p} position {pos + 1}: p={p:.3f} dof={dof}")
        assert dof >= 1, "degenerate distribution: the test would have no power"
        assert p > 1e-3
    # the same seed must reproduce the same tokens
    again, _ = _samples(engine, prompt, "ddtree", 10_000, **kw)
    assert again[:20] == tree[:20]


def test_top_p_truncates_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = adjusted_probs(logits, 1.0, 0.7)
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = adjusted_probs(logits, 1.0, 0.8)  # 0.5 + 0.3 reaches 0.8 exactly: the third is dropped
    assert probs[0, 2] == 0


def test_extreme_top_p_and_temperature_still_give_a_distribution():
    """The smallest top_p a client can send keeps the top token (rounding must not drop it), and a
    temperature near zero is the argmax (dividing by it would overflow to inf and NaN)."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    probs = adjusted_probs(logits, 1.0, 5e-324)
    assert torch.equal(probs.argmax(dim=-1), logits.argmax(dim=-1)) and torch.all(probs.amax(dim=-1) == 1)
    params = SamplingParams(max_new_tokens=1, temperature=5e-324)
    assert torch.equal(choose_tokens(logits, params, None), logits.argmax(dim=-1))

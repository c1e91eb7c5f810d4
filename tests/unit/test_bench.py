"""`ddops bench` pieces that need no host: mode parsing, the prompt file, the per-mode summary."""

from __future__ import annotations

import pytest

from ddops.bench import load_prompts, parse_modes, summarize
from ddops.errors import ConfigError, UsageError


def test_parse_modes():
    assert parse_modes("ar, dflash,ddtree:16,ddtree:16,ddtree") == [
        {"name": "ar", "mode": "ar", "tree_budget": None},
        {"name": "dflash", "mode": "dflash", "tree_budget": None},
        {"name": "ddtree:16", "mode": "ddtree", "tree_budget": 16},
        {"name": "ddtree", "mode": "ddtree", "tree_budget": None}]


@pytest.mark.parametrize("bad", ["beam", "ar:4", "ddtree:0", "ddtree:x", "", ","])
def test_parse_modes_rejects(bad):
    with pytest.raises(UsageError):
        parse_modes(bad)


def test_bundled_coding_set_has_ten_prompts():
    prompts = load_prompts(None)
    assert len(prompts) == 10 and len({p["id"] for p in prompts}) == 10


def test_prompt_file_errors_name_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n\n{"id": "x"}\n')
    with pytest.raises(ConfigError) as exc:
        load_prompts(f)
    assert exc.value.where == f"{f}:3"
    f.write_text('{"prompt": "hi"}\n{"prompt": "yo", "id": "b"}\n')
    assert load_prompts(f) == [{"id": "p1", "prompt": "hi"}, {"id": "b", "prompt": "yo"}]


def test_summarize_weights_acceptance_by_rounds_and_compares_with_ar():
    modes = parse_modes("ar,ddtree:16")
    rows = [
        {"prompt": "a", "mode": "ar", "seconds": 2.0, "completion_tokens": 20, "rounds": 20,
         "mean_acceptance_length": 1.0, "text": "x"},
        {"prompt": "a", "mode": "ddtree:16", "seconds": 1.0, "completion_tokens": 20, "rounds": 5,
         "mean_acceptance_length": 4.0, "text": "x"},
        {"prompt": "b", "mode": "ar", "seconds": 2.0, "completion_tokens": 20, "rounds": 20,
         "mean_acceptance_length": 1.0, "text": "y"},
        {"prompt": "b", "mode": "ddtree:16", "seconds": 1.0, "completion_tokens": 20, "rounds": 15,
         "mean_acceptance_length": 2.0, "text": "z"},
        {"prompt": "c", "mode": "ddtree:16", "seconds": 1.0, "error": "HTTP 500"},
    ]
    out = summarize(rows, modes)
    assert out["ar"]["tokens_per_s"] == 10.0
    dd = out["ddtree:16"]
    assert dd["tokens_per_s"] == 20.0 and dd["speedup_vs_ar"] == 2.0 and dd["errors"] == 1
    assert dd["mean_acceptance_length"] == 2.5  # (4*5 + 2*15) / 20
    assert (dd["same_text_as_ar"], dd["compared_with_ar"]) == (1, 2)


def test_percentile_is_nearest_rank():
    from ddops.bench import percentile
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0


def test_load_summary_is_aggregate_over_wall_time():
    from ddops.bench import summarize_load
    modes = parse_modes("ar,ddtree:16")
    rows = [{"prompt": "a", "mode": "ar", "seconds": 1.0, "ttft": 0.1, "completion_tokens": 10, "rounds": 10,
             "mean_acceptance_length": 1.0},
            {"prompt": "b", "mode": "ar", "seconds": 2.0, "ttft": 0.3, "completion_tokens": 30, "rounds": 30,
             "mean_acceptance_length": 1.0},
            {"prompt": "a", "mode": "ddtree:16", "seconds": 1.0, "ttft": 0.2, "completion_tokens": 40,
             "rounds": 10, "mean_acceptance_length": 4.0},
            {"prompt": "b", "mode": "ddtree:16", "seconds": 9.0, "error": "HTTP 429: queue full"}]
    out = summarize_load(rows, [{"mode": "ar", "wall_s": 2.0}, {"mode": "ddtree:16", "wall_s": 1.0}], modes)
    # two requests overlapped in 2 s of wall time: 40 tokens / 2 s, not 40 / (1 + 2)
    assert out["ar"]["tokens_per_s"] == 20.0 and out["ar"]["requests_per_s"] == 1.0
    assert out["ar"]["latency_p50_s"] == 1.0 and out["ar"]["latency_p99_s"] == 2.0
    assert out["ar"]["ttft_p99_s"] == 0.3 and out["ar"]["errors"] == 0
    assert out["ddtree:16"]["errors"] == 1 and out["ddtree:16"]["tokens_per_s"] == 40.0
    assert out["ddtree:16"]["mean_acceptance_length"] == 4.0


def test_requests_needs_concurrency():
    from ddops.bench import bench_spec
    prompts = [{"id": f"p{i}", "prompt": "x"} for i in range(10)]
    kw = dict(port=1, api_key=None, model=None, max_tokens=8, timeout=5, prompts=prompts, modes=parse_modes("ar"))
    assert bench_spec(**kw, concurrency=8)["requests"] == 16       # two per client
    assert bench_spec(**kw, concurrency=2)["requests"] == 10       # at least each prompt once
    assert bench_spec(**kw, concurrency=4, requests=7)["requests"] == 7
    with pytest.raises(UsageError, match="--requests goes with --concurrency"):
        bench_spec(**kw, requests=7)

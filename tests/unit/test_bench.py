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

"""/metrics through prometheus_client: the series keep the names and labels scrapes already use."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddtree_runtime.server.metrics import Metrics
from ddtree_runtime.server.timeline import Timeline


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_series_names_labels_and_values():
    m = Metrics()
    m.add_gauge("queue_depth", "Requests waiting.", lambda: 3)
    m.add_counter("prefix_cache_hits_total", "Hits.", lambda: 7)
    m.set_max_acceptance_length(4)  # nothing observed yet: the buckets follow the engine's block size
    m.observe_request("/v1/completions", 200, 0.02)
    m.observe_request("/v1/completions", 503, 0.3)
    m.observe_prefill(0.2, new_tokens=1)
    m.observe_round(0.004, acceptance_length=3, new_tokens=3)
    m.set_max_acceptance_length(8)  # too late: observed buckets never change under a scraper
    text = m.render()
    s = _samples(text)
    assert s[("ddtree_requests_total", (("endpoint", "/v1/completions"), ("status", "503")))] == 1
    assert s[("ddtree_request_duration_seconds_count", (("endpoint", "/v1/completions"),))] == 2
    assert s[("ddtree_generated_tokens_total", ())] == 4
    assert s[("ddtree_rounds_total", ())] == 1
    assert s[("ddtree_queue_depth", ())] == 3 and s[("ddtree_prefix_cache_hits_total", ())] == 7
    acceptance = {dict(k[1])["le"]: v for k, v in s.items() if k[0] == "ddtree_acceptance_length_bucket"}
    assert acceptance == {"1.0": 0, "2.0": 0, "3.0": 1, "4.0": 1, "+Inf": 1}
    assert s[("ddtree_round_duration_seconds_bucket", (("le", "0.005"),))] == 1
    assert "# TYPE ddtree_prefix_cache_hits_total counter" in text.splitlines()
    assert "_created" not in text


def test_two_servers_in_one_process_keep_their_own_series():
    first, second = Metrics(), Metrics()
    first.observe_round(0.01, 2, 2)
    assert _samples(second.render())[("ddtree_rounds_total", ())] == 0


def test_a_finished_requests_timeline_fills_its_stage_histograms():
    m = Metrics()
    timeline = Timeline(arrived=10.0, handed=10.002, submitted=10.003, admitted=10.2, first_token=10.3,
                        first_round=10.32, finished=11.0, rounds=40)
    m.observe_timeline(timeline)
    m.observe_timeline(Timeline(arrived=20.0, handed=20.001))  # cancelled in the queue: only what it reached
    s = _samples(m.render())
    assert s[("ddtree_request_prep_seconds_count", ())] == 2
    assert s[("ddtree_queue_wait_seconds_sum", ())] == pytest.approx(0.198)
    assert s[("ddtree_time_to_first_token_seconds_sum", ())] == pytest.approx(0.3)
    assert s[("ddtree_time_to_first_round_seconds_count", ())] == 1
    assert s[("ddtree_time_to_first_round_seconds_bucket", (("le", "0.5"),))] == 1
    assert timeline.intervals() == pytest.approx({"prep": 0.002, "handoff": 0.001, "queue": 0.197, "prefill": 0.1,
                                                  "to_round": 0.02, "rounds": 0.68})
    assert timeline.summary().startswith("timeline ms: prep 2.0, handoff 1.0, queue 197.0")


def test_rounds_by_tree_budget_are_one_counter_labelled_by_budget():
    from ddtree_runtime.engine.types import BatchStats
    from ddtree_runtime.server.app import create_app
    from ddtree_runtime.server.config import ServerConfig

    m = Metrics()
    budgets = {"0": 5, "16": 2}
    m.add_counters("rounds_by_tree_budget_total", "Rounds by budget.", "budget", lambda: budgets)
    s = _samples(m.render())
    assert s[("ddtree_rounds_by_tree_budget_total", (("budget", "0"),))] == 5
    assert s[("ddtree_rounds_by_tree_budget_total", (("budget", "16"),))] == 2
    # the app publishes the engine's chosen budgets (zeros before an engine loads)
    app = create_app(ServerConfig(target_dir="t"))
    s = _samples(app.state.ddtree.metrics.render())
    assert s[("ddtree_round_tree_budget", ())] == 0 and s[("ddtree_round_predicted_tokens_per_second", ())] == 0
    assert BatchStats().budget_rounds == {}

"""`ddops top`'s figures and alarms from fixture snapshots: windows from counter and histogram deltas,
and each alarm raised by the change that should raise it (and not by a steady host)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from ddops.alarms import host_alarms
from ddops.inventory import Expect, Host
from ddops.top import Reading, Sample, Thresholds, host_view, quantile, read_metrics, window

FIXTURE = Path(__file__).parent / "fixtures" / "top_ct200.json"   # a real facts probe answer with /metrics
INF = math.inf


def facts() -> dict:
    return json.loads(FIXTURE.read_text())


def replica(f: dict, unit: str) -> dict:
    return next(r for d in f["replicas"] for r in d["replicas"] if r["unit"] == unit)


def bump(f: dict, unit: str, name: str, by: float, **labels) -> None:
    """Add `by` to a sample of a replica's scrape (created when absent), and move its clock on 2 s."""
    scraped = replica(f, unit)["metrics"]
    for sample in scraped["samples"]:
        if sample[0] == name and all(sample[1].get(k) == v for k, v in labels.items()):
            sample[2] += by
            break
    else:
        scraped["samples"].append([name, dict(labels), by])


def later(f: dict, seconds: float = 2.0) -> dict:
    f = copy.deepcopy(f)
    for d in f["replicas"]:
        for r in d["replicas"]:
            r["metrics"]["at"] += seconds
    return f


def samples(*snapshots: dict) -> list[Sample]:
    return [Sample("ct200", float(i), facts=f) for i, f in enumerate(snapshots)]


def kinds(history: list[Sample], **thresholds) -> list[tuple[str, str | None]]:
    return [(a.kind, a.unit) for a in host_alarms("ct200", history, Thresholds(**thresholds))]


# -- the window math ---------------------------------------------------------------------------------

def test_quantiles_come_from_bucket_deltas_interpolated_inside_the_bucket():
    before = {0.1: 100.0, 0.5: 200.0, INF: 200.0}        # lifetime: 200 fast observations
    after = {0.1: 105.0, 0.5: 210.0, INF: 210.0}         # this window: 5 under 0.1 s, 5 in (0.1, 0.5]
    assert quantile(0.5, before, after) == pytest.approx(0.1)
    assert quantile(0.95, before, after) == pytest.approx(0.1 + 0.4 * 0.9)
    assert quantile(0.5, after, after) is None                                  # nothing observed
    assert quantile(0.5, {0.1: 0.0, INF: 0.0}, {0.1: 0.0, INF: 4.0}) == 0.1     # past the last bound
    # a restart (counts went down): the window is what the new process counted
    assert quantile(0.5, before, {0.1: 2.0, 0.5: 2.0, INF: 2.0}) == pytest.approx(0.05)


def test_rates_and_acceptance_are_over_the_window_not_the_lifetime():
    f0 = facts()
    base = read_metrics(replica(f0, "ddtree@1.service")["metrics"])
    f1 = later(f0)
    bump(f1, "ddtree@1.service", "ddtree_generated_tokens_total", 90)
    bump(f1, "ddtree@1.service", "ddtree_acceptance_length_sum", 30)     # 30 tokens over 20 rounds: 1.5
    bump(f1, "ddtree@1.service", "ddtree_acceptance_length_count", 20)
    bump(f1, "ddtree@1.service", "ddtree_requests_total", 2, endpoint="/v1/chat/completions", status="500")
    bump(f1, "ddtree@1.service", "ddtree_requests_total", 3, endpoint="/v1/chat/completions", status="429")
    bump(f1, "ddtree@1.service", "ddtree_requests_total", 5, endpoint="/health", status="503")  # not the service's
    w = window(base, read_metrics(replica(f1, "ddtree@1.service")["metrics"]))
    assert w.seconds == 2.0 and w.tokens_per_s == pytest.approx(45.0)
    assert w.acceptance == pytest.approx(1.5)
    assert base.acceptance_count > 0 and base.acceptance_sum / base.acceptance_count != pytest.approx(1.5)
    assert (w.errors_4xx, w.errors_5xx) == (3, 2)


def test_a_server_with_nothing_to_read_is_no_reading():
    assert read_metrics({"error": "HTTP 401", "at": 1.0, "samples": []}) is None
    assert read_metrics({"error": None, "at": 1.0, "samples": [["go_goroutines", {}, 3.0]]}) is None
    sglang = read_metrics({"error": None, "at": 1.0, "samples": [
        ["sglang:num_running_reqs", {"model_name": "m"}, 2.0], ["sglang:spec_accept_length", {}, 3.1],
        ["sglang:generation_tokens_total", {}, 10.0]]})
    assert isinstance(sglang, Reading) and sglang.kind == "sglang" and sglang.running == 2


# -- alarms ----------------------------------------------------------------------------------------

def test_a_steady_host_raises_nothing():
    f0 = facts()
    assert kinds(samples(f0, later(f0), later(f0, 4), later(f0, 6)), min_acceptance={("ct200", 8201): 1.5}) == []


def test_5xx_and_low_acceptance_in_the_window():
    f0 = facts()
    f1 = later(f0)
    bump(f1, "ddtree@2.service", "ddtree_requests_total", 1, endpoint="/v1/completions", status="500")
    bump(f1, "ddtree@1.service", "ddtree_acceptance_length_sum", 10)
    bump(f1, "ddtree@1.service", "ddtree_acceptance_length_count", 10)   # mean 1.0: the drafter is broken
    assert sorted(kinds(samples(f0, f1), min_acceptance={("ct200", 8201): 1.5})) == [
        ("5xx", "ddtree@2.service"), ("acceptance", "ddtree@1.service")]


def test_a_queue_growing_for_three_refreshes():
    snapshots = [facts()]
    for waiting in (1, 2, 3):
        f = later(snapshots[-1])
        bump(f, "ddtree@1.service", "ddtree_queue_depth", 1)
        snapshots.append(f)
    assert kinds(samples(*snapshots[:3])) == []         # two refreshes of growth: not yet
    assert kinds(samples(*snapshots)) == [("queue", "ddtree@1.service")]
    flat = later(snapshots[-1])
    assert kinds(samples(*snapshots[1:], flat)) == []   # it stopped growing


def test_a_restart_a_replica_out_of_the_balancer_and_a_stopped_unit():
    f0 = facts()
    f1 = later(f0)
    replica(f1, "ddtree@1.service")["state"]["MainPID"] += 1000
    replica(f1, "ddtree@2.service")["balancer"]["status"] = "DOWN"
    replica(f1, "ddtree@2.service")["state"]["ActiveState"] = "inactive"
    assert sorted(kinds(samples(f0, f1))) == [("balancer", "ddtree@2.service"), ("down", "ddtree@2.service"),
                                              ("restart", "ddtree@1.service")]


def test_gpu_memory_over_95_percent():
    f = facts()
    f["gpus"]["list"][3]["memory_used_mib"] = int(f["gpus"]["list"][3]["memory_total_mib"] * 0.96)
    assert kinds(samples(f)) == [("gpu-memory", None)]


def test_a_host_that_stops_answering_keeps_its_last_figures():
    host = Host(name="ct200", address="127.0.0.1", expect=Expect())
    f0 = facts()
    history = samples(f0, later(f0))
    view = host_view(host, history, in_flight_since=2.0, now=10.0, interval=2.0)
    assert view["state"] == "not answering" and view["error"] == "no answer for 8s"
    assert [t["unit"] for t in view["targets"]] == ["ddtree@1.service", "ddtree@2.service"]
    gone = history + [Sample("ct200", 12.0, error="cannot reach ct200: timed out", unreachable=True)]
    assert host_view(host, gone, None, 12.0, 2.0)["state"] == "unreachable"
    assert kinds(gone) == [("unreachable", None)]

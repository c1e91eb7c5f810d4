"""The `ddops bench` probe against a real ddtree-serve on the tiny models: it runs each mode through
the per-request override, and greedy speculative text equals AR's; a load run streams every request
to its end from several clients at once, and stops taking requests once nobody reads its output."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from ddops.bench import bench_spec, parse_modes, summarize, summarize_load
from ddops.probes import probe_source
from ddops.remote import PROGRESS_PREFIX
from ddtree_devtools.server_process import ServerProcess

pytestmark = pytest.mark.slow


def test_bench_probe_modes_and_losslessness(tiny_models):
    args = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
            "--served-model-name", "tiny"]
    with ServerProcess(args) as srv:
        srv.wait_ready()
        modes = parse_modes("ar,dflash,ddtree:4,ddtree:16")
        prompts = [{"id": "count", "prompt": "Count from 3 to 20."},
                   {"id": "add", "prompt": "What is 2+3?"}]
        spec = bench_spec(port=srv.port, api_key=None, model="tiny", max_tokens=32, timeout=60,
                          prompts=prompts, modes=modes)
        out = subprocess.run([sys.executable, "-c", probe_source("bench")], input=json.dumps(spec),
                             capture_output=True, text=True, timeout=300, check=True)
    said = [line for line in out.stdout.splitlines() if line.startswith(PROGRESS_PREFIX)]
    assert said[0] == PROGRESS_PREFIX + "1/8: count, ar" and said[-1] == PROGRESS_PREFIX + "8/8: add, ddtree:16"
    rows = report(out.stdout)["results"]
    assert len(rows) == len(prompts) * len(modes) and not any("error" in r for r in rows)
    overall = summarize(rows, modes)
    for name in ("dflash", "ddtree:4", "ddtree:16"):
        assert overall[name]["same_text_as_ar"] == len(prompts)
    assert overall["ddtree:16"]["mean_acceptance_length"] > 1.5
    assert overall["ar"]["mean_acceptance_length"] in (None, 1.0)


def test_bench_probe_load_run(tiny_models):
    args = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
            "--served-model-name", "tiny", "--max-running", "4"]
    with ServerProcess(args) as srv:
        srv.wait_ready()
        modes = parse_modes("ar,ddtree:16")
        prompts = [{"id": "count", "prompt": "Count from 3 to 20."}, {"id": "add", "prompt": "What is 2+3?"}]
        spec = bench_spec(port=srv.port, api_key=None, model="tiny", max_tokens=24, timeout=60,
                          prompts=prompts, modes=modes, concurrency=4, requests=6)
        out = subprocess.run([sys.executable, "-c", probe_source("bench")], input=json.dumps(spec),
                             capture_output=True, text=True, timeout=300, check=True)
    data = report(out.stdout)
    rows = data["results"]
    assert len(rows) == 6 * len(modes) and not any("error" in r for r in rows), rows
    assert [r["prompt"] for r in rows[:6]] == ["count", "add"] * 3   # the prompts in turn
    for r in rows:
        assert r["finish_reason"] in ("stop", "length") and r["completion_tokens"] > 0
        assert 0 < r["ttft"] <= r["seconds"]
    overall = summarize_load(rows, data["load"], modes)
    for name in ("ar", "ddtree:16"):
        o = overall[name]
        assert o["requests"] == 6 and o["errors"] == 0 and o["tokens_per_s"] > 0
        assert o["latency_p50_s"] <= o["latency_p99_s"] and o["ttft_p50_s"] <= o["latency_p99_s"]
    assert overall["ddtree:16"]["mean_acceptance_length"] > 1.5


def report(stdout: str) -> dict:
    """The probe's JSON, its progress lines (shown by the control machine as they come) left out."""
    return json.loads("".join(line for line in stdout.splitlines(keepends=True) if not line.startswith(PROGRESS_PREFIX)))


def test_a_load_run_whose_reader_went_away_stops(tiny_models):
    """`ddops bench` stopped mid-run closes its end of the pipe: the probe on the host must not keep
    loading the server for the rest of its requests."""
    args = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
            "--served-model-name", "tiny"]
    with ServerProcess(args) as srv:
        srv.wait_ready()
        spec = bench_spec(port=srv.port, api_key=None, model="tiny", max_tokens=8, timeout=60,
                          prompts=[{"id": "add", "prompt": "What is 2+3?"}], modes=parse_modes("ar"),
                          concurrency=2, requests=100000)
        probe = subprocess.Popen([sys.executable, "-c", probe_source("bench")], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        probe.stdin.write(json.dumps(spec))
        probe.stdin.close()
        first = probe.stdout.readline()
        assert first.startswith(PROGRESS_PREFIX + "ar: ") and "/100000 requests done" in first, first
        probe.stdout.close()                       # the control machine goes away
        assert probe.wait(timeout=30) != 0         # at its next progress line, well before 100000 requests
        time.sleep(0.5)
        served = requests_served(srv.url)
        time.sleep(1.5)
        assert requests_served(srv.url) == served   # and nothing loads the server any more


def requests_served(url: str) -> float:
    """The server's chat completions answered so far, from its /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ddtree_requests_total{") and "chat" in line)

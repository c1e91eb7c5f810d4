"""The `ddops bench` probe against a real ddtree-serve on the tiny models: it runs each mode through
the per-request override, and greedy speculative text equals AR's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddops.bench import bench_spec, parse_modes, summarize
from ddops.probes import probe_source
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
    rows = json.loads(out.stdout)["results"]
    assert len(rows) == len(prompts) * len(modes) and not any("error" in r for r in rows)
    overall = summarize(rows, modes)
    for name in ("dflash", "ddtree:4", "ddtree:16"):
        assert overall[name]["same_text_as_ar"] == len(prompts)
    assert overall["ddtree:16"]["mean_acceptance_length"] > 1.5
    assert overall["ar"]["mean_acceptance_length"] in (None, 1.0)

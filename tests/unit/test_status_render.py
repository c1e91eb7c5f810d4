"""How `ddops status` words a host's runtime health."""

from __future__ import annotations

import pytest

from ddops.status import _runtime_cell, _services_cell


@pytest.mark.parametrize("health, shown", [
    ({"healthy": True, "detail": {"status": "ok", "mode": "ddtree", "tree_budget": 16, "model": "Qwen3.6-27B",
                                  "target_arch": "qwen3_5"}}, "healthy Qwen3.6-27B (qwen3_5) ddtree@16"),
    ({"healthy": True, "detail": {"status": "ok", "mode": "dflash", "tree_budget": 16, "model": "tiny"}},
     "healthy tiny dflash"),
    ({"healthy": False, "detail": {"status": "error", "detail": "engine failed to start: ValueError: tree budget"}},
     "UNHEALTHY engine failed to start: ValueError: tree budget"),
    ({"healthy": True, "detail": {"status": "ok"}}, "healthy ok"),
    # a runtime behind an API key shows an anonymous caller only status, mode and block size
    ({"healthy": True, "detail": {"status": "ok", "mode": "ddtree", "block_size": 16}}, "healthy ddtree"),
    ({"healthy": False, "detail": "connection refused"}, "UNHEALTHY connection refused"),
])
def test_runtime_cell_says_what_is_served_or_why_not(health, shown):
    cell = _runtime_cell({"services": [], "runtime": [{"url": "http://127.0.0.1:8000/health", **health}]}).plain
    assert cell == f"http://127.0.0.1:8000/health: {shown}\n"


def test_a_unit_never_deployed_is_not_installed_not_unhealthy():
    record = {"services": [{"unit": "ddtree.service", "ActiveState": "inactive", "SubState": "dead",
                            "LoadState": "not-found"}],
              "runtime": [{"url": "http://127.0.0.1:8200/health", "unit": "ddtree.service", "healthy": False,
                           "detail": "[Errno 111] Connection refused"}]}
    assert _services_cell(record).plain == "ddtree.service: not installed\n"
    assert _runtime_cell(record).plain == "http://127.0.0.1:8200/health: - (ddtree.service not installed)\n"


def test_an_installed_unit_that_is_down_is_still_unhealthy():
    record = {"services": [{"unit": "ddtree.service", "ActiveState": "failed", "SubState": "failed",
                            "LoadState": "loaded"}],
              "runtime": [{"url": "http://127.0.0.1:8200/health", "unit": "ddtree.service", "healthy": False,
                           "detail": "[Errno 111] Connection refused"}]}
    assert _services_cell(record).plain == "ddtree.service: failed/failed\n"
    assert "UNHEALTHY [Errno 111] Connection refused" in _runtime_cell(record).plain

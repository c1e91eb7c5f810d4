"""How `ddops status` words a host's runtime health."""

from __future__ import annotations

import pytest

from ddops.status import _runtime_cell


@pytest.mark.parametrize("health, shown", [
    ({"healthy": True, "detail": {"status": "ok", "mode": "ddtree", "tree_budget": 16, "model": "Qwen3.6-27B",
                                  "target_arch": "qwen3_5"}}, "healthy Qwen3.6-27B (qwen3_5) ddtree@16"),
    ({"healthy": True, "detail": {"status": "ok", "mode": "dflash", "tree_budget": 16, "model": "tiny"}},
     "healthy tiny dflash"),
    ({"healthy": False, "detail": {"status": "error", "detail": "engine failed to start: ValueError: tree budget"}},
     "UNHEALTHY engine failed to start: ValueError: tree budget"),
    ({"healthy": True, "detail": {"status": "ok"}}, "healthy ok"),
    ({"healthy": False, "detail": "connection refused"}, "UNHEALTHY connection refused"),
])
def test_runtime_cell_says_what_is_served_or_why_not(health, shown):
    cell = _runtime_cell({"runtime": [{"url": "http://127.0.0.1:8000/health", **health}]}).plain
    assert cell == f"http://127.0.0.1:8000/health: {shown}\n"

"""A per-request tree budget the device cannot hold (issue 12, item 1), on the hybrid pair: its tree
scratch is per node, so a much bigger tree re-sizes the pool (an attention-only target's paged pool holds
any tree as it is, which the first test checks).

The refusal must leave the engine exactly as it was, and /health must not say ok once the engine cannot
serve. The app runs in this process (the engine loads on its worker thread here), so the device's free
memory and a failing allocation can be imitated by patching the engine module.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
from starlette.testclient import TestClient

from ddtree_runtime.engine import model_runner as runner_module
from ddtree_runtime.server.app import create_app
from ddtree_runtime.server.config import ServerConfig

pytestmark = pytest.mark.slow

BIG_TREE = {"mode": "ddtree", "tree_budget": 1024}  # far above the configured 16: the cache must grow


@contextmanager
def ready_app(models):
    """The app on a tiny pair, once its engine is ready."""
    config = ServerConfig(target_dir=str(models / "target"), draft_dir=str(models / "draft"),
                          served_model_name="tiny", max_tree_budget=1024)  # past the cap: the engine decides
    with TestClient(create_app(config), raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, client.get("/health").json()
            time.sleep(0.05)
        yield client


@pytest.fixture
def api(tiny_hybrid_models):
    """The hybrid pair, whose cache holds per-node tree scratch: a much bigger tree must re-size it."""
    with ready_app(tiny_hybrid_models) as client:
        yield client


@pytest.fixture
def attention_only(tiny_models):
    with ready_app(tiny_models) as client:
        yield client


def _complete(api: TestClient, speculative: dict | None = None):
    body = {"model": "tiny", "prompt": "1\n2\n3\n", "max_tokens": 6, "temperature": 0}
    return api.post("/v1/completions", json={**body, **({"speculative": speculative} if speculative else {})})


def test_an_attention_only_pool_serves_any_tree_without_a_re_size(attention_only, monkeypatch):
    """Its paged pool holds a tree of any budget as it is: nothing to allocate, nothing to refuse."""
    before = _complete(attention_only).json()["choices"][0]["text"]
    monkeypatch.setattr("ddtree_runtime.engine.memory.free_bytes", lambda device: 0)  # no headroom left on the device
    monkeypatch.setattr(runner_module, "target_cache", lambda *a, **k: pytest.fail("the pool was re-sized"))
    big = _complete(attention_only, BIG_TREE)
    assert big.status_code == 200, big.text
    assert big.json()["choices"][0]["text"] == before
    assert attention_only.get("/health").json()["status"] == "ok"


def test_refused_tree_budget_leaves_the_engine_serving(api, monkeypatch):
    before = _complete(api).json()["choices"][0]["text"]
    monkeypatch.setattr("ddtree_runtime.engine.memory.free_bytes", lambda device: 0)  # no headroom left on the device
    refused = _complete(api, BIG_TREE)
    assert refused.status_code == 400, refused.text
    assert "tree budget 1024" in refused.json()["error"]["message"]
    for mode in ("ddtree", "dflash", "ar"):  # every mode still served, with the same greedy text
        after = _complete(api, {"mode": mode})
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == before
    health = api.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_failed_reallocation_puts_the_old_cache_back(api, monkeypatch):
    build = runner_module.target_cache
    failures = []

    def fail_once(*args, **kwargs):
        if not failures:
            failures.append(True)
            raise RuntimeError("simulated out of memory")
        return build(*args, **kwargs)
    monkeypatch.setattr(runner_module, "target_cache", fail_once)
    assert _complete(api, BIG_TREE).status_code == 500  # the device failed, not the client
    assert api.get("/health").json()["status"] == "ok"
    assert _complete(api).status_code == 200


def test_health_is_error_when_the_engine_cannot_serve(api, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("simulated out of memory")
    monkeypatch.setattr(runner_module, "target_cache", fail)  # and putting the old cache back fails too
    assert _complete(api, BIG_TREE).status_code == 500
    health = api.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "error"
    assert "cannot serve" in health.json()["detail"]
    later = _complete(api)
    assert later.status_code == 503 and later.json()["error"]["type"] == "service_unavailable"
    metrics = api.get("/metrics").text.splitlines()
    assert "ddtree_engine_up 0.0" in metrics

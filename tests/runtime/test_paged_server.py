"""Pool exhaustion through HTTP: a server whose KV pool holds about one request at a time, sent six at
once, queues and preempts inside the engine and answers every one 200 with the text it gets alone;
/metrics counts the pages and the preemptions, /health says what the pool holds; a request the pool can
never hold is a 400."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn

from ddtree_runtime.engine import Engine, EngineConfig
from ddtree_runtime.server.app import create_app
from ddtree_runtime.server.config import ServerConfig
from ddtree_devtools.server_process import HOST, free_port

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
POOL_TOKENS = 128  # pages of 16: a request of ~20 prompt tokens, 32 new and one round's reservation fits


@pytest.fixture(scope="module")
def server(tiny_models):
    port = free_port()
    config = ServerConfig(target_dir=str(tiny_models / "target"), draft_dir=str(tiny_models / "draft"), host=HOST,
                          port=port, served_model_name="tiny", max_running=4, max_queue=8, prefix_cache=False,
                          kv_pool_tokens=POOL_TOKENS)
    engines = []

    def factory(cfg: ServerConfig) -> Engine:
        engines.append(Engine(EngineConfig(**cfg.engine_kwargs())))
        return engines[-1]

    srv = uvicorn.Server(uvicorn.Config(create_app(config, factory), host=HOST, port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health").json().get("status") == "ok":
                break
        except (httpx.TransportError, ValueError):
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)
    yield url, engines[0]
    srv.should_exit = True
    thread.join(10)


def _complete(url: str, i: int, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    body = {"model": "tiny", "prompt": f"{i}\n{i + 1}\n{i + 2}\n{i + 3}\n", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def _metrics(url: str) -> dict[str, float]:
    lines = httpx.get(url + "/metrics").text.splitlines()
    return {k: float(v) for k, v in (line.split(" ") for line in lines if line and not line.startswith("#")
                                     and "{" not in line)}


def test_pool_exhaustion_queues_and_preempts_never_a_5xx(server):
    url, engine = server
    alone = [_complete(url, i).json()["choices"][0]["text"] for i in range(6)]
    results: dict[int, httpx.Response] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _complete(url, i))) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(results) == list(range(6))
    assert [r.status_code for r in results.values()] == [200] * 6, [r.text for r in results.values()]
    assert [results[i].json()["choices"][0]["text"] for i in range(6)] == alone
    m = _metrics(url)
    assert m["ddtree_kv_pages_total"] == engine.pages.num_pages == POOL_TOKENS // 16
    assert m["ddtree_kv_pages_free"] == m["ddtree_kv_pages_total"] and m["ddtree_kv_pages_used"] == 0
    assert m["ddtree_preemptions_total"] == engine.stats.preemptions  # how many depends on arrival timing
    assert m["ddtree_graph_captures_total"] == engine.stats.graph_captures == 0  # the CPU captures none
    pool = httpx.get(url + "/health").json()["kv_pool"]
    assert pool["tokens"] == POOL_TOKENS and pool["page_size"] == 16 and pool["requests_full_context"] == 0


def test_a_request_the_pool_can_never_hold_is_a_400(server):
    url, _ = server
    r = _complete(url, 1, max_tokens=400)
    assert r.status_code == 400 and "KV pages" in r.json()["error"]["message"]

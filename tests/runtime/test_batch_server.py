"""The server batches: concurrent requests run together (up to --max-running), each with the text it
gets alone; past the running ones the bounded queue fills, then 429; /metrics and /health say how
many run and wait."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from ddtree_devtools.server_process import ServerProcess

pytestmark = pytest.mark.slow

MODES = [{"mode": "ddtree"}, {"mode": "ar"}, {"mode": "dflash"}, {"mode": "ddtree", "tree_budget": 4}]


@pytest.fixture(scope="module")
def server(tiny_models):
    args = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
            "--served-model-name", "tiny", "--max-running", "3", "--max-queue", "1"]
    with ServerProcess(args, faults=True) as srv:
        srv.wait_ready()
        yield srv


def _body(i: int, max_tokens: int = 24) -> dict:
    return {"model": "tiny", "prompt": f"{i}\n{i + 1}\n{i + 2}\n", "max_tokens": max_tokens, "temperature": 0,
            "speculative": MODES[i % len(MODES)]}


def _gauges(srv: ServerProcess) -> dict[str, float]:
    lines = httpx.get(srv.url + "/metrics").text.splitlines()
    return {k: float(v) for k, v in (line.split(" ") for line in lines if line and not line.startswith("#")
                                     and "{" not in line)}


def _wait(srv: ServerProcess, name: str, check, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while not check(value := _gauges(srv).get(name, -1)):
        assert time.monotonic() < deadline, f"{name} stayed at {value}"
        time.sleep(0.02)
    return value


def test_concurrent_requests_run_together_each_as_alone(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        alone = [c.post("/v1/completions", json=_body(i, 40)).json()["choices"][0]["text"] for i in range(4)]
        c.post("/_test/fault", json={"round_delay_s": 0.1})  # rounds slow enough to see the batch
        texts, seen_running = {}, []
        threads = [threading.Thread(target=lambda i=i: texts.__setitem__(
            i, c.post("/v1/completions", json=_body(i, 40)).json()["choices"][0]["text"])) for i in range(4)]
        for t in threads[:3]:
            t.start()
        seen_running.append(_wait(server, "ddtree_running_requests", lambda v: v == 3))
        threads[3].start()  # waits in the queue for a free slot
        assert _wait(server, "ddtree_batch_size", lambda v: v >= 2) <= 3
        health = c.get("/health").json()
        assert health["max_running"] == 3 and health["running"] <= 3
        for t in threads:
            t.join(60)
        c.post("/_test/fault", json={"round_delay_s": 0})
    assert [texts[i] for i in range(4)] == alone
    g = _gauges(server)
    assert g["ddtree_max_running_requests"] == 3 and g["ddtree_tokens_per_second"] > 0


def test_past_the_running_and_the_queue_is_429(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        c.post("/_test/fault", json={"round_delay_s": 0.2})
        long = {**_body(1, max_tokens=200), "speculative": {"mode": "ar"}}
        results = []
        threads = [threading.Thread(target=lambda: results.append(c.post("/v1/completions", json=long)))
                   for _ in range(4)]
        for t in threads[:3]:
            t.start()
        _wait(server, "ddtree_running_requests", lambda v: v == 3)
        threads[3].start()
        _wait(server, "ddtree_queue_depth", lambda v: v == 1)
        r = c.post("/v1/completions", json=long)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        c.post("/_test/fault", json={"round_delay_s": 0})
        for t in threads:
            t.join(60)
    assert [r.status_code for r in results] == [200] * 4

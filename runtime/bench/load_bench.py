"""End-to-end load through the HTTP server: N concurrent clients, a fixed number of requests, then stop.

    PYTHONPATH=runtime python runtime/bench/load_bench.py --target DIR --draft DIR [--max-running 16] \
        [--concurrency 1,8,16] [--requests 32] [--max-tokens 64] [--out F]
    PYTHONPATH=runtime python runtime/bench/load_bench.py --url http://HOST:PORT --concurrency 8 ...

With --target it starts ddtree-serve itself (testing.ServerProcess, 127.0.0.1, a free port) and stops it
at the end; with --url it drives a running server. Each client streams completions (temperature 0,
`stream_options.include_usage` for the token count) one after another until the fixed number is
done, after a warm-up round at the largest level (`--warm-up 0`: none, the server's own warm-up alone,
which should leave nothing to compile or capture). Per concurrency level it reports the aggregate
completion tokens/s (over the whole level, and over its window: from the first request's end to the
last one's start, when every client has a request in, which is what a server under steady load
delivers), time to first text and request latency (p50 / p99), the wall time against the first
level's, the requests refused, by status (a 429 when the queue is full is a refusal; a 5xx is a
defect), and the server's own means from its /metrics (server/timeline.py: tokenizing, queue wait,
time to first token and to first round, round time), so a client-side loss shows beside them, and the
CUDA graphs the server captured during the level (`ddtree_graph_captures_total`: shapes its start-up
warm-up did not reach, each a pause of every running request).
Random weights emit ids a bench tokenizer has no text for (start_bench.py's has a few hundred), so
their first text comes late: there time to first text measures the tokenizer, not the server (the
server's time_to_first_token does not depend on it). Not a test."""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def counting_openings() -> list[str]:
    """Plain counting openings: every request runs to max_tokens on the tiny models."""
    return ["".join(f"{i + j}\n" for j in range(4)) for i in range(50)]


def number_lines(n: int) -> str:
    """n lines of a short number each: the body of a prompt of a given length."""
    return "".join(f"{j % 100}\n" for j in range(n))


def sized_prompts(sizes: list[int], tokens_per_line: float) -> list[str]:
    """Prompts of about each of `sizes` tokens, taken in turn (number_lines, `tokens_per_line` as the
    server's tokenizer counts them: line_tokens()), each opening with its own line so that no two share a
    cached prefix."""
    return [f"request {i}\n" + number_lines(max(1, round(n / tokens_per_line))) for i, n in enumerate(sizes * 4)]


def line_tokens(url: str, model: str) -> float:
    """Tokens a line of number_lines() costs on the server's tokenizer: a 1,001-line prompt's usage against
    a one-line one's."""
    counts = []
    with httpx.Client(base_url=url, timeout=600) as client:
        for lines in (1, 1001):
            r = client.post("/v1/completions", json={"model": model, "prompt": number_lines(lines), "max_tokens": 1})
            r.raise_for_status()
            counts.append(r.json()["usage"]["prompt_tokens"])
    return (counts[1] - counts[0]) / 1000


def one_request(client: httpx.Client, body: dict) -> dict:
    """Stream one completion: time to first text, whole latency, completion tokens (a refusal: its status)."""
    started = time.perf_counter()
    first, tokens, prompt_tokens = None, 0, 0
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "latency_s": time.perf_counter() - started}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text") and first is None:
                first = time.perf_counter() - started
            if event.get("usage"):
                tokens, prompt_tokens = event["usage"]["completion_tokens"], event["usage"]["prompt_tokens"]
    ended = time.perf_counter()
    return {"status": 200, "ttft_s": first if first is not None else ended - started,
            "latency_s": ended - started, "tokens": tokens, "prompt_tokens": prompt_tokens, "span": (started, ended)}


def window_rate(results: list[dict], last_sent: float) -> float:
    """Tokens/s over the part of a level in which every client has a request in: from the first
    request's end to the last one's start (before it, the level's opening burst; after it, the level
    winds down). Each request's tokens count in proportion to its time inside that window."""
    start = min(r["span"][1] for r in results)
    if last_sent <= start:
        return 0.0
    inside = 0.0
    for r in results:
        a, b = r["span"]
        if b > a:
            inside += r["tokens"] * max(0.0, min(b, last_sent) - max(a, start)) / (b - a)
    return inside / (last_sent - start)


# The server's own account of a request's way (server/timeline.py), as means from /metrics: histogram
# sum over count, differenced across a level.
SERVER_STAGES = ("request_prep_seconds", "queue_wait_seconds", "time_to_first_token_seconds",
                 "time_to_first_round_seconds", "round_duration_seconds")
CAPTURES = "ddtree_graph_captures_total"


def scrape(client: httpx.Client) -> dict[str, float]:
    """The sums and counts of SERVER_STAGES' histograms and the graph captures (empty if the server has
    none of them)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = client.get("/metrics")
    if r.status_code != 200:
        return {}
    return {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples
            if s.name.removeprefix("ddtree_").removesuffix("_sum").removesuffix("_count") in SERVER_STAGES
            and s.name.endswith(("_sum", "_count")) or s.name == CAPTURES}


def stage_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    out = {}
    for name in SERVER_STAGES:
        key = f"ddtree_{name}"
        count = after.get(f"{key}_count", 0) - before.get(f"{key}_count", 0)
        if count > 0:
            out[name.removesuffix("_seconds")] = 1e3 * (after[f"{key}_sum"] - before.get(f"{key}_sum", 0)) / count
    return out


def load(url: str, concurrency: int, requests: int, bodies: list[dict]) -> dict:
    """`concurrency` clients take requests from one counter until `requests` are done."""
    results: list[dict] = []
    lock, taken, last_sent = threading.Lock(), [0], [0.0]

    def client_loop() -> None:
        with httpx.Client(base_url=url, timeout=600) as client:
            while True:
                with lock:
                    if taken[0] >= requests:
                        return
                    i = taken[0]
                    taken[0] += 1
                    if taken[0] == requests:
                        last_sent[0] = time.perf_counter()
                out = one_request(client, bodies[i % len(bodies)])
                with lock:
                    results.append(out)

    with httpx.Client(base_url=url, timeout=60) as client:
        before = scrape(client)
        started = time.perf_counter()
        threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        after = scrape(client)
    refused = [r["status"] for r in results if r["status"] != 200]
    results = [r for r in results if r["status"] == 200] or [{"ttft_s": wall, "latency_s": wall, "tokens": 0,
                                                               "span": (started, started + wall)}]
    tokens = sum(r["tokens"] for r in results)
    prompt_tokens = sorted({r.get("prompt_tokens", 0) for r in results})
    ttft, latency = [r["ttft_s"] for r in results], [r["latency_s"] for r in results]
    return {"concurrency": concurrency, "requests": len(results) + len(refused), "wall_s": wall, "tokens": tokens,
            "prompt_tokens": [prompt_tokens[0], prompt_tokens[-1]],
            "refused": {str(code): refused.count(code) for code in sorted(set(refused))},
            "tokens_per_s": tokens / wall, "window_tokens_per_s": window_rate(results, last_sent[0]),
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "latency_p50_s": percentile(latency, 0.5), "latency_p99_s": percentile(latency, 0.99),
            "latency_mean_s": statistics.fmean(latency), "server_ms": stage_means_ms(before, after),
            "graph_captures": after.get(CAPTURES, 0) - before.get(CAPTURES, 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url")
    where.add_argument("--target", help="start ddtree-serve on this target (with --draft)")
    ap.add_argument("--draft")
    ap.add_argument("--mode", default="ddtree")
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--server-arg", action="append", default=[], help="more ddtree-serve flags (repeatable)")
    ap.add_argument("--threads", type=int, help="the started server's CPU threads (OMP_NUM_THREADS; on a shared "
                    "CPU one thread gives steadier figures)")
    ap.add_argument("--concurrency", default="1,8,16")
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", help="prompts of about these many tokens, taken in turn by the requests "
                    "(e.g. 8192,512,512,512: one long context among short ones); default: a short counting opening")
    ap.add_argument("--warm-up", type=int, help="requests of the warm-up round, a client each (default: the "
                    "largest level; 0: none, the server's own warm-up alone)")
    ap.add_argument("--model", default="bench")
    ap.add_argument("--out", default="bench/results/runtime-load-bench.json")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    server = None
    url = args.url
    if args.target:
        from ddtree_devtools.server_process import ServerProcess

        flags = ["--target", args.target, "--mode", args.mode, "--served-model-name", args.model,
                 "--max-running", str(args.max_running), "--max-queue", str(max(levels) * 2), *args.server_arg]
        if args.draft:
            flags += ["--draft", args.draft]
        env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
        server = ServerProcess(flags, env=env).start()
        server.wait_ready()
        url = server.url
    try:
        sizes = [int(n) for n in args.prompt_tokens.split(",")] if args.prompt_tokens else []
        texts = sized_prompts(sizes, line_tokens(url, args.model)) if sizes else counting_openings()
        bodies = [{"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                   "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                  for prompt in texts]
        # warm-up at the largest level, a request a client: what the server's own warm-up did not reach
        # (a longer context's graphs, say) is captured here, not inside the first measured level
        warm = max(levels) if args.warm_up is None else args.warm_up
        if warm:
            load(url, warm, warm, bodies)
        results = []
        for c in levels:
            r = load(url, c, args.requests, bodies)
            results.append(r)
            print(json.dumps(r), flush=True)
    finally:
        if server is not None:
            server.stop()
    one = next((r for r in results if r["concurrency"] == 1), results[0])
    print(f"\n{'clients':>8}{'wall s':>9}{'tok/s':>9}{'window':>9}{'x 1 client':>11}{'ttft p50':>10}{'ttft p99':>10}"
          f"{'lat p50':>9}{'lat p99':>9}{'graphs':>8}")
    for r in results:
        speedup = r["tokens_per_s"] / one["tokens_per_s"]
        refused = ", ".join(f"{n} x {code}" for code, n in r["refused"].items())
        print(f"{r['concurrency']:>8}{r['wall_s']:>9.2f}{r['tokens_per_s']:>9.0f}{r['window_tokens_per_s']:>9.0f}"
              f"{speedup:>11.2f}{r['ttft_p50_s']:>10.3f}{r['ttft_p99_s']:>10.3f}{r['latency_p50_s']:>9.3f}"
              f"{r['latency_p99_s']:>9.3f}{r['graph_captures']:>8.0f}" + (f"  refused: {refused}" if refused else ""))
    print("server's means, ms (prep: arrival to the engine thread's hand-off; queue_wait: to admission; "
          "first token / first round: from arrival):")
    for r in results:
        print(f"{r['concurrency']:>8}  " + ", ".join(f"{k} {v:.1f}" for k, v in r["server_ms"].items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"url": args.url, "target": args.target, "mode": args.mode,
                               "max_running": args.max_running, "max_tokens": args.max_tokens, "warm_up": warm,
                               "prompt_tokens": args.prompt_tokens, "server_args": args.server_arg,
                               "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

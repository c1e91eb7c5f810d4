"""ddops-probe bench: greedy chat completions against the runtime on this host's loopback, once per
prompt and speculative mode (the per-request `speculative` override), timed here so the network to
the control machine is not in the figures.

Arguments come as JSON on stdin (they may hold the API key): port, api_key, model, max_tokens, timeout,
prompts [{id, prompt}], modes [{name, mode, tree_budget}], and for a load run concurrency and requests.
Prints {results: [...]}, one row per prompt and mode, in the order run (modes interleaved per prompt,
so drift hits every mode alike). With concurrency > 1, per mode: `requests` streamed requests (the
prompts in turn) from `concurrency` clients at once; each row also has the request's time to first
text, and {load: [{mode, wall_s}]} says how long each mode's run took in all. A run says its progress
(a load run every few seconds, one after another before each request); when that line cannot be
written (the control machine went away), no further request is sent, so a stopped `ddops bench` does
not leave its load running here.
"""
import json
import sys
import threading
import time

REPORT_EVERY_S = 2.0
# chat() and chat_stream() come from loopback_chat.py, say() from hostlib.py: probe_source() prepends both.


def speculative(mode):
    out = {"mode": mode["mode"]}
    if mode.get("tree_budget"):
        out["tree_budget"] = mode["tree_budget"]
    return out


def still_read(message):
    """Say a progress line; False when nobody reads this any more (the pipe to the control machine is gone)."""
    try:
        say(message)
    except OSError:
        return False
    return True


def load_run(spec, mode):
    """`requests` streamed requests from `concurrency` threads; returns (rows, wall seconds), or None
    when the control machine went away before the end."""
    prompts, total = spec["prompts"], spec["requests"]
    rows, taken, lock = [None] * total, [0], threading.Lock()
    finished, orphaned = threading.Event(), threading.Event()

    def client():
        while not orphaned.is_set():
            with lock:
                n = taken[0]
                taken[0] += 1
            if n >= total:
                return
            item = prompts[n % len(prompts)]
            out = chat_stream(spec, item["prompt"], spec["max_tokens"], speculative(mode), 300)
            row = {"prompt": item["id"], "mode": mode["name"], "seconds": round(out["seconds"], 4)}
            if "error" in out:
                row["error"] = out["error"]
            else:
                stats = out["usage"].get("speculative") or {}
                row.update(completion_tokens=out["usage"].get("completion_tokens") or 0,
                           finish_reason=out["finish_reason"], rounds=stats.get("rounds"),
                           mean_acceptance_length=stats.get("mean_acceptance_length"),
                           ttft=None if out["ttft"] is None else round(out["ttft"], 4))
            rows[n] = row

    def reporter():
        while not finished.wait(REPORT_EVERY_S):
            done = sum(1 for r in rows if r is not None)
            if not still_read("%s: %d/%d requests done, %.0f s" % (mode["name"], done, total, time.time() - started)):
                orphaned.set()
                return

    threads = [threading.Thread(target=client) for _ in range(min(spec["concurrency"], total))]
    started = time.time()
    watch = threading.Thread(target=reporter, daemon=True)
    for t in threads + [watch]:
        t.start()
    for t in threads:
        t.join()
    finished.set()
    return None if orphaned.is_set() else (rows, time.time() - started)


def main():
    spec = json.loads(sys.stdin.read())
    # warm up each mode once (the runtime captures its CUDA graphs on first use of a shape)
    for mode in spec["modes"]:
        chat(spec, spec["prompts"][0]["prompt"], 16, speculative(mode), 300)
    if spec.get("concurrency", 1) > 1:
        results, load = [], []
        for mode in spec["modes"]:
            run = load_run(spec, mode)
            if run is None:
                sys.exit(1)
            rows, wall = run
            results += rows
            load.append({"mode": mode["name"], "wall_s": round(wall, 4)})
        json.dump({"results": results, "load": load}, sys.stdout)
        return
    results, total = [], len(spec["prompts"]) * len(spec["modes"])
    for item in spec["prompts"]:
        for mode in spec["modes"]:
            if not still_read("%d/%d: %s, %s" % (len(results) + 1, total, item["id"], mode["name"])):
                sys.exit(1)
            data, elapsed, error = chat(spec, item["prompt"], spec["max_tokens"], speculative(mode), 300)
            row = {"prompt": item["id"], "mode": mode["name"], "seconds": round(elapsed, 4)}
            if error:
                row["error"] = error
            else:
                choice = (data.get("choices") or [{}])[0]
                usage = data.get("usage") or {}
                stats = usage.get("speculative") or {}
                row.update(completion_tokens=usage.get("completion_tokens") or 0,
                           finish_reason=choice.get("finish_reason"),
                           rounds=stats.get("rounds"),
                           mean_acceptance_length=stats.get("mean_acceptance_length"),
                           text=(choice.get("message") or {}).get("content") or "")
            results.append(row)
    json.dump({"results": results}, sys.stdout)


main()

"""ddops-probe bench: greedy chat completions against the runtime on this host's loopback, once per
prompt and speculative mode (the per-request `speculative` override), timed here so the network to
the control machine is not in the figures.

Arguments come as JSON on stdin (they may hold the API key): port, api_key, model, max_tokens, timeout,
prompts [{id, prompt}], modes [{name, mode, tree_budget}]. Prints {results: [...]}, one row per
prompt and mode, in the order run (modes interleaved per prompt, so drift hits every mode alike).
"""
import json
import sys
import time
import urllib.error
import urllib.request


def chat(spec, prompt, speculative, max_tokens):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "speculative": speculative}
    if spec.get("model"):
        body["model"] = spec["model"]
    headers = {"Content-Type": "application/json"}
    if spec.get("api_key"):
        headers["Authorization"] = "Bearer " + spec["api_key"]
    req = urllib.request.Request("http://127.0.0.1:%d/v1/chat/completions" % spec["port"],
                                 data=json.dumps(body).encode(), headers=headers, method="POST")
    started = time.time()
    try:
        with urllib.request.urlopen(req, timeout=spec.get("timeout", 300)) as resp:
            data = json.loads(resp.read().decode())
    except urllib.error.HTTPError as exc:
        return None, time.time() - started, "HTTP %d: %s" % (exc.code, exc.read(300).decode(errors="replace"))
    except (OSError, ValueError) as exc:
        return None, time.time() - started, str(getattr(exc, "reason", exc))
    return data, time.time() - started, None


def speculative(mode):
    out = {"mode": mode["mode"]}
    if mode.get("tree_budget"):
        out["tree_budget"] = mode["tree_budget"]
    return out


def main():
    spec = json.loads(sys.stdin.read())
    # warm up each mode once (the runtime captures its CUDA graphs on first use of a shape)
    for mode in spec["modes"]:
        chat(spec, spec["prompts"][0]["prompt"], speculative(mode), 16)
    results = []
    for item in spec["prompts"]:
        for mode in spec["modes"]:
            data, elapsed, error = chat(spec, item["prompt"], speculative(mode), spec["max_tokens"])
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

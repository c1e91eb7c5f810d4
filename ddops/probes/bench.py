"""ddops-probe bench: greedy chat completions against the runtime on this host's loopback, once per
prompt and speculative mode (the per-request `speculative` override), timed here so the network to
the control machine is not in the figures.

Arguments come as JSON on stdin (they may hold the API key): port, api_key, model, max_tokens, timeout,
prompts [{id, prompt}], modes [{name, mode, tree_budget}]. Prints {results: [...]}, one row per
prompt and mode, in the order run (modes interleaved per prompt, so drift hits every mode alike).
"""
import json
import sys
# chat() comes from loopback_chat.py, which probe_source() prepends to this script.


def speculative(mode):
    out = {"mode": mode["mode"]}
    if mode.get("tree_budget"):
        out["tree_budget"] = mode["tree_budget"]
    return out


def main():
    spec = json.loads(sys.stdin.read())
    # warm up each mode once (the runtime captures its CUDA graphs on first use of a shape)
    for mode in spec["modes"]:
        chat(spec, spec["prompts"][0]["prompt"], 16, speculative(mode), 300)
    results = []
    for item in spec["prompts"]:
        for mode in spec["modes"]:
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

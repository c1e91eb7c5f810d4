"""ddops-probe smoke: real chat completions against the runtime on this host's loopback.

Arguments come as JSON on stdin (they may hold the API key). For each prompt: a greedy completion
must be non-empty, match the expected answer, finish sanely and reach the acceptance floor; with the
lossless check, the same prompt with `speculative: {mode: ar}` must give the identical text.
"""
import json
import re
import sys
# chat() comes from loopback_chat.py, which probe_source() prepends to this script.


def check(spec, item):
    res = {"prompt": item["prompt"], "expect": item["expect"], "ok": False, "problems": []}
    data, elapsed, error = chat(spec, item["prompt"], spec["max_tokens"])
    if error:
        res["problems"].append("request failed: " + error)
        return res
    choice = (data.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") or ""
    usage = data.get("usage") or {}
    spec_stats = usage.get("speculative") or {}
    tokens = usage.get("completion_tokens") or 0
    res.update(text=text, finish_reason=choice.get("finish_reason"), completion_tokens=tokens,
               seconds=round(elapsed, 3), tokens_per_s=round(tokens / elapsed, 1) if elapsed > 0 else None,
               mean_acceptance_length=spec_stats.get("mean_acceptance_length"),
               rounds=spec_stats.get("rounds"))
    if not text.strip():
        res["problems"].append("empty answer")
    elif not re.search(item["expect"], text):
        res["problems"].append("answer %r does not match %r" % (text[:80], item["expect"]))
    if res["finish_reason"] not in ("stop", "length"):
        res["problems"].append("finish reason %r" % res["finish_reason"])
    floor = spec.get("min_acceptance") or 0
    if floor:
        mal = res["mean_acceptance_length"]
        if mal is None:
            res["problems"].append("no speculative stats in usage")
        elif mal < floor:
            res["problems"].append("mean acceptance length %.2f below the floor %.2f" % (mal, floor))
    if spec.get("lossless"):
        ar, ar_elapsed, error = chat(spec, item["prompt"], spec["max_tokens"], {"mode": "ar"})
        if error:
            res["problems"].append("ar request failed: " + error)
        else:
            ar_text = ((ar.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
            ar_tokens = (ar.get("usage") or {}).get("completion_tokens") or 0
            res["ar_text"] = ar_text
            res["ar_tokens_per_s"] = round(ar_tokens / ar_elapsed, 1) if ar_elapsed > 0 else None
            res["lossless"] = ar_text == text
            if ar_text != text:
                res["problems"].append("not lossless: ar gave %r, speculative gave %r" % (ar_text[:80], text[:80]))
    res["ok"] = not res["problems"]
    return res


def main():
    spec = json.loads(sys.stdin.read())
    results = [check(spec, item) for item in spec["prompts"]]
    json.dump({"ok": all(r["ok"] for r in results), "results": results}, sys.stdout)


main()

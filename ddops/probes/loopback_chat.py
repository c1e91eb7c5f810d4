"""Shared by the smoke and bench probes (probe_source prepends it to theirs): one greedy chat
completion against the runtime on this host's loopback, timed here."""
import json
import time
import urllib.error
import urllib.request


def chat(spec, prompt, max_tokens, speculative=None, default_timeout=120):
    """POST one greedy chat completion; returns (response JSON or None, seconds, error or None)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    if spec.get("model"):
        body["model"] = spec["model"]
    if speculative:
        body["speculative"] = speculative
    headers = {"Content-Type": "application/json"}
    if spec.get("api_key"):
        headers["Authorization"] = "Bearer " + spec["api_key"]
    req = urllib.request.Request("http://127.0.0.1:%d/v1/chat/completions" % spec["port"],
                                 data=json.dumps(body).encode(), headers=headers, method="POST")
    started = time.time()
    try:
        with urllib.request.urlopen(req, timeout=spec.get("timeout", default_timeout)) as resp:
            data = json.loads(resp.read().decode())
    except urllib.error.HTTPError as exc:
        return None, time.time() - started, "HTTP %d: %s" % (exc.code, exc.read(300).decode(errors="replace"))
    except (OSError, ValueError) as exc:
        return None, time.time() - started, str(getattr(exc, "reason", exc))
    return data, time.time() - started, None

"""Shared by the smoke and bench probes (probe_source prepends it to theirs): one greedy chat
completion against the runtime on this host's loopback, timed here, whole or streamed."""
import json
import time
import urllib.error
import urllib.request


def chat_request(spec, prompt, max_tokens, speculative=None, stream=False):
    """The HTTP request for one greedy chat completion (streamed: with the usage chunk at the end)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    if spec.get("model"):
        body["model"] = spec["model"]
    if speculative:
        body["speculative"] = speculative
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    headers = {"Content-Type": "application/json"}
    if spec.get("api_key"):
        headers["Authorization"] = "Bearer " + spec["api_key"]
    return urllib.request.Request("http://127.0.0.1:%d/v1/chat/completions" % spec["port"],
                                  data=json.dumps(body).encode(), headers=headers, method="POST")


def chat(spec, prompt, max_tokens, speculative=None, default_timeout=120):
    """POST one greedy chat completion; returns (response JSON or None, seconds, error or None)."""
    req = chat_request(spec, prompt, max_tokens, speculative)
    started = time.time()
    try:
        with urllib.request.urlopen(req, timeout=spec.get("timeout", default_timeout)) as resp:
            data = json.loads(resp.read().decode())
    except urllib.error.HTTPError as exc:
        return None, time.time() - started, "HTTP %d: %s" % (exc.code, exc.read(300).decode(errors="replace"))
    except (OSError, ValueError) as exc:
        return None, time.time() - started, str(getattr(exc, "reason", exc))
    return data, time.time() - started, None


def chat_stream(spec, prompt, max_tokens, speculative=None, default_timeout=120):
    """Stream one greedy chat completion; returns {seconds, ttft (to the first text), finish_reason,
    usage} or {seconds, error}. A stream that ends without [DONE] or a finish_reason is an error."""
    req = chat_request(spec, prompt, max_tokens, speculative, stream=True)
    started = time.time()
    out = {"ttft": None, "finish_reason": None, "usage": {}}
    done = False
    try:
        with urllib.request.urlopen(req, timeout=spec.get("timeout", default_timeout)) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    return {"seconds": time.time() - started, "error": str(chunk["error"].get("message"))}
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if out["ttft"] is None and (delta.get("content") or delta.get("reasoning_content")):
                        out["ttft"] = time.time() - started
                    out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
                out["usage"] = chunk.get("usage") or out["usage"]
    except urllib.error.HTTPError as exc:
        return {"seconds": time.time() - started,
                "error": "HTTP %d: %s" % (exc.code, exc.read(300).decode(errors="replace"))}
    except (OSError, ValueError) as exc:
        return {"seconds": time.time() - started, "error": str(getattr(exc, "reason", exc))}
    out["seconds"] = time.time() - started
    if not done or not out["finish_reason"]:
        out["error"] = "the stream ended early (no finish_reason or [DONE])"
    return out

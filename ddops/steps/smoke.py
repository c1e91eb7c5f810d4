"""Step 9, smoke test: real chat completions on the host's loopback (run there with its python3):
a checkable answer, a sane finish reason, the acceptance floor, tokens/s, and a lossless check."""

from __future__ import annotations

import time

from ..errors import StepFailed
from .base import PivotRun, run_probe


def smoke_spec(profile, secrets: dict[str, str]) -> dict:
    sm = profile.smoke
    return {"port": profile.port, "api_key": secrets.get("DDTREE_API_KEY"),
            "model": profile.serve.served_model_name, "max_tokens": sm.max_tokens,
            "min_acceptance": sm.min_acceptance if profile.engine == "ddtree" else 0,
            "lossless": sm.lossless_check, "timeout": sm.timeout_s,
            "prompts": [{"prompt": p.prompt, "expect": p.expect} for p in sm.prompts]}


class SmokeStep:
    name = "smoke"
    title = "Smoke test"

    def plan(self, run: PivotRun):
        return []

    def describe(self, run: PivotRun) -> str:
        sm = run.profile.smoke
        floor = f", mean acceptance >= {sm.min_acceptance:g}" if run.profile.engine == "ddtree" else ""
        return (f"{len(sm.prompts)} chat completion(s) on {run.host.name}'s loopback{floor}"
                + (", each checked identical to plain decoding" if sm.lossless_check else ""))

    def execute(self, run: PivotRun) -> str:
        p = run.profile
        started = time.monotonic()
        out = run_probe(run.executor, run.host, "smoke", stdin=smoke_spec(p, run.secrets),
                        timeout=p.smoke.timeout_s * len(p.smoke.prompts) * 2 + 30)
        out["seconds"] = round(time.monotonic() - started, 2)
        run.gates["smoke"] = out
        if not out["ok"]:
            problems = [f"{r['prompt']!r}: {'; '.join(r['problems'])}" for r in out["results"] if not r["ok"]]
            raise StepFailed(f"smoke test failed on {run.host.name}: {' | '.join(problems)}")
        results = out["results"]
        lossless = all(r.get("lossless") for r in results)
        return (f"{len(results)} prompt(s) answered as expected"
                + (", each identical to plain decoding" if lossless else "") + " (details below)")

"""The smoke test: real chat completions on the host's loopback (run there with its python3):
a checkable answer, a sane finish reason, the acceptance floor, tokens/s, and a lossless check."""

from __future__ import annotations

import time

from ..plan import RunContext
from ..profile import Profile
from ..remote import run_probe
from . import GateFailed, GateResult


def smoke_spec(profile: Profile, secrets: dict[str, str]) -> dict:
    sm = profile.smoke
    return {"port": profile.port, "api_key": secrets.get("DDTREE_API_KEY"),
            "model": profile.serve.served_model_name, "max_tokens": sm.max_tokens,
            "min_acceptance": sm.min_acceptance if profile.engine == "ddtree" else 0,
            "lossless": sm.lossless_check, "timeout": sm.timeout_s,
            "prompts": [{"prompt": p.prompt, "expect": p.expect} for p in sm.prompts]}


class SmokeGate:
    name = "smoke"
    title = "Smoke test"

    def describe(self, ctx: RunContext) -> str:
        sm = ctx.profile.smoke
        floor = f", mean acceptance >= {sm.min_acceptance:g}" if ctx.profile.engine == "ddtree" else ""
        return (f"{len(sm.prompts)} chat completion(s) on {ctx.host.name}'s loopback{floor}"
                + (", each checked identical to plain decoding" if sm.lossless_check else ""))

    def check(self, ctx: RunContext) -> GateResult:
        p = ctx.profile
        started = time.monotonic()
        out = run_probe(ctx.executor, ctx.host, "smoke", stdin=smoke_spec(p, ctx.secrets),
                        timeout=p.smoke.timeout_s * len(p.smoke.prompts) * 2 + 30)
        out["seconds"] = round(time.monotonic() - started, 2)
        if not out["ok"]:
            problems = [f"{r['prompt']!r}: {'; '.join(r['problems'])}" for r in out["results"] if not r["ok"]]
            raise GateFailed(f"smoke test failed on {ctx.host.name}: {' | '.join(problems)}", out)
        results = out["results"]
        lossless = all(r.get("lossless") for r in results)
        return GateResult(f"{len(results)} prompt(s) answered as expected"
                          + (", each identical to plain decoding" if lossless else "") + " (details below)", out)

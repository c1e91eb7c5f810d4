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
        each = f" on each of {ctx.profile.replicas.count} replica(s)" if ctx.profile.replicated else ""
        return (f"{len(sm.prompts)} chat completion(s){each} on {ctx.host.name}'s loopback{floor}"
                + (", each checked identical to plain decoding" if sm.lossless_check else ""))

    def check(self, ctx: RunContext) -> GateResult:
        if ctx.profile.replicated:
            return self.check_replicas(ctx)
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

    def check_replicas(self, ctx: RunContext) -> GateResult:
        """The same prompts on each replica's own port (the balancer would hide which one answered)."""
        p = ctx.profile
        started = time.monotonic()
        results, failed = [], []
        for replica in ctx.serving():
            ctx.progress(f"smoke on {replica.unit}")
            spec = {**smoke_spec(p, ctx.secrets), "port": replica.port}
            out = run_probe(ctx.executor, ctx.host, "smoke", stdin=spec,
                            timeout=p.smoke.timeout_s * len(p.smoke.prompts) * 2 + 30)
            results += [{**r, "replica": replica.unit} for r in out["results"]]
            failed += [f"{replica.unit} {r['prompt']!r}: {'; '.join(r['problems'])}" for r in out["results"] if not r["ok"]]
        out = {"ok": not failed, "results": results, "seconds": round(time.monotonic() - started, 2)}
        if failed:
            raise GateFailed(f"smoke test failed on {ctx.host.name}: {' | '.join(failed)}", out)
        lossless = all(r.get("lossless") for r in results)
        replicas = len({r["replica"] for r in results})
        return GateResult(f"{len(p.smoke.prompts)} prompt(s) answered as expected on {replicas} replica(s)"
                          + (", each identical to plain decoding" if lossless else "") + " (details below)", out)

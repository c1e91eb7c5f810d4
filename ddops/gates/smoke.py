"""The smoke test: real chat completions on the host's loopback (run there with its python3):
a checkable answer, a sane finish reason, the acceptance floor, tokens/s, and a lossless check."""

from __future__ import annotations

import os
import time

from ..plan import Checks, RunContext
from ..remote import run_probe
from . import GateContext, GateFailed, GateResult


def smoke_spec(checks: Checks, port: int, secrets: dict[str, str]) -> dict:
    """The smoke probe's stdin: the checks' prompts against `port` (the API key from the run's secrets,
    else from the variable the checks name)."""
    sm = checks.smoke
    api_key = secrets.get("DDTREE_API_KEY") or (os.environ.get(checks.bearer_env) if checks.bearer_env else None)
    return {"port": port, "api_key": api_key, "model": checks.served_model, "max_tokens": sm.max_tokens,
            "min_acceptance": sm.min_acceptance if checks.engine == "ddtree" else 0,
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

    def check(self, ctx: GateContext) -> GateResult:
        checks = ctx.checks
        if checks.replicated:
            return self.check_replicas(ctx)
        unit = ctx.serving()[0]
        started = time.monotonic()
        out = run_probe(ctx.executor, ctx.host, "smoke", stdin=smoke_spec(checks, unit.port, ctx.secrets),
                        timeout=probe_timeout(checks))
        out["seconds"] = round(time.monotonic() - started, 2)
        if not out["ok"]:
            problems = [f"{r['prompt']!r}: {'; '.join(r['problems'])}" for r in out["results"] if not r["ok"]]
            raise GateFailed(f"smoke test failed on {ctx.host.name}: {' | '.join(problems)}", out)
        results = out["results"]
        lossless = all(r.get("lossless") for r in results)
        return GateResult(f"{len(results)} prompt(s) answered as expected"
                          + (", each identical to plain decoding" if lossless else "") + " (details below)", out)

    def check_replicas(self, ctx: GateContext) -> GateResult:
        """The same prompts on each replica's own port (the balancer would hide which one answered)."""
        checks = ctx.checks
        started = time.monotonic()
        results, failed = [], []
        for replica in ctx.serving():
            ctx.progress(f"smoke on {replica.unit}")
            out = run_probe(ctx.executor, ctx.host, "smoke", stdin=smoke_spec(checks, replica.port, ctx.secrets),
                            timeout=probe_timeout(checks))
            results += [{**r, "replica": replica.unit} for r in out["results"]]
            failed += [f"{replica.unit} {r['prompt']!r}: {'; '.join(r['problems'])}" for r in out["results"] if not r["ok"]]
        out = {"ok": not failed, "results": results, "seconds": round(time.monotonic() - started, 2)}
        if failed:
            raise GateFailed(f"smoke test failed on {ctx.host.name}: {' | '.join(failed)}", out)
        lossless = all(r.get("lossless") for r in results)
        replicas = len({r["replica"] for r in results})
        return GateResult(f"{len(checks.smoke.prompts)} prompt(s) answered as expected on {replicas} replica(s)"
                          + (", each identical to plain decoding" if lossless else "") + " (details below)", out)


def probe_timeout(checks: Checks) -> float:
    """Room for every prompt, twice (the lossless check asks each one again), and the probe's start."""
    return checks.smoke.timeout_s * len(checks.smoke.prompts) * 2 + 30

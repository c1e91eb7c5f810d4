"""`ddops bench`: tokens/s and mean acceptance length per speculative mode against a deployed runtime.

The requests run on the host itself (the `bench` probe, over its loopback, like the pivot's smoke
step), so the figures are the server's and not the SSH link's. Each prompt is sent once per mode with
the per-request `speculative` override, greedy; with `ar` among the modes, each other mode's text is
also compared with AR's (greedy DDTree/DFlash are lossless, so they must match).

With `--concurrency N` it is a load run instead: per mode, N clients at once stream `--requests`
requests in all; the report gives aggregate tokens/s and the p50/p99 latency and time to first token."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from .credentials import read_secrets
from .errors import ConfigError, UsageError
from .executor import Executor
from .inventory import Host
from .profile import MODES, load_profile, resolve_profile
from .remote import run_probe

DEFAULT_MODES = "ar,dflash,ddtree:16,ddtree:64"


def parse_modes(text: str) -> list[dict[str, Any]]:
    """'ar,dflash,ddtree:16' -> [{name, mode, tree_budget}]."""
    out, seen = [], set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        mode, _, budget = part.partition(":")
        if mode not in MODES:
            raise UsageError(f"unknown mode {mode!r} in --modes", fix=f"use {', '.join(MODES)} (ddtree:BUDGET)")
        if budget and (mode != "ddtree" or not budget.isdigit() or int(budget) < 1):
            raise UsageError(f"bad mode {part!r} in --modes", fix="only ddtree takes a budget, e.g. ddtree:16")
        if part in seen:
            continue
        seen.add(part)
        out.append({"name": part, "mode": mode, "tree_budget": int(budget) if budget else None})
    if not out:
        raise UsageError("--modes is empty", fix=f"e.g. --modes {DEFAULT_MODES}")
    return out


def default_prompts_text() -> tuple[str, str]:
    return "ddops/data/coding10.jsonl", resources.files("ddops").joinpath("data/coding10.jsonl").read_text()


def load_prompts(path: Path | None) -> list[dict[str, str]]:
    """JSON lines with `prompt` (and optionally `id`); a bad line is a ConfigError naming file:line."""
    name, text = default_prompts_text() if path is None else (str(path), Path(path).read_text())
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"not JSON: {exc.msg}", where=f"{name}:{n}") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            raise ConfigError("each line needs a non-empty string `prompt`", where=f"{name}:{n}")
        prompts.append({"id": str(item.get("id") or f"p{len(prompts) + 1}"), "prompt": item["prompt"]})
    if not prompts:
        raise ConfigError("no prompts", where=name)
    return prompts


def mean_acceptance(rows: list[dict[str, Any]]) -> float | None:
    """The mean acceptance length over requests, each weighted by its rounds (None: no request had any)."""
    weighted = [(r["mean_acceptance_length"], r["rounds"]) for r in rows
                if r.get("mean_acceptance_length") is not None and r.get("rounds")]
    rounds = sum(n for _, n in weighted)
    return round(sum(a * n for a, n in weighted) / rounds, 3) if rounds else None


def summarize(rows: list[dict[str, Any]], modes: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode over all prompts: tokens/s (total tokens / total seconds), mean acceptance length
    (weighted by rounds), speed-up over ar, and how many texts equal ar's."""
    ar_text = {r["prompt"]: r.get("text") for r in rows if r["mode"] == "ar" and "error" not in r}
    overall: dict[str, Any] = {}
    for m in modes:
        mine = [r for r in rows if r["mode"] == m["name"]]
        ok = [r for r in mine if "error" not in r]
        tokens = sum(r["completion_tokens"] for r in ok)
        seconds = sum(r["seconds"] for r in ok)
        entry = {"prompts": len(mine), "errors": len(mine) - len(ok), "completion_tokens": tokens,
                 "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
                 "mean_acceptance_length": mean_acceptance(ok)}
        if m["mode"] != "ar" and ar_text:
            compared = [r for r in ok if r["prompt"] in ar_text]
            entry["same_text_as_ar"] = sum(r["text"] == ar_text[r["prompt"]] for r in compared)
            entry["compared_with_ar"] = len(compared)
        overall[m["name"]] = entry
    ar = next((overall[m["name"]] for m in modes if m["mode"] == "ar"), None)
    for entry in overall.values():
        if ar and ar["tokens_per_s"] and entry["tokens_per_s"]:
            entry["speedup_vs_ar"] = round(entry["tokens_per_s"] / ar["tokens_per_s"], 3)
    for r in rows:
        if r.get("seconds") and "error" not in r:
            r["tokens_per_s"] = round(r["completion_tokens"] / r["seconds"], 2)
    return overall


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile (q in 0-100): a value that was measured, never an interpolation."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize_load(rows: list[dict[str, Any]], load: list[dict[str, Any]],
                   modes: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode of a load run: aggregate tokens/s (all tokens over the run's wall time), requests/s,
    p50/p99 of each request's latency and time to first token, mean acceptance length by rounds."""
    wall = {entry["mode"]: entry["wall_s"] for entry in load}
    overall: dict[str, Any] = {}
    for m in modes:
        mine = [r for r in rows if r["mode"] == m["name"]]
        ok = [r for r in mine if "error" not in r]
        tokens = sum(r["completion_tokens"] for r in ok)
        seconds = wall.get(m["name"], 0)
        latency = [r["seconds"] for r in ok]
        ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
        overall[m["name"]] = {
            "requests": len(mine), "errors": len(mine) - len(ok), "completion_tokens": tokens,
            "wall_s": seconds, "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
            "requests_per_s": round(len(ok) / seconds, 3) if seconds else None,
            "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "mean_acceptance_length": mean_acceptance(ok)}
    return overall


def bench_spec(*, port: int, api_key: str | None, model: str | None, max_tokens: int, timeout: float,
               prompts: list[dict[str, str]], modes: list[dict[str, Any]], concurrency: int = 1,
               requests: int | None = None) -> dict[str, Any]:
    """What the probe runs. A load run (concurrency > 1) sends `requests` per mode, by default two
    per client and at least every prompt once."""
    spec = {"port": port, "api_key": api_key, "model": model, "max_tokens": max_tokens, "timeout": timeout,
            "prompts": prompts, "modes": modes, "concurrency": concurrency}
    if concurrency > 1:
        spec["requests"] = requests or max(2 * concurrency, len(prompts))
    elif requests is not None:
        raise UsageError("--requests goes with --concurrency N (N > 1)",
                         fix="add --concurrency, or drop --requests to send each prompt once per mode")
    return spec


def resolve_target(host: Host, profile_name: str | None, port: int | None,
                   api_key_env: str | None) -> tuple[int, str | None, str | None]:
    """(port, served model name, API key) for the bench: --port and --api-key-env first, then the
    profile's, then the host's first service with a port."""
    model, api_key = None, None
    if profile_name:
        profile = load_profile(resolve_profile(profile_name))
        port = port or profile.port
        model = profile.serve.served_model_name
        api_key = read_secrets(profile).get("DDTREE_API_KEY")
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise UsageError(f"${api_key_env} is not set", fix=f"export {api_key_env}=... or drop --api-key-env")
    if port is None:
        port = next((s.port for s in host.services if s.port), None)
        if port is None:
            raise UsageError(f"no port for {host.name}: its services list none", fix="pass --port or --profile")
    return port, model, api_key


def run_bench(executor: Executor, host: Host, spec: dict[str, Any],
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the bench probe on the host; a load run's progress lines go to `progress` as they come."""
    load = spec["concurrency"] > 1
    # requests one after another (a load run: waves of `concurrency`), each within the timeout
    waves = math.ceil(spec["requests"] / spec["concurrency"]) if load else len(spec["prompts"])
    n = waves * len(spec["modes"]) + len(spec["modes"])
    out = run_probe(executor, host, "bench", stdin=spec, timeout=spec["timeout"] * n + 60, progress=progress)
    rows = out["results"]
    overall = summarize_load(rows, out["load"], spec["modes"]) if load else summarize(rows, spec["modes"])
    report = {"host": host.name, "port": spec["port"], "max_tokens": spec["max_tokens"],
              "concurrency": spec["concurrency"], "modes": [m["name"] for m in spec["modes"]],
              "overall": overall, "results": [{k: v for k, v in r.items() if k != "text"} for r in rows]}
    if load:
        report["requests"] = spec["requests"]
    report["errors"] = sum(1 for r in rows if "error" in r)
    return report


def render(report: dict[str, Any], console) -> None:
    if report["concurrency"] > 1:
        render_load(report, console)
        return
    from rich.table import Table

    modes = report["modes"]
    table = Table(title=f"ddops bench on {report['host']} (max_tokens {report['max_tokens']}, greedy): "
                        "tokens/s (mean acceptance length)")
    table.add_column("prompt")
    for m in modes:
        table.add_column(m, justify="right")
    by = {(r["prompt"], r["mode"]): r for r in report["results"]}
    for p in dict.fromkeys(r["prompt"] for r in report["results"]):
        cells = []
        for m in modes:
            r = by.get((p, m), {})
            if not r:
                cells.append("-")
            elif "error" in r:
                cells.append("[red]error[/]")
            else:
                mal = r.get("mean_acceptance_length")
                cells.append(f"{r.get('tokens_per_s', 0):.1f}" + (f" ({mal:.2f})" if mal and m != "ar" else ""))
        table.add_row(p, *cells)
    cells = []
    for m in modes:
        o = report["overall"][m]
        mal = o.get("mean_acceptance_length")
        cells.append(f"[bold]{o['tokens_per_s'] or 0:.1f}[/]" + (f" ({mal:.2f})" if mal and not m == "ar" else "")
                     + (f" {o['speedup_vs_ar']:.2f}x" if o.get("speedup_vs_ar") and m != "ar" else ""))
    table.add_row("[bold]overall[/]", *cells)
    console.print(table)
    for m in modes:
        o = report["overall"][m]
        if "same_text_as_ar" in o and o["same_text_as_ar"] != o["compared_with_ar"]:
            console.print(f"[yellow]{m}: {o['same_text_as_ar']}/{o['compared_with_ar']} texts equal ar's "
                          "(greedy speculative decoding should match; bf16 near-ties can flip a token)[/]")
    if report["errors"]:
        first = next(r for r in report["results"] if "error" in r)
        console.print(f"[red]{report['errors']} request(s) failed; first: {first['mode']} on "
                      f"{first['prompt']}: {first['error']}[/]")


def render_load(report: dict[str, Any], console) -> None:
    from rich.table import Table

    table = Table(title=f"ddops bench on {report['host']}: {report['concurrency']} clients at once, "
                        f"{report['requests']} requests per mode (max_tokens {report['max_tokens']}, greedy)")
    for column in ("mode", "tokens/s", "requests/s", "latency p50", "p99", "first token p50", "p99",
                   "acceptance", "errors"):
        table.add_column(column, justify="left" if column == "mode" else "right")

    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}s"

    for name in report["modes"]:
        o = report["overall"][name]
        mal = o.get("mean_acceptance_length")
        table.add_row(name, f"[bold]{o['tokens_per_s'] or 0:.1f}[/]", f"{o['requests_per_s'] or 0:.2f}",
                      secs(o["latency_p50_s"]), secs(o["latency_p99_s"]), secs(o["ttft_p50_s"]),
                      secs(o["ttft_p99_s"]), f"{mal:.2f}" if mal else "-",
                      f"[red]{o['errors']}[/]" if o["errors"] else "0")
    console.print(table)
    if report["errors"]:
        first = next(r for r in report["results"] if "error" in r)
        console.print(f"[red]{report['errors']} request(s) failed; first: {first['mode']} on "
                      f"{first['prompt']}: {first['error']}[/]")

"""`ddops bench`: tokens/s and mean acceptance length per speculative mode against a deployed runtime.

The requests run on the host itself (the `bench` probe, over its loopback, like the pivot's smoke
step), so the figures are the server's and not the SSH link's. Each prompt is sent once per mode with
the per-request `speculative` override, greedy; with `ar` among the modes, each other mode's text is
also compared with AR's (greedy DDTree/DFlash are lossless, so they must match)."""

from __future__ import annotations

import json
import os
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
        weighted = [(r["mean_acceptance_length"], r["rounds"]) for r in ok
                    if r.get("mean_acceptance_length") is not None and r.get("rounds")]
        rounds = sum(n for _, n in weighted)
        entry = {"prompts": len(mine), "errors": len(mine) - len(ok), "completion_tokens": tokens,
                 "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
                 "mean_acceptance_length": round(sum(a * n for a, n in weighted) / rounds, 3) if rounds else None}
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


def bench_spec(*, port: int, api_key: str | None, model: str | None, max_tokens: int, timeout: float,
               prompts: list[dict[str, str]], modes: list[dict[str, Any]]) -> dict[str, Any]:
    return {"port": port, "api_key": api_key, "model": model, "max_tokens": max_tokens, "timeout": timeout,
            "prompts": prompts, "modes": modes}


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


def run_bench(executor: Executor, host: Host, spec: dict[str, Any]) -> dict[str, Any]:
    n = len(spec["prompts"]) * len(spec["modes"]) + len(spec["modes"])
    out = run_probe(executor, host, "bench", stdin=spec, timeout=spec["timeout"] * n + 60)
    rows = out["results"]
    report = {"host": host.name, "port": spec["port"], "max_tokens": spec["max_tokens"],
              "modes": [m["name"] for m in spec["modes"]], "overall": summarize(rows, spec["modes"]),
              "results": [{k: v for k, v in r.items() if k != "text"} for r in rows]}
    report["errors"] = sum(1 for r in rows if "error" in r)
    return report


def render(report: dict[str, Any], console) -> None:
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

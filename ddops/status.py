"""`ddops status`: every selected host at a glance, gathered in parallel, one round trip each."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, HostUnreachable
from .executor import CommandTimeout, Executor, Outcome
from .facts import check_identity, gather, tensor_parallel
from .gpuhealth import style as health_style
from .gpuhealth import summary as gpu_summary
from .gpuhealth import words as health_words
from .history import unfinished_words
from .hostlock import describe, liveness
from .inventory import Host


def collect(executor: Executor, hosts: list[Host]) -> list[dict[str, Any]]:
    """One status record per host, in inventory order; an unreachable host is a record too."""
    outcomes = executor.fan_out(hosts, lambda h: _gather(executor, h))
    return [_record(h, outcomes[h.name]) for h in hosts]


def _gather(executor: Executor, host: Host) -> dict[str, Any]:
    """The facts probe, a few seconds' work: one that never finishes means the host (or its sshd) froze."""
    try:
        return gather(executor, host)
    except CommandTimeout as exc:
        raise HostUnreachable(f"{host.name} stopped answering during the facts probe: {exc.what}",
                              fix="check the host (a frozen sshd or a full disk?), then retry") from None


def _record(host: Host, outcome: Outcome[dict[str, Any]]) -> dict[str, Any]:
    record: dict[str, Any] = {"host": host.name, "reached_as": host.label, "reachable": not outcome.unreachable,
                              "error": outcome.error.line() if outcome.error else None,
                              "identity": None, "gpus": [], "gpu_error": None, "driver": None, "gpu_health": [],
                              "kernel_log": None, "training": None,
                              "services": [], "runtime": [], "replicas": [], "pivot": None}
    if outcome.value is None:
        return record
    facts = outcome.value
    identity = check_identity(host.expect, facts)
    record.update(identity=asdict(identity), gpus=facts["gpus"]["list"], gpu_error=facts["gpus"]["error"],
                  training=facts["training"], services=facts["services"], runtime=facts["runtime"],
                  replicas=facts.get("replicas") or [], pivot=pivot_state(host.name, facts.get("pivot")),
                  **gpu_summary(facts))
    return record


def pivot_state(host: str, found: dict[str, Any] | None) -> dict[str, Any] | None:
    """The host's pivot lock and journal in one word and one line: running (a live run holds both),
    unfinished (a journal whose run is gone: the host may be half-changed), locked, stale-lock."""
    if not found or (found.get("journal") is None and found.get("lock") is None):
        return None
    journal, holder = found.get("journal"), found.get("lock")
    dead = liveness(holder, found.get("lease_left_s")) if holder is not None else "no run holds the lock"
    if journal is not None and not (found.get("same_run") and dead is None):
        return {"state": "unfinished", "line": f"UNFINISHED PIVOT on {host} ({unfinished_words(journal)}): the host "
                                               f"may be half-changed; `ddops rollback --host {host}` restores the "
                                               "state from before it"}
    if journal is not None:
        return {"state": "running", "line": f"pivot in progress on {host}: {unfinished_words(journal)}"}
    if dead is None:
        return {"state": "locked", "line": f"{host} is locked by a running ddops: {describe(holder)}"}
    return {"state": "stale-lock", "line": f"STALE LOCK on {host}: {describe(holder)} ({dead}); the next pivot "
                                           "clears it with --break-lock"}


def exit_code(records: list[dict[str, Any]]) -> int:
    if any(not r["reachable"] for r in records):
        return EXIT_UNREACHABLE
    if any(r["error"] or (r["identity"] and not r["identity"]["ok"]) for r in records):
        return EXIT_FAILED
    if any((r.get("pivot") or {}).get("state") == "unfinished" for r in records):
        return EXIT_FAILED
    return EXIT_OK


def render(records: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="ddops status", show_lines=True)
    for column in ("host", "identity", "GPUs", "training", "services", "runtime"):
        table.add_column(column, overflow="fold")
    for r in records:
        table.add_row(Text(r["host"], style="bold"), _identity_cell(r), _gpu_cell(r), _training_cell(r),
                      _services_cell(r), _runtime_cell(r))
    console.print(table)
    for r in records:
        for deployment in r.get("replicas") or []:
            console.print(replicas_table(r["host"], deployment))
    for r in records:
        if r.get("pivot"):
            style = "bold red" if r["pivot"]["state"] in ("unfinished", "stale-lock") else "yellow"
            console.print(Text(r["pivot"]["line"], style=style), soft_wrap=True)
    for r in records:
        if r["identity"] and not r["identity"]["ok"]:
            console.print(f"[bold red]IDENTITY MISMATCH on {r['host']}: "
                          f"{'; '.join(r['identity']['mismatches'])}. ddops will change nothing there.[/]")


def _identity_cell(r: dict[str, Any]) -> Text:
    if not r["reachable"] or r["identity"] is None:
        return Text(f"UNREACHABLE\n{r['error']}" if not r["reachable"] else f"ERROR\n{r['error']}",
                    style="bold red")
    ident = r["identity"]
    if not ident["ok"]:
        return Text("MISMATCH\n" + "\n".join(ident["mismatches"]), style="bold white on red")
    return Text(f"ok: {ident['hostname']}", style="green")


def _gpu_cell(r: dict[str, Any]) -> Text:
    if r["gpu_error"]:
        expected = (r["identity"] or {}).get("expected", {})
        gpus_expected = expected.get("gpu_count") or expected.get("gpu_model")
        return Text(r["gpu_error"], style="yellow") if gpus_expected else Text("none", style="dim")
    gpus = r["gpus"]
    if not gpus:
        return Text("none", style="dim")
    used = sum(g["memory_used_mib"] or 0 for g in gpus)
    total = sum(g["memory_total_mib"] or 0 for g in gpus)
    names = sorted({g["name"] for g in gpus})
    text = Text(f"{len(gpus)}x {', '.join(names)}\n{used / 1024:.0f}/{total / 1024:.0f} GiB used")
    driver = r["driver"] or {}
    text.append(f"\ndriver {driver.get('version') or 'unknown'}")
    health = r["gpu_health"]
    text.append(f"\nhealth {health_words(health)}", style=health_style(health))
    return text


def _training_cell(r: dict[str, Any]) -> Text:
    t = r["training"]
    if not t:
        return Text("-", style="dim")
    if not t["running"]:
        step = f", last step {t['last_step']}" if t["last_step"] is not None else ""
        return Text(f"stopped{step}", style="dim")
    return Text(f"pid {t['pid']} running {t['elapsed_s']:.0f}s\nstep {t['last_step']}", style="cyan")


def not_installed(r: dict[str, Any]) -> set[str]:
    """Units systemd has no file for: never deployed here (or removed), which is not a failure."""
    return {s["unit"] for s in r["services"] if s.get("LoadState") == "not-found"}


def _services_cell(r: dict[str, Any]) -> Text:
    text = Text()
    missing = not_installed(r)
    health = {h.get("unit"): h for h in r["runtime"]}
    for s in r["services"]:
        if s["unit"] in missing:
            text.append(f"{s['unit']}: not installed\n", style="dim")
            continue
        state = s.get("ActiveState") or "unknown"
        style = {"active": "green", "failed": "bold red", "activating": "yellow"}.get(state, "dim")
        restarts = f" restarts={s['NRestarts']}" if s.get("NRestarts") else ""
        tp = tensor_parallel(s, health.get(s["unit"]))
        spans = f" TP {tp}" if tp is not None else ""
        text.append(f"{s['unit']}: {state}/{s.get('SubState')}{restarts}{spans}\n", style=style)
    return text or Text("-", style="dim")


def _runtime_cell(r: dict[str, Any]) -> Text:
    text = Text()
    missing = not_installed(r)
    for h in r["runtime"]:
        if h.get("unit") in missing and not h["healthy"]:
            text.append(f"{h['url']}: - ({h['unit']} not installed)\n", style="dim")
            continue
        word = "healthy" if h["healthy"] else "UNHEALTHY"
        load = f"; {load_summary(h)}" if h["healthy"] and load_summary(h) else ""
        text.append(f"{h['url']}: {word} {_health_summary(h)}".rstrip() + load + "\n",
                    style="green" if h["healthy"] else "red")
    return text or Text("-", style="dim")


def _health_summary(h: dict[str, Any]) -> str:
    """What a healthy DDTree runtime serves (model, target family, mode and budget); else why not."""
    detail = h["detail"]
    if not isinstance(detail, dict):
        return str(detail)
    if not h["healthy"] or "mode" not in detail:
        return str(detail.get("detail") or detail.get("status") or "")
    arch = f" ({detail['target_arch']})" if detail.get("target_arch") else ""
    # a runtime with an API key shows a caller without it only status, mode and block size
    budget = detail.get("tree_budget")
    mode = detail["mode"] + (f"@{budget}" if detail["mode"] == "ddtree" and budget is not None else "")
    return f"{detail.get('model', '')}{arch} {mode}".strip()


def load_summary(h: dict[str, Any]) -> str:
    """Running requests over the capacity, and the paged pool's pages where the runtime reports them;
    "" when /health does not say (a runtime with an API key shows its load only to callers with it)."""
    detail = h.get("detail")
    if not isinstance(detail, dict) or detail.get("max_running") is None:
        return ""
    line = f"running {detail.get('running', 0)}/{detail['max_running']}"
    pool = h.get("pool") or {}
    used, free = pool.get("ddtree_kv_pages_used"), pool.get("ddtree_kv_pages_free")
    if used is not None and free is not None:
        line += f", pages {used:g}/{used + free:g} used"
    return line


def replicas_table(host: str, deployment: dict[str, Any]) -> Table:
    """One replicated deployment: the balancer's endpoint, then each replica's unit, health and how
    HAProxy sees it (UP, DRAIN, DOWN...)."""
    bal = deployment["balancer"]
    public = "healthy" if bal["health"]["healthy"] else "UNHEALTHY " + _health_summary(bal["health"])
    state = (bal["state"] or {}).get("ActiveState") or "unknown"
    table = Table(title=f"{deployment['template']} on {host} ({deployment.get('profile')}): "
                        f"{bal['unit']} {state} on port {bal['port']}, {public}"
                        + (f" ({bal['error']})" if bal.get("error") else ""))
    for column in ("replica", "port", "GPUs", "TP", "unit", "runtime", "running", "in HAProxy"):
        table.add_column(column, overflow="fold")
    for rep in deployment["replicas"]:
        unit = rep["state"] or {}
        active = unit.get("ActiveState") or "unknown"
        restarts = f" restarts={unit['NRestarts']}" if unit.get("NRestarts") else ""
        health = rep["health"]
        seen = (rep.get("balancer") or {}).get("status") or "-"
        tp = tensor_parallel(unit, health)
        table.add_row(rep["unit"], str(rep["port"]), ",".join(map(str, rep.get("gpus") or [])) or "-",
                      "-" if tp is None else str(tp),
                      Text(f"{active}/{unit.get('SubState')}{restarts}",
                           style={"active": "green", "failed": "bold red"}.get(active, "yellow")),
                      Text(("healthy " if health["healthy"] else "UNHEALTHY ") + _health_summary(health),
                           style="green" if health["healthy"] else "red"),
                      Text(load_summary(health).removeprefix("running ") or "-"),
                      Text(seen, style="green" if seen == "UP" else "yellow"))
    return table

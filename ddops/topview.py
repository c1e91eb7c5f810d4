"""Showing `ddops top`'s frames: a live screen on a terminal (`q` quits), one block per refresh when
piped, one JSON object a line with --json. Nothing here talks to a host: frames come from `top.Poller`."""

from __future__ import annotations

import json
import os
import select
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .gpuhealth import style as health_style
from .gpuhealth import words as health_words

STATE_STYLE = {"ok": "green", "waiting": "dim", "not answering": "bold yellow", "unreachable": "bold red",
               "error": "bold red"}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f}"


def _num(value: float | None, fmt: str = "{:g}") -> str:
    return "-" if value is None else fmt.format(value)


def _gpus(gpus: list[dict[str, Any]]) -> str:
    if not gpus:
        return "-"
    cells = []
    for g in gpus:
        used, total = g.get("memory_used_mib") or 0, g.get("memory_total_mib") or 0
        cells.append(f"{_num(g.get('utilization_pct'))}/{100 * used / total:.0f}" if total else "-")
    used = sum(g.get("memory_used_mib") or 0 for g in gpus) / 1024
    total = sum(g.get("memory_total_mib") or 0 for g in gpus) / 1024
    return f"{' '.join(cells)}  ({used:.0f}/{total:.0f} GiB)"


def _training(t: dict[str, Any] | None) -> str:
    if not t:
        return "-"
    loss = f" loss {t['loss']:g}" if t.get("loss") is not None else ""
    ckpt = f" ckpt {t['checkpoint_step']}" if t.get("checkpoint_step") is not None else ""
    return f"{'running' if t['running'] else 'stopped'} step {_num(t.get('step'))}{ckpt}{loss}"


def hosts_table(frame: dict[str, Any]) -> Table:
    table = Table(title=None, box=None, header_style="bold", pad_edge=False)
    for column in ("HOST", "STATE", "GPUS util%/mem% each", "GPU HEALTH", "DRIVER", "TRAINING", "PROBE ms"):
        table.add_column(column, overflow="fold")
    for h in frame["hosts"]:
        state = h["state"] + (f": {h['error']}" if h["error"] else "")
        if h["identity"] is False:
            state += " (IDENTITY MISMATCH)"
        health = h.get("gpu_health") or []
        table.add_row(Text(h["host"], style="bold"), Text(state, style=STATE_STYLE.get(h["state"], "")),
                      _gpus(h["gpus"]), Text(health_words(health), style=health_style(health) if health else ""),
                      (h.get("driver") or {}).get("version") or "-", _training(h["training"]), _ms(h["probe_s"]))
    return table


def targets_table(frame: dict[str, Any]) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("HOST", "UNIT", "PORT", "TP", "STATE", "RUN/CAP", "WAIT", "TOK/S", "ACCEPT", "TTFT p50/p95 ms",
                   "ROUND p50/p95 ms", "4XX", "5XX", "LB"):
        table.add_column(column, no_wrap=True)
    for h in frame["hosts"]:
        stale = h["state"] != "ok"
        for t in h["targets"]:
            w = t["window"] or {}
            state = (t["active"] or "-") + ("" if t["healthy"] else f" ({t['health'] or 'unhealthy'})")
            style = "dim" if stale else ("green" if t["healthy"] and t["active"] in ("active", None) else "red")
            capacity = f"{_num(t['running'])}/{_num(t['capacity'])}" if t["capacity"] is not None else _num(t["running"])
            table.add_row(h["host"], t["unit"], str(t["port"]), _num(t.get("tensor_parallel")), Text(state, style=style),
                          capacity,
                          _num(t["waiting"]), _num(w.get("tokens_per_s"), "{:.1f}"),
                          _num(w.get("acceptance"), "{:.2f}"),
                          f"{_ms(w.get('ttft_p50_s'))}/{_ms(w.get('ttft_p95_s'))}",
                          f"{_ms(w.get('round_p50_s'))}/{_ms(w.get('round_p95_s'))}",
                          _num(w.get("errors_4xx")),
                          Text(_num(w.get("errors_5xx")), style="bold red" if w.get("errors_5xx") else ""),
                          Text(t["balancer"] or "-", style="" if (t["balancer"] or "UP").startswith("UP") else "bold red"))
    return table


def render_frame(frame: dict[str, Any], *, live: bool = False) -> Group:
    stamp = time.strftime("%H:%M:%S", time.localtime(frame["time"]))
    title = f"ddops top  {stamp}  every {frame['interval_s']:g}s  {len(frame['hosts'])} host(s)"
    parts: list[Any] = [Text(title + ("   q quits" if live else ""), style="bold"), hosts_table(frame), Text(""),
                        targets_table(frame)]
    alarms = frame["alarms"]
    parts.append(Text(f"\nALARMS ({len(alarms)})" if alarms else "\nno alarms", style="bold red" if alarms else "green"))
    for a in alarms:
        parts.append(Text(f"  {a['kind']:<11} {a['host']}: {a['text']}", style="red"))
    return Group(*parts)


def json_line(frame: dict[str, Any]) -> str:
    return json.dumps(frame, default=str, separators=(",", ":"))


@contextmanager
def _keys() -> Iterator[Callable[[float], str | None]]:
    """Single keys from the terminal without Enter (cbreak), restored on the way out; a reader that
    waits up to `timeout` seconds for one."""
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read(timeout: float) -> str | None:
        ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
        return os.read(fd, 1).decode(errors="replace") if ready else None

    try:
        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run_live(next_frame: Callable[[], dict[str, Any]], interval: float, console: Console,
             count: int | None = None) -> dict[str, Any]:
    """The screen, redrawn every `interval` until `q` (or `count` refreshes); returns the last frame."""
    from rich.live import Live

    frame = next_frame()
    refreshes = 1
    with _keys() as key, Live(render_frame(frame, live=True), console=console, screen=True,
                              auto_refresh=False) as live:
        deadline = time.monotonic() + interval
        while count is None or refreshes < count:
            pressed = key(deadline - time.monotonic())
            if pressed in ("q", "Q"):
                break
            if pressed is not None and time.monotonic() < deadline:
                continue
            frame = next_frame()
            refreshes += 1
            live.update(render_frame(frame, live=True), refresh=True)
            deadline = time.monotonic() + interval
    return frame


def run_stream(next_frame: Callable[[], dict[str, Any]], interval: float, console: Console, *, as_json: bool,
               count: int | None = None, stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """Piped: one block (or JSON line) per refresh, until `count` refreshes or interrupted."""
    refreshes = 0
    frame: dict[str, Any] = {}
    while count is None or refreshes < count:
        started = time.monotonic()
        frame = next_frame()
        refreshes += 1
        if as_json:
            print(json_line(frame), flush=True)
        else:
            console.print(render_frame(frame))
            console.print("-" * 40)
            console.file.flush()
        if stop() or (count is not None and refreshes >= count):
            break
        time.sleep(max(0.0, interval - (time.monotonic() - started)))
    return frame

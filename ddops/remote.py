"""Running ddops's scripts and a few plain commands on a host, below every step.

A probe (read-only) or an action (a change) is one script sent as `python3 -c TEXT`, its arguments as
argv JSON, or as stdin JSON when they may hold secrets; it prints one JSON object back.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from .errors import DdopsError, StepFailed
from .executor import CommandResult, Executor
from .inventory import Host
from .probes import probe_source


# A script's progress line on stdout (actions that wait say what they wait for); the rest is its JSON.
PROGRESS_PREFIX = "ddops-progress: "


def run_probe(executor: Executor, host: Host, name: str, args: Any = None, *, stdin: Any = None,
              timeout: float | None = None, python: str = "python3",
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run probe or action `name` on host; return its JSON. Its progress lines go to `progress` as they come."""
    argv = [python, "-c", probe_source(name)]
    if args is not None:
        argv.append(json.dumps(args))
    pending = [""]

    def on_output(chunk: str) -> None:
        lines = (pending[0] + chunk).split("\n")
        pending[0] = lines.pop()
        for line in lines:
            if line.startswith(PROGRESS_PREFIX):
                progress(line[len(PROGRESS_PREFIX):])

    result = executor.run(host, argv, timeout=timeout, stdin=json.dumps(stdin) if stdin is not None else None,
                          **({"on_output": on_output} if progress is not None else {}))
    if not result.ok:
        detail = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise StepFailed(f"probe {name} failed on {host.name} (exit {result.exit_code}): {detail}")
    stdout = "\n".join(line for line in result.stdout.splitlines() if not line.startswith(PROGRESS_PREFIX))
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        raise StepFailed(f"probe {name} on {host.name} printed something that is not JSON: "
                         f"{result.stdout[:120]!r}", fix="check the login shell prints nothing") from None


def check(result: CommandResult, what: str) -> None:
    """Raise StepFailed naming the host and the command's last lines when it failed."""
    if not result.ok:
        detail = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-3:]
        raise StepFailed(f"{what} failed on {result.host} (exit {result.exit_code}): {' | '.join(detail)}")


def write_file_argv(path: str, size: int) -> list[str]:
    """A command that writes its stdin to `path` on the host atomically (a temp file, then a rename),
    creating the folder if needed. The rename waits for all `size` bytes: a sender killed mid-push ends
    the stream early, which `cat` takes for the end of the file, and a short copy must never land."""
    script = ('mkdir -p "$(dirname "$1")" || exit 1; cat > "$1.tmp" || { rm -f "$1.tmp"; exit 1; }; '
              'got=$(stat -c %s "$1.tmp"); '
              'if [ "$got" != "$2" ]; then rm -f "$1.tmp"; echo "got $got of $2 bytes for $1" >&2; exit 1; fi; '
              'mv "$1.tmp" "$1"')
    return ["bash", "-c", script, "_", path, str(size)]


def write_file(executor: Executor, host: Host, path: str, data: bytes | str, *,
               timeout: float | None = None) -> CommandResult:
    """Push `data` to `path` on host, atomically and only whole (write_file_argv)."""
    payload = data.encode() if isinstance(data, str) else data
    return executor.run(host, write_file_argv(path, len(payload)), stdin=payload, timeout=timeout)


def journal_argv(unit: str, lines: int = 30) -> list[str]:
    return ["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "short-iso"]


def unit_installed(executor: Executor, host: Host, unit: str) -> bool:
    """Whether systemd on host has a unit file for `unit` (a journal outlives its unit)."""
    result = executor.run(host, ["systemctl", "show", unit, "--property=LoadState", "--value"], timeout=30)
    return result.stdout.strip() not in ("not-found", "")


def journal_tail(executor: Executor, host: Host, unit: str, lines: int = 30) -> str:
    try:
        result = executor.run(host, journal_argv(unit, lines), timeout=30)
    except DdopsError as exc:
        return f"(journal unavailable: {exc.line()})"
    return result.stdout.strip()

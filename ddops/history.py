"""History: one JSON line per pivot or rollback, appended to a file on the host itself."""

from __future__ import annotations

import getpass
import json
import socket
import time
from typing import Any

from .executor import Executor
from .inventory import Host
from .paths import HISTORY_PATH, STATE_DIR

_SECRET_WORDS = ("key", "token", "secret", "password")


def who() -> dict[str, str]:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        user = "unknown"
    return {"user": user, "control_host": socket.gethostname()}


def scrub(value: Any) -> Any:
    """Drop anything that looks like a secret before it is written anywhere."""
    if isinstance(value, dict):
        return {k: ("***" if any(w in str(k).lower() for w in _SECRET_WORDS) and isinstance(v, str) else scrub(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


def append_argv() -> list[str]:
    return ["bash", "-c", 'mkdir -p "$1" && cat >> "$2"', "_", STATE_DIR, HISTORY_PATH]


def append(executor: Executor, host: Host, record: dict[str, Any]) -> None:
    record = scrub({"time": time.time(), **who(), **record})
    executor.run(host, append_argv(), stdin=json.dumps(record, default=str) + "\n", timeout=30).check(
        "appending to the history")


def read(executor: Executor, host: Host) -> list[dict[str, Any]]:
    result = executor.run(host, ["bash", "-c", 'cat -- "$1" 2>/dev/null || true', "_", HISTORY_PATH], timeout=30)
    records = []
    for line in result.stdout.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records

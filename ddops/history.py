"""History: one JSON line per pivot or rollback, appended to a file on the host itself."""

from __future__ import annotations

import getpass
import json
import socket
import time
from typing import Any

from .executor import Executor
from .inventory import Host
from .paths import HISTORY_PATH, JOURNAL_PATH, STATE_DIR

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
    """The host's records, oldest first; an open journal of intent (a pivot in progress, or one that
    never finished) comes last, as a record of outcome `unfinished`."""
    result = executor.run(host, ["bash", "-c", 'cat -- "$2" 2>/dev/null; j=$(cat -- "$1" 2>/dev/null) && '
                                               'printf \'{"journal": %s}\\n\' "$j"; true', "_", JOURNAL_PATH,
                                 HISTORY_PATH], timeout=30)
    records = []
    for line in result.stdout.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and set(record) == {"journal"}:
            record = unfinished_record(record["journal"])
        records.append(record)
    return records


def unfinished_record(journal: Any) -> dict[str, Any]:
    journal = journal if isinstance(journal, dict) else {"unreadable": True}
    return {"time": journal.get("opened_at", 0), "kind": "pivot", "outcome": "unfinished",
            "profile": journal.get("profile"), "unit": journal.get("unit"), "user": journal.get("user"),
            "control_host": journal.get("control_host"),
            "state": f"unfinished: {unfinished_words(journal)}; if no run is in progress, `ddops rollback` "
                     "restores the state from before it"}


def unfinished_words(journal: dict[str, Any]) -> str:
    """An unfinished pivot in words: which profile, who, when, how far it got."""
    if journal.get("unreadable"):
        return f"its journal {JOURNAL_PATH} cannot be read"
    step = journal.get("step")
    return (f"{journal.get('profile')} by {journal.get('user')}@{journal.get('control_host')} pid "
            f"{journal.get('pid')}, started {journal.get('started_at')}"
            + (f", got as far as {step}" if step else ", before its first change"))

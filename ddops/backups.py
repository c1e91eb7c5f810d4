"""A unit's backups on its host (`paths.backup_root`): listed with what each holds and whether it can
be trusted, and chosen for a restore.

A backup is a folder of copies and a `meta.json` recording their checksums (the `unitfile` action). A
backup whose meta.json is missing or does not parse, or whose copies do not match their recorded
checksums, is `damaged` (with why): listed as such, never restored, and never skipped in silence.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from .errors import UsageError
from .executor import Executor
from .inventory import Host
from .paths import backup_root, env_path, replicas_manifest, unit_path
from .remote import run_probe

ROLLBACK_REASON = "rollback"   # meta.reason of the backup a rollback takes of what it replaces


def new_backup_id() -> str:
    """Sortable by time (UTC), unique enough for one host."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(2)


def list_backups(executor: Executor, host: Host, unit: str) -> list[dict[str, Any]]:
    """Oldest first: {"id", "meta"} and, for a damaged one, {"damaged": why}."""
    return run_probe(executor, host, "unitfile", stdin={"action": "list", "backup_root": backup_root(unit)})


def discard_backup(executor: Executor, host: Host, unit: str, backup_id: str) -> bool:
    """Remove a backup that no change used (a pivot that ended with nothing changed); whether it is gone."""
    out = run_probe(executor, host, "unitfile", stdin={"action": "discard", "backup_root": backup_root(unit),
                                                      "backup_id": backup_id})
    return bool(out.get("discarded"))


def restore_spec(unit: str, backup_id: str, save_as: str | None = None) -> dict[str, Any]:
    """The unitfile action's restore; `save_as`: first back up what it replaces under this id."""
    spec = {"action": "restore", "unit": unit, "unit_path": unit_path(unit), "env_path": env_path(unit),
            "backup_root": backup_root(unit), "backup_id": backup_id}
    if save_as is not None:
        spec["save_as"] = save_as
    return spec


def choose_backup(executor: Executor, host: Host, unit: str, backup_id: str | None) -> dict[str, Any]:
    """The backup to restore: `backup_id`, else the newest one a change (not a rollback) took. A damaged
    one is refused with why; it is never passed over for an older one."""
    backups = list_backups(executor, host, unit)
    if not backups:
        raise UsageError(f"no backups of {unit} on {host.name}", fix="nothing to roll back to")
    if backup_id is None:
        candidates = [b for b in backups if (b.get("meta") or {}).get("reason") != ROLLBACK_REASON]
        if not candidates:
            raise UsageError(f"no backup of {unit} on {host.name} was taken by a pivot (only by rollbacks)",
                             fix=f"name one with --to (see ddops rollback --host {host.name} --list)")
        chosen = candidates[-1]
    else:
        chosen = next((b for b in backups if b["id"] == backup_id), None)
        if chosen is None:
            raise UsageError(f"no backup {backup_id!r} of {unit} on {host.name}",
                             fix=f"known: {', '.join(b['id'] for b in backups)}")
    if chosen.get("damaged"):
        older = [b["id"] for b in backups if not b.get("damaged") and b["id"] < chosen["id"]]
        raise UsageError(f"backup {chosen['id']} of {unit} on {host.name} is damaged ({chosen['damaged']}): "
                         "it is not restored",
                         fix=(f"restore an older one with --to {older[-1]}" if older else "no older backup is intact")
                         + f" (ddops rollback --host {host.name} --list shows them all)")
    return chosen


def read_manifest(executor: Executor, host: Host, template: str) -> dict[str, Any] | None:
    """The replicas manifest the last install left on the host, or None."""
    result = executor.run(host, ["cat", replicas_manifest(template)], timeout=30)
    if not result.ok:
        return None
    try:
        return json.loads(result.stdout)
    except ValueError:
        return None


def is_active(executor: Executor, host: Host, unit: str) -> bool:
    return executor.run(host, ["systemctl", "is-active", unit], timeout=30).stdout.strip() in ("active", "activating",
                                                                                              "reloading")

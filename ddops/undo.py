"""The undos the pivot's steps record: one small dataclass per kind of change, each with one `apply`.

An undo puts back at once what it can (a unit's files, the runtime release) and asks the rollback's
context to bring back what must run again: a restored unit to restart, replicas to cycle, a unit the
pivot stopped to start. The rollback (ddops.rollback) applies a journal's undos newest first, then
brings those back and gates them; it never looks at an undo's kind. A step with a new kind of change
adds its undo here (or beside the step) and leaves the rollback alone.

Each kind is plain data, so a pivot writes its undos into the host's journal of intent before it
changes anything (`as_record`), and a rollback after a crash reads them back (`from_record`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .backups import choose_backup, is_active, new_backup_id, read_manifest, restore_spec
from .errors import StepFailed
from .plan import Undo, UndoTarget
from .remote import run_probe, write_file


@dataclass(frozen=True)
class StartAgain(Undo):
    """The undo of stopping a unit (training, a conflicting server): start it again once the rest is back."""

    unit: str

    def apply(self, ctx: UndoTarget) -> None:
        ctx.start_again(self.unit)


@dataclass(frozen=True)
class Reinstall(Undo):
    """The undo of shipping a runtime release: the one before it back into the venv, with its record.
    Applied before every other undo: each unit brought back must start on the code it ran before."""

    previous: dict[str, str]    # release, python, wheel (on the host), record (path), record_text

    first = True

    def apply(self, ctx: UndoTarget) -> None:
        p = self.previous
        ctx.progress(f"reinstalling ddtree-runtime {p['release']} (the release before the pivot)")
        ctx.executor.run(ctx.host, [p["python"], "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
                                    "--force-reinstall", "-q", p["wheel"]], timeout=600).check(
            f"reinstalling ddtree-runtime {p['release']} from {p['wheel']}")
        write_file(ctx.executor, ctx.host, p["record"], p["record_text"]).check(
            "restoring the runtime release record")
        ctx.report["reinstalled"] = p["release"]


@dataclass(frozen=True)
class RestoreBackup(Undo):
    """The undo of installing a unit: its backed-up files (or their absence) put back, what the backup
    says ran before started again. A restored plain unit is restarted; a template's replicas restart
    where `every_replica` (`ddops rollback`), else only those a rolling restart replaced (they record
    their own undo). `backup_id` None: the newest backup."""

    unit: str
    backup_id: str | None = None
    every_replica: bool = False

    def apply(self, ctx: UndoTarget) -> None:
        chosen = choose_backup(ctx.executor, ctx.host, self.unit, self.backup_id)
        meta = chosen["meta"]
        ctx.report.update(host=ctx.host.name, unit=self.unit, backup_id=chosen["id"], meta=meta)
        if "@." in self.unit:
            self.restore_template(ctx, chosen["id"], meta)
        else:
            self.restore_unit(ctx, chosen["id"], meta)
        for other in meta.get("restart_after_rollback") or []:
            ctx.start_again(other, checked=True)

    def restore_unit(self, ctx: UndoTarget, backup_id: str, meta: dict[str, Any]) -> None:
        ctx.progress(f"restoring {self.unit} from backup {backup_id}")
        # Stop the current unit first: the restored one may be absent, or use the same port.
        ctx.executor.run(ctx.host, ["systemctl", "stop", self.unit], timeout=120)
        out = self.put_back(ctx, backup_id)
        if meta.get("unit_existed"):
            ctx.restart(self.unit)
        else:
            ctx.executor.run(ctx.host, ["systemctl", "disable", self.unit], timeout=60)
            ctx.executor.run(ctx.host, ["systemctl", "reset-failed", self.unit], timeout=60)
            # removed only if there was one (a pivot may have died before it installed anything)
            ctx.report["removed"] = out["before"].get("unit") is not None
        ctx.restored[self.unit] = out["after"].get("unit")

    def restore_template(self, ctx: UndoTarget, backup_id: str, meta: dict[str, Any]) -> None:
        """The template's files (its replicas' env files, the balancer's config, the manifest) back;
        HAProxy reloaded if its config changed; replicas the backup did not run stopped."""
        ex, host = ctx.executor, ctx.host
        ctx.progress(f"restoring {self.unit} and its replicas from backup {backup_id}")
        current = read_manifest(ex, host, self.unit)
        out = self.put_back(ctx, backup_id)
        restored = read_manifest(ex, host, self.unit) if meta.get("unit_existed") else None
        was_running = set(meta.get("replicas_before") or [])
        keep = [r["unit"] for r in (restored or {}).get("replicas", []) if r["unit"] in was_running]
        known = {r["unit"] for r in (current or {}).get("replicas", []) + (restored or {}).get("replicas", [])}
        for unit in sorted(known - set(keep)):
            if is_active(ex, host, unit):
                ctx.progress(f"stopping {unit} (not running before)")
                ex.run(host, ["systemctl", "disable", "--now", unit], timeout=120)
                ctx.report.setdefault("stopped", []).append(unit)
        bal = (restored or current or {}).get("balancer")
        if bal and bal["config"] in out.get("changed", []) and is_active(ex, host, bal["unit"]):
            result = ex.run(host, ["systemctl", "reload", bal["unit"]], timeout=120)
            if not result.ok:
                raise StepFailed(f"reloading {bal['unit']} with the restored config failed on {host.name}: "
                                 f"{result.stderr.strip()[-200:]}")
            ctx.report["balancer_reloaded"] = True
        if restored is None:
            ctx.report["removed"] = True
        ctx.restored[self.unit] = out["after"].get("unit")
        if self.every_replica:
            for unit in keep:
                ctx.cycle(self.unit, unit)

    def put_back(self, ctx: UndoTarget, backup_id: str) -> dict[str, Any]:
        """The backup's files back, after the action has checked them against their checksums and
        backed up what they replace (`saved_as`: a backup like any other, listed by --list)."""
        out = run_probe(ctx.executor, ctx.host, "unitfile", stdin=restore_spec(self.unit, backup_id, new_backup_id()))
        if out.get("refused"):
            raise StepFailed(f"backup {backup_id} of {self.unit} on {ctx.host.name} was not restored: {out['refused']}")
        ctx.report["saved_as"] = out.get("saved_as")
        ctx.report["files"] = {"before": out["before"], "after": out["after"], "changed": out.get("changed", [])}
        if out["daemon_reload"]["rc"] != 0:
            raise StepFailed(f"daemon-reload failed on {ctx.host.name}: {out['daemon_reload']['stderr']}")
        return out


@dataclass(frozen=True)
class RollBackReplicas(Undo):
    """The undo of restarting replicas on a new release: each goes through the replica cycle again, on
    the files the rest of the rollback put back (or those in place, when no file had changed)."""

    template: str
    units: tuple[str, ...]

    def apply(self, ctx: UndoTarget) -> None:
        for unit in self.units:
            ctx.cycle(self.template, unit)


KINDS: dict[str, type[Undo]] = {kind.__name__: kind for kind in (StartAgain, Reinstall, RestoreBackup, RollBackReplicas)}


def as_record(undo: Undo) -> dict[str, Any]:
    """An undo as JSON data: its kind and its fields."""
    return {"kind": type(undo).__name__, **asdict(undo)}


def from_record(record: dict[str, Any]) -> Undo:
    """The undo a journal recorded (a list read back from JSON is a tuple again where the kind holds one)."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k != "kind"}
    return KINDS[record["kind"]](**fields)

"""Sync model dirs with rsync over SSH: local -> host, host -> host (through a local cache) or within
one host; identical files are skipped; verified after by an rsync --checksum dry run."""

from __future__ import annotations

from pathlib import Path

from ..errors import DdopsError, StepFailed
from ..facts import Tree
from ..paths import cache_root
from ..plan import Operation, PlanContext, RunContext
from ..profile import LOCAL, Model
from ..remote import check
from ..transfer import rsync, rsync_argv, verify


def plan_model(model: Model, source: Tree, dest: Tree) -> list[Operation]:
    """Files that differ between source and dest (size, mtime, or sha256 of small files)."""
    if model.source is None:
        return []
    src_files, dst_files = source.files, dest.files if dest.exists else {}
    differ = [rel for rel, (size, mtime, sha) in src_files.items()
              if rel not in dst_files or dst_files[rel][0] != size
              or (sha and dst_files[rel][2] != sha) or (not sha and dst_files[rel][1] != mtime)]
    extra = [rel for rel in dst_files if rel not in src_files]
    if not differ and not extra:
        return []
    size = sum(src_files[r][0] for r in differ)
    return [Operation(f"sync {model.role} {model.source.host}:{model.source.path} -> {model.path}: "
                      f"{len(differ)} file(s), {size / 2**20:.1f} MiB" + (f", {len(extra)} to delete" if extra else ""),
                      detail="\n".join(differ[:20] + [f"(delete) {r}" for r in extra[:10]]),
                      data={"role": model.role})]


# Where rsync --delay-updates holds each new file until the whole transfer has arrived (its default
# partial dir, one in every folder it updates); a transfer that stops leaves it behind.
HOLDING = ".~tmp~"


def clear_holding_argv(path: str) -> list[str]:
    """Remove rsync's holding dirs under a model dir (what a stopped or killed transfer left)."""
    return ["find", path, "-type", "d", "-name", HOLDING, "-prune", "-exec", "rm", "-rf", "--", "{}", "+"]


class SyncStep:
    name = "sync"
    title = "Sync model dirs"

    def plan(self, ctx: PlanContext) -> list[Operation]:
        operations = []
        for model in ctx.profile.models:
            if model.source is not None:
                operations += plan_model(model, ctx.facts.source_tree(model), ctx.facts.dest.tree(model.path))
        return operations

    def apply(self, ctx: RunContext, operations: list[Operation]) -> str:
        roles = {op.data["role"] for op in operations}
        done = []
        for model in ctx.profile.models:
            if model.role in roles:
                self.sync_model(ctx, model)
                done.append(model.role)
        ctx.journal.change("models")  # the old files are gone: nothing to undo, the unit is what rolls back
        return f"synced and verified: {', '.join(done)}"

    def sync_model(self, ctx: RunContext, model: Model) -> None:
        """One model dir; rsync's holding dirs (--delay-updates) are cleared before, and after a sync that
        failed or was stopped, so no half-copied file is left in the model folder."""
        new_dir = ctx.facts is not None and not ctx.facts.dest.tree(model.path).exists
        check(ctx.executor.run(ctx.host, ["mkdir", "-p", "--", model.path]), f"mkdir {model.path}")
        check(ctx.executor.run(ctx.host, clear_holding_argv(model.path)), f"clearing {HOLDING} in {model.path}")
        try:
            self.transfer(ctx, model)
        except BaseException:
            # a dir this sync made is removed again if nothing arrived in it (rmdir leaves a non-empty one)
            undo = [clear_holding_argv(model.path)] + ([["rmdir", "--", model.path]] if new_dir else [])
            try:
                for argv in undo:
                    ctx.executor.run(ctx.host, argv, timeout=120)
            except DdopsError as exc:
                ctx.progress(f"could not clear {HOLDING} in {model.path}: {exc.line()}")
            raise

    def transfer(self, ctx: RunContext, model: Model) -> None:
        inv, dst_host, profile = ctx.inventory, ctx.host, ctx.profile
        src = model.source
        if src.host == profile.host:  # within the host
            result = ctx.executor.run(dst_host, ["rsync", "-a", "--delete-after", "--delay-updates", "--",
                                                 src.path.rstrip("/") + "/",
                                                 model.path.rstrip("/") + "/"], timeout=6 * 3600)
            check(result, f"rsync {src.path} -> {model.path}")
            verify_local = ctx.executor.run(dst_host, ["rsync", "-a", "--delete", "--checksum", "--dry-run",
                                                       "--itemize-changes", "--", src.path.rstrip("/") + "/",
                                                       model.path.rstrip("/") + "/"], timeout=6 * 3600)
            check(verify_local, "verify")
            if [l for l in verify_local.stdout.splitlines() if l.strip() and not l.startswith(".d")]:
                raise StepFailed(f"verifying {model.path}: files still differ after the sync")
            return
        if src.host == LOCAL:
            local = src.path
        else:  # host -> host: pull into the control machine's cache, then push
            local = str(cache_root() / "sync" / src.host / src.path.strip("/"))
            Path(local).mkdir(parents=True, exist_ok=True)
            src_host = inv.host(src.host)
            what = f"pull {src.host}:{src.path}"
            rsync(rsync_argv(inv, src.path, local, src_host=src_host), ctx.progress, what)
            verify(rsync_argv(inv, src.path, local, src_host=src_host, checksum_dry_run=True), what)
        what = f"push {model.role} -> {dst_host.name}:{model.path}"
        rsync(rsync_argv(inv, local, model.path, dst_host=dst_host), ctx.progress, what)
        verify(rsync_argv(inv, local, model.path, dst_host=dst_host, checksum_dry_run=True), what)

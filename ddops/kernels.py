"""The kernel store: Triton caches harvested from hosts whose deploy passed its gates, kept on the control
machine by GPU model, and pushed into the empty cache of a host of the same model before its unit starts,
so that its first warm-up loads kernels and autotune choices instead of compiling and timing them (the
27B on an H200: 91.5 s on an empty cache, 10.6 s seeded, docs/performance.md).

Safe to share by GPU model: Triton keys every entry by kernel source, GPU architecture, Triton and ptxas
version, so an entry that does not match is only a miss. A host of a model the store has nothing for gets
one file of another model's store instead: the runtime's record of the kernels its warm-up compiled, which
its first warm-up compiles at once for its own GPU (38.3 s for the 27B on an H200, 53 s without). The
store for a model is replaced by each newer harvest (a folder renamed into place, never half-written); a
host's own cache is never overwritten.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import DdopsError
from .executor import Executor
from .facts import HostFacts, Inspection, Tree
from .inventory import Host, Inventory
from .paths import kernel_store_root, triton_cache
from .profile import Profile
from .remote import run_probe
from .transfer import rsync, rsync_argv

STORE_MAX_BYTES = 4 * 2**30     # a host's cache larger than this is not harvested (the store stays bounded)
TRANSFER_TIMEOUT_S = 900        # one harvest or seed
MANIFEST = "manifest.json"      # beside the cache in a model's store: where and when it was harvested
CACHE = "triton"                # the harvested cache, as it was on the host
# the runtime's record of every kernel its last warm-up compiled (ddtree_runtime/model/compile_pool.py),
# in its Triton cache: a host of a GPU model the store has no cache for gets another model's record, and
# its first warm-up then compiles all those kernels at once for its own GPU instead of one by one
RECORD = "ddtree-compiles.pkl"
# A seed writes no file the host has (even one its running unit wrote since the plan), and writes its own
# as Triton does for the unit, which runs as root (no User= in the templates; CacheDirectory=ddtree makes
# /var/cache/ddtree root's, 0755): root's, folders 0755, files 0644.
SEED_OPTIONS = ("--ignore-existing", "--no-owner", "--no-group", "--chmod=D755,F644")


def cache_dir(profile: Profile) -> str:
    """The Triton cache the unit uses: its env's TRITON_CACHE_DIR (the profile's `env` may move it)."""
    return profile.env.get("TRITON_CACHE_DIR") or triton_cache(profile.engine)


def gpu_model(host: HostFacts) -> str | None:
    """The host's GPU model as the facts probe names it (several models: all of them, so a mixed host
    shares with none); None when its GPUs are not known."""
    names = sorted({g.name for g in host.gpus if g.name})
    return " + ".join(names) if names and not host.gpu_error else None


def slug(model: str) -> str:
    """A model's folder name in the store: `NVIDIA RTX A6000` -> `nvidia-rtx-a6000`."""
    return re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-") or "unknown"


def store_dir(model: str) -> Path:
    return kernel_store_root() / slug(model)


@dataclass(frozen=True)
class Stored:
    """A model's store, as its manifest records it."""

    gpu_model: str
    host: str
    harvested_at: str
    files: int
    bytes: int
    path: str

    def words(self) -> str:
        return f"{self.files} files, {mib(self.bytes)}, harvested from {self.host} at {self.harvested_at}"

    @property
    def has_record(self) -> bool:
        """Whether the harvested cache holds the runtime's compile record (what other models' hosts get)."""
        return (Path(self.path) / RECORD).is_file()

    def as_json(self) -> dict[str, Any]:
        return {"gpu_model": self.gpu_model, "host": self.host, "harvested_at": self.harvested_at,
                "files": self.files, "bytes": self.bytes, "compile_record": self.has_record, "path": self.path}


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def read_store(model: str | None) -> Stored | None:
    """The store for `model`, or None when there is none (or its manifest cannot be read: a store is
    only used whole)."""
    if model is None:
        return None
    top = store_dir(model)
    try:
        record = json.loads((top / MANIFEST).read_text())
        if not (top / CACHE).is_dir():
            return None
        return Stored(gpu_model=model, host=str(record["host"]), harvested_at=str(record["harvested_at"]),
                      files=int(record["files"]), bytes=int(record["bytes"]), path=str(top / CACHE))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def list_stores() -> list[Stored]:
    """Every GPU model's store on this control machine, the newest harvest first (a store whose manifest
    cannot be read is left out, as a seed would leave it)."""
    root = kernel_store_root()
    found = []
    for top in sorted(root.iterdir()) if root.is_dir() else ():
        if top.name.startswith(".") or not top.is_dir():
            continue
        try:
            named = str(json.loads((top / MANIFEST).read_text()).get("gpu_model") or top.name)
        except (OSError, ValueError, AttributeError):
            continue
        store = read_store(named) if slug(named) == top.name else None
        if store is not None:
            found.append(store)
    return sorted(found, key=lambda s: s.harvested_at, reverse=True)


def read_record_store(model: str | None) -> Stored | None:
    """The newest harvested store of another GPU model whose cache holds the runtime's compile record
    (RECORD), for a host of `model` the store has no cache for; None when there is none."""
    if model is None:
        return None
    return next((s for s in list_stores() if slug(s.gpu_model) != slug(model) and s.has_record), None)


@contextmanager
def store_lock(model: str, exclusive: bool) -> Iterator[None]:
    """A seed reads a store while no harvest swaps it (two ddops runs may share the control machine)."""
    root = kernel_store_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{slug(model)}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# -- seed: the plan's decision, and the push ----------------------------------------------------------

@dataclass(frozen=True)
class SeedDecision:
    """What a pivot does with the host's Triton cache before its unit (re)starts, and why.

    outcome: seed (empty cache, a store for its model), record (empty cache, no store for its model but
    another model's store holds the runtime's compile record: that file alone), kept (the host has its
    own), none (nothing for its model), off (--no-kernel-seed), idle (nothing (re)starts), no-gpu (no GPU
    model known)."""

    outcome: str
    dir: str
    host: str
    gpu_model: str | None = None
    store: Stored | None = None

    def words(self) -> str:
        if self.outcome == "seed":
            return f"seeded from store ({self.store.words()})"
        if self.outcome == "record":
            return (f"seeded with the compile record of {self.store.gpu_model} (harvested from {self.store.host} "
                    f"at {self.store.harvested_at}): the first warm-up compiles those kernels at once")
        return {"kept": "kept (host has its own)",
                "none": f"none for {self.gpu_model} yet",
                "off": "not seeded (--no-kernel-seed)",
                "idle": "not seeded: nothing (re)starts",
                "no-gpu": f"no GPU model known on {self.host}: nothing to seed"}[self.outcome]

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"outcome": self.outcome, "dir": self.dir, "gpu_model": self.gpu_model}
        if self.store is not None:
            out["store"] = {"host": self.store.host, "harvested_at": self.store.harvested_at,
                            "files": self.store.files, "bytes": self.store.bytes}
        return out


def decide_seed(profile: Profile, host: str, facts: HostFacts, dest: Inspection, store: Stored | None, *,
                enabled: bool, restarting: bool, record: Stored | None = None) -> SeedDecision:
    """Seed only an empty (or missing) cache, right before the unit (re)starts: from the store for the
    host's own GPU model, else with the compile record of another model's store (`record`); a cache the
    host already has is never touched."""
    directory = cache_dir(profile)
    model = gpu_model(facts)
    here = dest.paths.get(directory)
    empty = here is None or not here.exists or (here.dir and here.entries == 0)
    source, push = (store, "seed") if store is not None else (record, "record")

    def decided(outcome: str) -> SeedDecision:
        return SeedDecision(outcome, directory, host, model, source if outcome == push else None)

    if model is None:
        return decided("no-gpu")
    if not empty:
        return decided("kept")
    if source is None:
        return decided("none")
    if not enabled:
        return decided("off")
    return decided(push if restarting else "idle")


def seed_argv(inventory: Inventory, host: Host, store: Stored, directory: str, record_only: bool = False) -> list[str]:
    """Push a store into the host's cache (`record_only`: its compile record alone): nothing deleted
    there, the files the unit's (root's)."""
    only = (f"--include=/{RECORD}", "--exclude=*") if record_only else ()
    return rsync_argv(inventory, store.path, directory, dst_host=host, mirror=False, options=(*SEED_OPTIONS, *only))


def seed(executor: Executor, inventory: Inventory, host: Host, decision: SeedDecision,
         progress: Callable[[str], None]) -> None:
    """The push itself (a failure raises; the caller empties the cache again)."""
    directory, store = decision.dir, decision.store
    result = executor.run(host, ["mkdir", "-p", "--", directory], timeout=60)
    if not result.ok:
        raise DdopsError(f"mkdir {directory} failed on {host.name}: {result.stderr.strip()[-200:]}")
    with store_lock(store.gpu_model, exclusive=False):
        rsync(seed_argv(inventory, host, store, directory, record_only=decision.outcome == "record"), progress,
              f"seed {host.name}:{directory}", timeout=TRANSFER_TIMEOUT_S)


def empty_argv(directory: str) -> list[str]:
    """What a failed seed leaves in a cache that was empty before it goes again."""
    return ["find", directory, "-mindepth", "1", "-delete"]


# -- harvest: after the gates passed --------------------------------------------------------------------

def harvest(executor: Executor, inventory: Inventory, host: Host, profile: Profile, facts: HostFacts,
            progress: Callable[[str], None]) -> dict[str, Any]:
    """Copy the host's Triton cache into the store for its GPU model, replacing what was there. Returns
    what happened ({"outcome": harvested | empty | no-gpu | too-big | failed, ...}); never raises a
    DdopsError or OSError: a deploy that passed its gates stands whatever happens here."""
    model, directory = gpu_model(facts), cache_dir(profile)
    if model is None:
        return {"outcome": "no-gpu"}
    try:
        tree = Tree.from_json(run_probe(executor, host, "inspect", {"trees": [directory]}, timeout=300)
                              ["trees"][directory])
        found = {"gpu_model": model, "files": len(tree.files), "bytes": tree.bytes}
        if not tree.files:
            return {"outcome": "empty", **found}
        if tree.bytes > STORE_MAX_BYTES:
            return {"outcome": "too-big", **found,
                    "error": f"{host.name}:{directory} holds {mib(tree.bytes)}, over the store's bound of "
                             f"{mib(STORE_MAX_BYTES)}: not harvested"}
        replace_store(model, lambda staging: pull(inventory, host, directory, model, staging, progress),
                      {"gpu_model": model, "host": host.name, "dir": directory, "profile": profile.name,
                       "harvested_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **found})
        return {"outcome": "harvested", **found}
    except (DdopsError, OSError) as exc:
        line = exc.line() if isinstance(exc, DdopsError) else f"{exc.strerror or exc}: {exc.filename or ''}"
        return {"outcome": "failed", "gpu_model": model, "error": line}


def pull(inventory: Inventory, host: Host, directory: str, model: str, staging: Path,
         progress: Callable[[str], None]) -> None:
    """rsync the host's cache into `staging`, unchanged files hard-linked from the current store."""
    current = store_dir(model) / CACHE
    link = [f"--link-dest={current}"] if current.is_dir() else []
    rsync(rsync_argv(inventory, directory, str(staging), src_host=host, options=link), progress,
          f"harvest {host.name}:{directory}", timeout=TRANSFER_TIMEOUT_S)


def replace_store(model: str, fill: Callable[[Path], None], manifest: dict[str, Any]) -> None:
    """Fill a new store beside the old one, then rename it into place: a failed harvest leaves the old
    store as it was, and a seed never reads half of one."""
    top = store_dir(model)
    staging = top.with_name(f".{top.name}.{os.getpid()}.new")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        (staging / CACHE).mkdir(parents=True)
        fill(staging / CACHE)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        with store_lock(model, exclusive=True):
            old = top.with_name(f".{top.name}.{os.getpid()}.old")
            if top.exists():
                top.rename(old)
            staging.rename(top)
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def report(decision: SeedDecision, seeded: dict[str, Any] | None, harvested: dict[str, Any] | None, *,
           dry_run: bool) -> dict[str, Any]:
    """What a pivot did with the kernel cache, for its report: the plan's decision, the seed as it ran
    (None: it did not run), the harvest (None: the gates did not pass), in one line and warnings."""
    words, warnings = [decision.words()], []
    if decision.outcome in ("seed", "record") and seeded is None:
        words = [f"would be {decision.words()}" if dry_run else "not seeded: the pivot stopped before"]
    elif seeded is not None and seeded["outcome"] == "failed":
        words = ["not seeded"]
        warnings.append(f"kernel cache not seeded on {decision.host}: {seeded['error']} (it compiles its own)")
    outcome = (harvested or {}).get("outcome")
    if outcome == "harvested":
        words.append(f"harvested ({harvested['files']} files, {mib(harvested['bytes'])})")
    elif outcome == "empty":
        words.append("nothing to harvest (its cache is empty)")
    elif outcome in ("failed", "too-big"):
        warnings.append(f"kernel cache not harvested from {decision.host}: {harvested['error']}")
    return {"seed": seeded or decision.as_json(), "harvest": harvested, "line": "; ".join(words),
            "warnings": warnings}

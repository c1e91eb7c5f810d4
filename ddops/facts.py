"""Facts: what a host is and runs, gathered in one SSH round trip, and its identity check."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import DdopsError
from .executor import Executor
from .inventory import Expect, Host
from .paths import JOURNAL_PATH, LOCK_PATH, REPLICAS_DIR, replicas_manifest
from .probes import probe_source


@dataclass
class Identity:
    """Whether a host is who the inventory says it is; a mismatch stops every change."""

    ok: bool
    hostname: str | None
    gpu_model: str | None
    gpu_count: int | None
    expected: dict[str, Any]
    mismatches: list[str] = field(default_factory=list)


def tensor_parallel(state: dict[str, Any] | None, health: dict[str, Any] | None) -> int | None:
    """The GPUs a server spans: what its /health says (`tensor_parallel`) while the unit runs (else the
    port's health may be another unit's), or what its installed unit's command line says (the facts probe
    reads it from systemd); None for a unit that runs no known server."""
    state = state or {}
    detail = (health or {}).get("detail")
    reported = detail.get("tensor_parallel") if isinstance(detail, dict) else None
    if state.get("ActiveState") == "active" and isinstance(reported, int) and not isinstance(reported, bool):
        return reported
    return state.get("tensor_parallel")


def probe_args(host: Host) -> dict[str, Any]:
    training = asdict(host.training) if host.training else None
    return {"training": training, "services": [asdict(s) for s in host.services], "replicas_dir": REPLICAS_DIR,
            "lock": LOCK_PATH, "journal": JOURNAL_PATH}


def gather(executor: Executor, host: Host, *, metrics: list[str] | None = None,
           api_keys: dict[int, str] | None = None, timeout: float | None = None,
           cuda_version: bool = False) -> dict[str, Any]:
    """Run the facts probe on host and return its parsed JSON. With `metrics` (sample names), every
    runtime and replica also has its /metrics read, in the same round trip (`api_keys` by port); with
    `cuda_version`, the CUDA version the driver supports too (one more nvidia-smi call: preflight's)."""
    args = probe_args(host)
    if cuda_version:
        args["cuda_version"] = True
    stdin = None
    if metrics:
        args["metrics"] = metrics
        stdin = json.dumps({str(port): key for port, key in (api_keys or {}).items()})
    result = executor.run(host, ["python3", "-I", "-S", "-c", probe_source("facts"), json.dumps(args)],
                          stdin=stdin, timeout=timeout)
    if not result.ok:
        detail = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise DdopsError(f"facts probe failed on {host.name} (exit {result.exit_code}): {detail}",
                         fix="the host needs python3 on its PATH")
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        raise DdopsError(f"facts probe on {host.name} printed something that is not JSON: "
                         f"{result.stdout[:120]!r}", fix="check the login shell prints nothing") from None


def check_identity(expect: Expect, facts: dict[str, Any]) -> Identity:
    """Compare observed hostname and GPUs with `expect`; every difference is named."""
    gpu_list = facts.get("gpus", {}).get("list", [])
    names = sorted({g["name"] for g in gpu_list})
    observed_model = " + ".join(names) if names else None
    identity = Identity(ok=True, hostname=facts.get("hostname"), gpu_model=observed_model,
                        gpu_count=len(gpu_list), expected={k: v for k, v in asdict(expect).items() if v is not None})
    gpu_error = facts.get("gpus", {}).get("error")
    if expect.hostname is not None and identity.hostname != expect.hostname:
        identity.mismatches.append(f"hostname is {identity.hostname!r}, expected {expect.hostname!r}")
    if expect.gpu_model is not None:
        wanted = expect.gpu_model.lower()
        wrong = [n for n in names if wanted not in n.lower()]
        if gpu_error:
            identity.mismatches.append(f"cannot read GPUs ({gpu_error}), expected {expect.gpu_model!r}")
        elif not names or wrong:
            identity.mismatches.append(f"GPU model is {observed_model or 'none'!r}, expected {expect.gpu_model!r}")
    if expect.gpu_count is not None and identity.gpu_count != expect.gpu_count:
        if not (gpu_error and expect.gpu_model is not None):  # already reported above
            identity.mismatches.append(f"GPU count is {identity.gpu_count}, expected {expect.gpu_count}")
    identity.ok = not identity.mismatches
    return identity


# -- typed facts: what the pivot's steps read, parsed once from the probes' JSON ------------------

@dataclass(frozen=True)
class Training:
    """The training job the facts probe found (`running` False when there is none)."""

    running: bool = False
    pid: int | None = None
    pids: tuple[int, ...] = ()
    unit: str | None = None
    last_step: int | None = None               # the last `step N` in its log
    checkpoints_dir: str | None = None         # where it writes checkpoints (the inventory's), if known
    checkpoint_path: str | None = None         # the checkpoint written last there
    checkpoint_step: int | None = None         # that checkpoint's step, from its name

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "Training":
        data = data or {}
        newest = data.get("newest_checkpoint") or {}
        return cls(running=bool(data.get("running")), pid=data.get("pid"), pids=tuple(data.get("pids") or ()),
                   unit=(data.get("unit") or {}).get("unit"), last_step=data.get("last_step"),
                   checkpoints_dir=data.get("checkpoints"), checkpoint_path=newest.get("path"),
                   checkpoint_step=newest.get("step"))

    @property
    def lost_steps(self) -> int | None:
        """The steps a kill now would lose: the log's last step past the newest checkpoint's (all of them
        when there is no checkpoint yet); None when the log, the checkpoints dir or the checkpoint's step
        is not known."""
        if self.last_step is None or self.checkpoints_dir is None:
            return None
        if self.checkpoint_path is None:
            return self.last_step
        if self.checkpoint_step is None:
            return None
        return max(0, self.last_step - self.checkpoint_step)

    def over(self, limit: int | None) -> bool:
        """Whether a kill now loses more than `limit` steps (None: no limit); an unknown loss is over any."""
        return limit is not None and (self.lost_steps is None or self.lost_steps > limit)

    def cost(self) -> str:
        """What a kill now costs, in words (the plan's line and preflight's refusal)."""
        if self.last_step is None:
            return "its log shows no `step N`: the steps a kill loses are unknown"
        if self.checkpoints_dir is None:
            return "no checkpoints dir in the inventory: the steps a kill loses are unknown"
        if self.checkpoint_path is None:
            return f"no checkpoint yet in {self.checkpoints_dir}: a kill now loses all {self.last_step} steps"
        if self.checkpoint_step is None:
            return f"newest checkpoint {self.checkpoint_path} has no step in its name: the steps a kill loses are unknown"
        return (f"newest checkpoint step {self.checkpoint_step} ({self.checkpoint_path}): "
                f"a kill now loses {self.lost_steps} step(s)")


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi lists it."""

    index: int
    name: str | None = None
    memory_total_mib: int | None = None
    compute_cap: float | None = None   # None where the driver cannot say (FP8 needs 8.9 or more)

    @property
    def label(self) -> str:
        memory = f", {self.memory_total_mib:,} MiB" if self.memory_total_mib is not None else ""
        return f"GPU {self.index} ({self.name or 'unknown'}{memory})"


@dataclass(frozen=True)
class HostFacts:
    """One host's facts probe: who it is, its GPUs and its training job."""

    hostname: str | None
    gpu_count: int
    training: Training
    gpu_error: str | None = None   # why nvidia-smi could not list the GPUs (then gpu_count is 0, not known)
    gpus: tuple[Gpu, ...] = ()
    raw: dict[str, Any] = field(repr=False, default_factory=dict)   # for the identity check

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "HostFacts":
        gpus = data.get("gpus") or {}
        listed = gpus.get("list", [])
        return cls(hostname=data.get("hostname"), gpu_count=len(listed),
                   training=Training.from_json(data.get("training")), gpu_error=gpus.get("error"),
                   gpus=tuple(Gpu(index=i if g.get("index") is None else g["index"], name=g.get("name"),
                                  memory_total_mib=g.get("memory_total_mib"), compute_cap=g.get("compute_cap"))
                                for i, g in enumerate(listed)),
                   raw=data)


@dataclass(frozen=True)
class Tree:
    """A model dir: relative path -> (size, mtime, sha256 of a small file or None), and its config.json."""

    exists: bool = False
    files: dict[str, tuple] = field(default_factory=dict)
    bytes: int = 0
    config: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "Tree":
        data = data or {}
        return cls(exists=bool(data.get("exists")), files={k: tuple(v) for k, v in (data.get("files") or {}).items()},
                   bytes=data.get("bytes", 0), config=data.get("config"))


@dataclass(frozen=True)
class FileFact:
    """A file on the host: its checksum, and its text (secrets masked) for the diff."""

    exists: bool = False
    sha256: str | None = None
    text: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "FileFact":
        data = data or {}
        return cls(exists=bool(data.get("exists")), sha256=data.get("sha256"), text=data.get("text"))


@dataclass(frozen=True)
class Imports:
    """The venv's python: whether it exists, which modules import, and why the others do not."""

    venv: bool = False
    ok: frozenset[str] = frozenset()
    errors: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "Imports":
        data = data or {}
        modules = data.get("modules") or {}
        return cls(venv=bool(data.get("venv")), ok=frozenset(m for m, r in modules.items() if r.get("ok")),
                   errors={m: r.get("error") for m, r in modules.items() if not r.get("ok")})


@dataclass(frozen=True)
class UnitFact:
    active_state: str | None = None
    unit_file_state: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "UnitFact":
        data = data or {}
        return cls(active_state=data.get("ActiveState"), unit_file_state=data.get("UnitFileState"))

    @property
    def active(self) -> bool:
        return self.active_state in ("active", "activating", "reloading")


@dataclass(frozen=True)
class Free:
    checked: str           # the existing directory the free space was measured on
    free_bytes: int
    device: int | None = None   # its filesystem (st_dev): paths on one share its free space


@dataclass(frozen=True)
class PathFact:
    """A path ddops writes, on the host: where it leads with symlinks resolved, and what is there."""

    real: str
    link: bool = False
    exists: bool = False
    dir: bool = False
    entries: int | None = 0     # how many names a directory holds (None: unreadable)
    venv: bool = False          # holds a pyvenv.cfg

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "PathFact":
        return cls(**{k: data.get(k) for k in ("real", "link", "exists", "dir", "entries", "venv")})


@dataclass(frozen=True)
class Inspection:
    """The inspect probe on one host: only the sections asked for are filled."""

    trees: dict[str, Tree] = field(default_factory=dict)
    free: dict[str, Free] = field(default_factory=dict)
    port_holder: dict[str, Any] | None = None     # pid, cmdline, unit of whatever listens on the port
    files: dict[str, FileFact] = field(default_factory=dict)
    imports: Imports = field(default_factory=Imports)
    units: dict[str, UnitFact] = field(default_factory=dict)
    lock_holder: dict[str, Any] | None = None
    journal: dict[str, Any] | None = None          # an unfinished pivot's journal of intent (paths.JOURNAL_PATH)
    ports: dict[int, dict[str, Any] | None] = field(default_factory=dict)   # replicas: each port's holder
    commands: dict[str, str | None] = field(default_factory=dict)          # command -> its path, None if absent
    paths: dict[str, PathFact] = field(default_factory=dict)               # paths ddops writes: where they lead

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Inspection":
        return cls(trees={p: Tree.from_json(t) for p, t in (data.get("trees") or {}).items()},
                   free={p: Free(f["checked"], f["free_bytes"], f.get("device"))
                         for p, f in (data.get("free") or {}).items()},
                   paths={p: PathFact.from_json(f) for p, f in (data.get("paths") or {}).items()},
                   port_holder=data.get("port"),
                   files={p: FileFact.from_json(f) for p, f in (data.get("files") or {}).items()},
                   imports=Imports.from_json(data.get("imports")),
                   units={u: UnitFact.from_json(s) for u, s in (data.get("units") or {}).items()},
                   lock_holder=data.get("lock"), journal=data.get("journal"),
                   ports={int(p): h for p, h in (data.get("ports") or {}).items()},
                   commands=dict(data.get("commands") or {}))

    def tree(self, path: str) -> Tree:
        return self.trees.get(path) or Tree()

    def file(self, path: str) -> FileFact:
        return self.files.get(path) or FileFact()

    def unit(self, name: str) -> UnitFact:
        return self.units.get(name) or UnitFact()

    def installed_replicas(self, template: str) -> list[str]:
        """The replica units the installed replicas manifest of `template` lists (none when absent)."""
        text = self.file(replicas_manifest(template)).text
        try:
            return [r["unit"] for r in json.loads(text)["replicas"]] if text else []
        except (ValueError, KeyError, TypeError):
            return []


@dataclass(frozen=True)
class ServerFlags:
    """The flags the server that will run the unit takes (ddops.serverflags), or why they are unknown."""

    source: str                                  # which server, in words
    flags: frozenset[str] = frozenset()
    error: str | None = None
    missing: bool = False                        # the server is not installed there at all


@dataclass(frozen=True)
class PivotFacts:
    """Everything a pivot plans from, read once by preflight: the serving host's facts, every
    involved host's inspection (the control machine's under "local"), and the runtime release and kernel
    store here."""

    serving: str
    hosts: dict[str, HostFacts]
    inspections: dict[str, Inspection]
    release: str | None = None          # the runtime release `runtime.ship` would install
    server_flags: ServerFlags | None = None   # what the unit's server takes (None: not asked)
    pool: Any = None                    # ddops.capacity.PoolEstimate: what the KV pool will hold (None: no GPU pool)
    gpu_check: Any = None               # ddops.gpucheck.GpuCheck: the torch checked, GPU faults accepted, warnings
    kernel_store: Any = None            # ddops.kernels.Stored: the kernel store here for the host's GPU model
    kernel_record: Any = None           # ddops.kernels.Stored: with none, another model's store with a compile record

    @property
    def host(self) -> HostFacts:
        return self.hosts[self.serving]

    @property
    def dest(self) -> Inspection:
        return self.inspections[self.serving]

    def source_tree(self, model) -> Tree:
        """The tree a model syncs from (on its source host, or the control machine)."""
        return self.inspections[model.source.host].tree(model.source.path)

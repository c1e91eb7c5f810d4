"""Install missing runtime deps: probe imports in the venv, create it if absent, pip install what is
missing (from the index, or from a wheelhouse ddops pushes), probe again. A replicated profile's
balancer is Debian's `haproxy` package, installed with apt when the host lacks it."""

from __future__ import annotations

import re
import threading
import time
from typing import Callable

from ..errors import DdopsError, StepFailed
from ..facts import Imports, Inspection, PathFact
from ..paths import WHEELHOUSE
from ..plan import Operation, PlanContext, RunContext
from ..profile import Profile
from ..remote import check, run_probe
from ..transfer import rsync, rsync_argv


def missing_modules(profile: Profile, imports: Imports) -> list[str]:
    if profile.engine != "ddtree":
        return []
    if not imports.venv:
        return sorted(profile.runtime.packages)
    return [m for m in sorted(profile.runtime.packages) if m not in imports.ok]


def venv_argv(profile: Profile) -> list[str]:
    return ["python3", "-m", "venv", profile.runtime.venv]


def pip_argv(profile: Profile, modules: list[str]) -> list[str]:
    argv = [f"{profile.runtime.venv}/bin/python", "-m", "pip", "install", "--disable-pip-version-check",
            "--progress-bar", "off"]
    if not profile.runtime.index:
        argv += ["--no-index", "--find-links", WHEELHOUSE]
    elif profile.runtime.torch is not None and profile.runtime.torch.index and "torch" in modules:
        argv += ["--extra-index-url", profile.runtime.torch.index]
    return argv + [profile.runtime.packages[m] for m in modules]


def plan_deps(profile: Profile, imports: Imports, installed_torch: str | None = None,
              venv_dir: PathFact | None = None) -> list[Operation]:
    """What to install: the modules that do not import, and torch again when runtime.torch pins another build
    than `installed_torch` (the venv's torch version, which preflight read). `venv_dir`: what is at the venv's
    path now (preflight refused a non-empty dir that is no venv); a venv made where nothing was is removed
    again if the step fails."""
    if profile.engine != "ddtree":
        return []
    operations = []
    if not imports.venv:
        new_dir = venv_dir is not None and not venv_dir.exists
        operations.append(Operation(f"create venv {profile.runtime.venv}", commands=(tuple(venv_argv(profile)),),
                                    data={"venv": profile.runtime.venv, "new_dir": new_dir}))
    missing = missing_modules(profile, imports)
    pin = profile.runtime.torch
    if pin is not None and installed_torch and installed_torch != pin.build and "torch" not in missing:
        missing = sorted(missing + ["torch"])
    if missing:
        specs = [profile.runtime.packages[m] for m in missing]
        source = "the index" if profile.runtime.index else "a pushed wheelhouse"
        operations.append(Operation(f"pip install {' '.join(specs)} (from {source})",
                                    commands=(tuple(pip_argv(profile, missing)),), data={"modules": missing}))
    return operations


APT_ENV = ["env", "DEBIAN_FRONTEND=noninteractive"]


def plan_system_packages(profile: Profile, dest: Inspection) -> list[Operation]:
    """HAProxy for replicas: apt-get install it (the package index refreshed first) when `haproxy` is absent."""
    if not profile.replicated or dest.commands.get("haproxy"):
        return []
    return [Operation("apt-get install haproxy (the balancer in front of the replicas)",
                      commands=(tuple(APT_ENV + ["apt-get", "update", "-q"]),
                                tuple(APT_ENV + ["apt-get", "install", "-y", "-q", "--no-install-recommends",
                                                 "haproxy"])),
                      data={"apt": ["haproxy"]})]


def import_probe_args(profile: Profile) -> dict:
    return {"imports": {"python": profile.runtime.python, "modules": sorted(profile.runtime.packages)}}


class DepsStep:
    name = "deps"
    title = "Install runtime deps"

    def plan(self, ctx: PlanContext) -> list[Operation]:
        dest = ctx.facts.dest
        installed = ctx.facts.gpu_check.installed_torch if ctx.facts.gpu_check is not None else None
        return plan_system_packages(ctx.profile, dest) + plan_deps(ctx.profile, dest.imports, installed,
                                                                   dest.paths.get(ctx.profile.runtime.venv))

    def apply(self, ctx: RunContext, operations: list[Operation]) -> str:
        made = next((op.data["venv"] for op in operations if op.data.get("new_dir")), None)
        try:
            return self._apply(ctx, operations)
        except BaseException:
            if made is not None:  # a venv this step made where nothing was: the failure takes it back
                ctx.progress(f"removing {made}, which this failed step created")
                try:
                    ctx.executor.run(ctx.host, ["rm", "-rf", "--one-file-system", "--", made], timeout=300)
                except DdopsError as exc:
                    ctx.progress(f"could not remove {made}: {exc.line()}")
            raise

    def _apply(self, ctx: RunContext, operations: list[Operation]) -> str:
        profile, host, ex = ctx.profile, ctx.host, ctx.executor
        created, installed = False, []
        for op in operations:
            if "apt" in op.data:
                for argv in op.commands:
                    ctx.progress(" ".join(argv[2:]))
                    check(ex.run(host, list(argv), timeout=900, on_output=lambda text: _last_lines(text, ctx.progress)),
                          " ".join(argv[2:]))
                installed += op.data["apt"]
            if "venv" in op.data:
                ctx.progress(f"creating {profile.runtime.venv}")
                check(ex.run(host, list(op.commands[0]), timeout=300), "creating the venv")
                created = True
            if "modules" in op.data:
                modules = op.data["modules"]
                if not profile.runtime.index:
                    check(ex.run(host, ["mkdir", "-p", WHEELHOUSE]), "mkdir wheelhouse")
                    rsync(rsync_argv(ctx.inventory, profile.runtime.wheelhouse, WHEELHOUSE, dst_host=host),
                          ctx.progress, "push wheelhouse")
                ctx.progress(f"pip install {' '.join(modules)}")
                with PipProgress(len(modules), ctx.progress) as pip:
                    result = ex.run(host, list(op.commands[0]), timeout=3600, on_output=pip.feed)
                check(result, "pip install " + " ".join(profile.runtime.packages[m] for m in modules))
                installed += modules
        after = Inspection.from_json(run_probe(ex, host, "inspect", import_probe_args(profile), timeout=300)).imports
        still = missing_modules(profile, after)
        if still:
            errors = "; ".join(f"{m}: {after.errors.get(m)}" for m in still)
            raise StepFailed(f"still missing in {profile.runtime.venv} after install: {errors}")
        ctx.journal.change(self.name)  # packages added to a venv stay: the unit rollback is what matters
        return f"installed {', '.join(installed) or 'nothing'}" + ("; venv created" if created else "")


def _last_lines(text: str, progress) -> None:
    """pip's output as progress notes, one line at a time."""
    for line in text.splitlines():
        if line.strip():
            progress(line.strip()[:100])


class PipProgress:
    """pip's output as one progress note that moves: what pip is doing (collecting, downloading a wheel of
    a known size, installing), for how long, and how far through the requirements it is. pip prints
    nothing while it downloads a large wheel, so the note is refreshed every REFRESH_S with its time."""

    REFRESH_S = 5.0
    _DOWNLOADING = re.compile(r"Downloading (\S+?)(?:\s+\((.+)\))?$")

    def __init__(self, requested: int, progress: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.requested, self.progress, self.clock = requested, progress, clock
        self.collected = 0
        self.doing, self.since = "starting", clock()
        self.pending = ""
        self.done = threading.Event()

    def feed(self, text: str) -> None:
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        for line in (l.strip() for l in lines):
            self.read(line)
        self.progress(self.line())

    def read(self, line: str) -> None:
        if line.startswith("Collecting "):
            self.collected += 1
            self.now(f"collecting {line.split()[1]}")
        elif (match := self._DOWNLOADING.match(line)) is not None:
            name, size = match.group(1).rsplit("/", 1)[-1], match.group(2)
            self.now(f"downloading {name}" + (f" ({size})" if size else ""))
        elif line.startswith("Installing collected packages:"):
            count = len(line.split(":", 1)[1].split(","))
            self.now(f"installing {count} package(s)")
        elif line.startswith("Successfully installed"):
            self.now("installed")

    def now(self, doing: str) -> None:
        self.doing, self.since = doing, self.clock()

    def line(self) -> str:
        return (f"pip: {self.doing}, {self.clock() - self.since:.0f}s; {self.collected} requirement(s) "
                f"collected ({self.requested} asked for, with their dependencies)")

    def refresh(self) -> None:
        while not self.done.wait(self.REFRESH_S):
            self.progress(self.line())

    def __enter__(self) -> "PipProgress":
        threading.Thread(target=self.refresh, name="pip-progress", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()

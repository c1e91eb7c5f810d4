"""Install missing runtime deps: probe imports in the venv, create it if absent, pip install what is
missing (from the index, or from a wheelhouse ddops pushes), probe again. A replicated profile's
balancer is Debian's `haproxy` package, installed with apt when the host lacks it."""

from __future__ import annotations

from ..errors import StepFailed
from ..facts import Imports, Inspection
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
    return argv + [profile.runtime.packages[m] for m in modules]


def plan_deps(profile: Profile, imports: Imports) -> list[Operation]:
    if profile.engine != "ddtree":
        return []
    operations = []
    if not imports.venv:
        operations.append(Operation(f"create venv {profile.runtime.venv}", commands=(tuple(venv_argv(profile)),),
                                    data={"venv": profile.runtime.venv}))
    missing = missing_modules(profile, imports)
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
        return plan_system_packages(ctx.profile, ctx.facts.dest) + plan_deps(ctx.profile, ctx.facts.dest.imports)

    def apply(self, ctx: RunContext, operations: list[Operation]) -> str:
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
                result = ex.run(host, list(op.commands[0]), timeout=3600,
                                on_output=lambda text: _last_lines(text, ctx.progress))
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

"""Step 4, install missing runtime deps: probe imports in the venv, create it if absent, pip
install what is missing (from the index, or from a wheelhouse ddops pushes), probe again."""

from __future__ import annotations

from ..errors import StepFailed
from ..profile import Profile
from .base import Change, PivotRun, check, run_probe
from .sync import rsync, rsync_argv

WHEELHOUSE = "/var/cache/ddops/wheelhouse"


def missing_modules(profile: Profile, imports: dict) -> list[str]:
    if profile.engine != "ddtree":
        return []
    if not imports.get("venv"):
        return sorted(profile.runtime.packages)
    mods = imports.get("modules", {})
    return [m for m in sorted(profile.runtime.packages) if not mods.get(m, {}).get("ok")]


def venv_argv(profile: Profile) -> list[str]:
    return ["python3", "-m", "venv", profile.runtime.venv]


def pip_argv(profile: Profile, modules: list[str]) -> list[str]:
    argv = [f"{profile.runtime.venv}/bin/python", "-m", "pip", "install", "--disable-pip-version-check",
            "--progress-bar", "off"]
    if not profile.runtime.index:
        argv += ["--no-index", "--find-links", WHEELHOUSE]
    return argv + [profile.runtime.packages[m] for m in modules]


def plan_deps(profile: Profile, imports: dict) -> list[Change]:
    if profile.engine != "ddtree":
        return []
    changes = []
    if not imports.get("venv"):
        changes.append(Change(f"create venv {profile.runtime.venv}"))
    missing = missing_modules(profile, imports)
    if missing:
        specs = [profile.runtime.packages[m] for m in missing]
        source = "the index" if profile.runtime.index else "a pushed wheelhouse"
        changes.append(Change(f"pip install {' '.join(specs)} (from {source})", data={"modules": missing}))
    return changes


class DepsStep:
    name = "deps"
    title = "Install runtime deps"

    def plan(self, run: PivotRun) -> list[Change]:
        return plan_deps(run.profile, run.inspect[run.profile.host].get("imports", {}))

    def apply(self, run: PivotRun, changes: list[Change]) -> str:
        profile, host, ex = run.profile, run.host, run.executor
        imports = run.inspect[profile.host].get("imports", {})
        if not imports.get("venv"):
            run.progress(f"creating {profile.runtime.venv}")
            check(ex.run(host, venv_argv(profile), timeout=300), "creating the venv")
        missing = missing_modules(profile, imports)
        if missing:
            if not profile.runtime.index:
                check(ex.run(host, ["mkdir", "-p", WHEELHOUSE]), "mkdir wheelhouse")
                rsync(rsync_argv(run.inventory, profile.runtime.wheelhouse, WHEELHOUSE, dst_host=host),
                      run.progress, "push wheelhouse")
            run.progress(f"pip install {' '.join(missing)}")
            last = []
            result = ex.run(host, pip_argv(profile, missing), timeout=3600,
                            on_output=lambda text: _tail(text, last, run.progress))
            check(result, "pip install " + " ".join(profile.runtime.packages[m] for m in missing))
        after = run_probe(ex, host, "inspect", {"imports": {"python": profile.runtime.python,
                                                            "modules": sorted(profile.runtime.packages)}},
                          timeout=300)["imports"]
        still = missing_modules(profile, after)
        if still:
            errors = "; ".join(f"{m}: {after['modules'].get(m, {}).get('error')}" for m in still)
            raise StepFailed(f"still missing in {profile.runtime.venv} after install: {errors}")
        run.changed["deps"] = True
        return f"installed {', '.join(missing) or 'nothing'}" + ("; venv created" if not imports.get("venv") else "")


def _tail(text: str, last: list, progress) -> None:
    for line in text.splitlines():
        if line.strip():
            progress(line.strip()[:100])

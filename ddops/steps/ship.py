"""Step 5, ship the runtime: build a wheel of ./runtime here, push it, pip install it into the venv,
record the release id (version + hash of the sources) next to the venv."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from ..errors import StepFailed
from .base import Change, PivotRun, check
from .preflight import release_path
from .sync import cache_dir

RELEASES = "/var/cache/ddops/releases"


def source_digest(package_dir: str) -> str:
    root = Path(package_dir)
    h = hashlib.sha256()
    # What goes into the wheel: the package's modules and the build metadata (not bench output).
    files = sorted([p for p in root.rglob("*.py") if "__pycache__" not in p.parts and "egg-info" not in str(p)
                    and not p.relative_to(root).parts[0] in ("bench", "tests", "build")]
                   + [root / "pyproject.toml"])
    for p in files:
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def release_id(package_dir: str) -> str:
    text = (Path(package_dir) / "pyproject.toml").read_text()
    version = next((line.split("=", 1)[1].strip().strip('"') for line in text.splitlines()
                    if line.strip().startswith("version")), "0")
    return f"{version}+{source_digest(package_dir)[:12]}"


def build_wheel(package_dir: str, release: str) -> Path:
    out = cache_dir() / "releases" / release
    wheels = list(out.glob("*.whl")) if out.is_dir() else []
    if wheels:
        return wheels[0]
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), package_dir], capture_output=True, text=True, timeout=600)
    wheels = list(out.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise StepFailed(f"building the runtime wheel failed: {done.stderr.strip()[-300:]}")
    return wheels[0]


def plan_ship(profile, installed: dict, release: str | None) -> list[Change]:
    if profile.runtime.ship is None or profile.engine != "ddtree":
        return []
    text = installed.get("text")
    current = None
    if text:
        try:
            current = json.loads(text).get("release")
        except ValueError:
            current = None
    if current == release:
        return []
    return [Change(f"install ddtree-runtime {release} into {profile.runtime.venv} (now: {current or 'none'})")]


class ShipStep:
    name = "ship"
    title = "Ship the runtime"

    def plan(self, run: PivotRun) -> list[Change]:
        profile = run.profile
        if profile.runtime.ship is None:
            return []
        run.release = release_id(profile.runtime.ship)
        installed = run.inspect[profile.host].get("files", {}).get(release_path(profile), {})
        return plan_ship(profile, installed, run.release)

    def apply(self, run: PivotRun, changes: list[Change]) -> str:
        profile, host, ex = run.profile, run.host, run.executor
        wheel = build_wheel(profile.runtime.ship, run.release)
        remote = f"{RELEASES}/{run.release}/{wheel.name}"
        check(ex.run(host, ["bash", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1.tmp" && mv "$1.tmp" "$1"',
                            "_", remote], stdin=wheel.read_bytes()), "pushing the wheel")
        check(ex.run(host, [profile.runtime.python, "-m", "pip", "install", "--disable-pip-version-check",
                            "--no-deps", "--force-reinstall", "-q", remote], timeout=600),
              "pip install the runtime wheel")
        record = json.dumps({"release": run.release, "wheel": wheel.name, "installed_at": time.time()}) + "\n"
        check(ex.run(host, ["bash", "-c", 'cat > "$1.tmp" && mv "$1.tmp" "$1"', "_", release_path(profile)],
                     stdin=record), "recording the release")
        run.changed["ship"] = True
        return f"release {run.release} installed"

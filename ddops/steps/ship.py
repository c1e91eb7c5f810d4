"""Ship the runtime: build a wheel of ./runtime here, push it, pip install it into the venv,
record the release id (version + hash of the sources) next to the venv."""

from __future__ import annotations

import json
import time

from ..facts import FileFact
from ..paths import RELEASES, release_path
from ..plan import Operation, PlanContext, RunContext
from ..profile import Profile
from ..release import build_wheel
from ..remote import check


def plan_ship(profile: Profile, installed: FileFact, release: str | None) -> list[Operation]:
    if profile.runtime.ship is None or profile.engine != "ddtree":
        return []
    current = None
    if installed.text:
        try:
            current = json.loads(installed.text).get("release")
        except ValueError:
            current = None
    if current == release:
        return []
    return [Operation(f"install ddtree-runtime {release} into {profile.runtime.venv} (now: {current or 'none'})",
                      data={"release": release})]


class ShipStep:
    name = "ship"
    title = "Ship the runtime"

    def plan(self, ctx: PlanContext) -> list[Operation]:
        installed = ctx.facts.dest.file(release_path(ctx.profile.runtime.venv))
        return plan_ship(ctx.profile, installed, ctx.facts.release)

    def apply(self, ctx: RunContext, operations: list[Operation]) -> str:
        profile, host, ex = ctx.profile, ctx.host, ctx.executor
        release = operations[0].data["release"]
        wheel = build_wheel(profile.runtime.ship, release)
        remote = f"{RELEASES}/{release}/{wheel.name}"
        check(ex.run(host, ["bash", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1.tmp" && mv "$1.tmp" "$1"',
                            "_", remote], stdin=wheel.read_bytes()), "pushing the wheel")
        check(ex.run(host, [profile.runtime.python, "-m", "pip", "install", "--disable-pip-version-check",
                            "--no-deps", "--force-reinstall", "-q", remote], timeout=600),
              "pip install the runtime wheel")
        record = json.dumps({"release": release, "wheel": wheel.name, "installed_at": time.time()}) + "\n"
        check(ex.run(host, ["bash", "-c", 'cat > "$1.tmp" && mv "$1.tmp" "$1"', "_",
                            release_path(profile.runtime.venv)], stdin=record), "recording the release")
        ctx.journal.change(self.name)
        return f"release {release} installed"

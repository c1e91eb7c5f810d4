"""Ship the runtime: build a wheel of ./runtime here, push it, pip install it into the venv,
record the release id (version + hash of the sources) next to the venv. The wheels stay on the host
(RELEASES/ID/), so a rollback reinstalls the release that was there before: a release that crashes is
taken back with its unit, not left in the venv under the old unit."""

from __future__ import annotations

import json
import time

from ..facts import FileFact
from ..paths import RELEASES, release_path
from ..plan import Operation, PlanContext, RunContext
from ..profile import Profile
from ..release import build_wheel
from ..remote import check, write_file
from ..undo import Reinstall


def plan_ship(profile: Profile, installed: FileFact, release: str | None) -> list[Operation]:
    if profile.runtime.ship is None or profile.engine != "ddtree":
        return []
    record: dict = {}
    if installed.text:
        try:
            record = json.loads(installed.text)
        except ValueError:
            record = {}
    current = record.get("release") if isinstance(record, dict) else None
    if current == release:
        return []
    data: dict = {"release": release}
    if current and isinstance(record.get("wheel"), str) and "/" not in record["wheel"]:
        # what a rollback reinstalls: the wheel ddops shipped for the release in place now
        data["previous"] = {"release": current, "python": profile.runtime.python,
                            "wheel": f"{RELEASES}/{current}/{record['wheel']}",
                            "record": release_path(profile.runtime.venv), "record_text": installed.text}
    return [Operation(f"install ddtree-runtime {release} into {profile.runtime.venv} (now: {current or 'none'})",
                      data=data, undo=Reinstall(data["previous"]) if "previous" in data else None)]


class ShipStep:
    name = "ship"
    title = "Ship the runtime"

    def plan(self, ctx: PlanContext) -> list[Operation]:
        installed = ctx.facts.dest.file(release_path(ctx.profile.runtime.venv))
        return plan_ship(ctx.profile, installed, ctx.facts.release)

    def apply(self, ctx: RunContext, operations: list[Operation]) -> str:
        profile, host, ex = ctx.profile, ctx.host, ctx.executor
        release, previous = operations[0].data["release"], operations[0].data.get("previous")
        # noted before pip touches the venv: a failed install is taken back as well
        ctx.journal.change(self.name, undo=None if previous is None else Reinstall(previous))
        wheel = build_wheel(profile.runtime.ship, release)
        remote = f"{RELEASES}/{release}/{wheel.name}"
        check(write_file(ex, host, remote, wheel.read_bytes()), "pushing the wheel")
        check(ex.run(host, [profile.runtime.python, "-m", "pip", "install", "--disable-pip-version-check",
                            "--no-deps", "--force-reinstall", "-q", remote], timeout=600),
              "pip install the runtime wheel")
        record = json.dumps({"release": release, "wheel": wheel.name, "installed_at": time.time()}) + "\n"
        check(write_file(ex, host, release_path(profile.runtime.venv), record),
              "recording the release")
        return f"release {release} installed"

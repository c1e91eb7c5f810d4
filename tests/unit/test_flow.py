"""The pivot without a lab: every step's plan pinned from fixture facts (the probes' JSON, as
preflight reads it), and the flow (outcome, exit code, when to roll back, the no-change rule) run
over a fake executor that answers the lock, history and rollback commands as a host would."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from rich.console import Console

import ddops.pivot as pivot_module
from ddops.errors import HostUnreachable, StepFailed
from ddops.executor import CommandResult
from ddops.facts import HostFacts, Inspection, PivotFacts
from ddops.gates import GateFailed, GateResult
from ddops.inventory import load_inventory
from ddops.plan import Operation, PlanContext, Undo
from ddops.probes import probe_source
from ddops.profile import load_profile
from ddops.steps import pivot_steps
from ddops.steps.training import TrainingStep
from ddops.steps.unit import render
from ddops.undo import Reinstall, RestoreBackup, StartAgain

REPO = Path(__file__).resolve().parents[2]
LAB = load_inventory(REPO / "inventories" / "lab.yaml")
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "pivot_facts.json").read_text())


@pytest.fixture(scope="module")
def profile():
    return load_profile(REPO / "playbooks" / "lab-ddtree16.yaml", repo_root=REPO)


def fixture_facts(profile, release="0.1.0+new") -> PivotFacts:
    local = json.loads(json.dumps(FIXTURE["inspect"]["local"]).replace("LOCAL_TARGET", profile.model("target").source.path))
    inspections = {name: Inspection.from_json(data) for name, data in FIXTURE["inspect"].items() if name != "local"}
    inspections["local"] = Inspection.from_json(local)
    return PivotFacts(serving="ct200", hosts={n: HostFacts.from_json(f) for n, f in FIXTURE["facts"].items()},
                      inspections=inspections, release=release)


def deployed_facts(profile, facts: PivotFacts) -> PivotFacts:
    """The same host after a pivot: training stopped, models synced, venv complete, unit in place and running."""
    rendered = render(profile, {})
    dest = facts.dest
    trees = {**dest.trees, **{m.path: facts.source_tree(m) for m in profile.models}}
    files = {**dest.files,
             "/etc/systemd/system/ddtree.service": {"exists": True, "sha256": rendered.unit_sha256, "text": rendered.unit_text},
             "/etc/ddops/ddtree.env": {"exists": True, "sha256": rendered.env_sha256, "text": rendered.env_masked},
             "/opt/ddtree/venv/ddtree-release.json": {"exists": True, "sha256": "x", "text": json.dumps({"release": facts.release})}}
    served = Inspection.from_json({
        "files": files, "imports": {"venv": True, "modules": {m: {"ok": True} for m in profile.runtime.packages}},
        "units": {"ddtree.service": {"ActiveState": "active", "UnitFileState": "enabled"}}})
    served = replace(served, trees=trees)
    host = replace(facts.host, training=replace(facts.host.training, running=False))
    return replace(facts, hosts={**facts.hosts, "ct200": host}, inspections={**facts.inspections, "ct200": served})


def plans(profile, facts: PivotFacts, kill_training=True) -> dict[str, list[str]]:
    before: dict[str, list[Operation]] = {}
    for step in pivot_steps():
        ctx = PlanContext(profile=profile, inventory=LAB, facts=facts, rendered=render(profile, {}),
                          kill_training=kill_training, before=dict(before))
        before[step.name] = step.plan(ctx)
    return {name: [op.what for op in ops] for name, ops in before.items()}


# -- every step's plan, from fixture facts ---------------------------------------------------------

def test_every_step_plans_the_first_pivot_from_the_facts(profile):
    target = profile.model("target").source.path
    assert plans(profile, fixture_facts(profile)) == {
        "training": ["stop training pid 412 (dflash-train.service) at step 1200\n  newest checkpoint step 1180 "
                     "(/root/train/checkpoints/step_1180.ckpt): a kill now loses 20 step(s); this run allows 20\n"
                     "  first SIGUSR1, then up to 30s for a newer checkpoint"],
        "sync": [f"sync target local:{target} -> /root/models/tiny-target: 2 file(s), 2.8 MiB",
                 "sync draft eval-a6000:/root/models/tiny-draft -> /root/models/tiny-draft: 2 file(s), 1.3 MiB"],
        "deps": ["create venv /opt/ddtree/venv",
                 "pip install fastapi>=0.110 prometheus_client>=0.17 safetensors>=0.4 tokenizers>=0.19 torch==2.13.0 "
                 "transformers>=4.51 uvicorn>=0.29 (from the index)"],
        "ship": ["install ddtree-runtime 0.1.0+new into /opt/ddtree/venv (now: none)"],
        "unit": ["write /etc/systemd/system/ddtree.service (new)", "write /etc/ddops/ddtree.env (mode 0600) (new)"],
        "kernels": [],   # no kernel store for the host's GPU model in these facts
        "start": ["enable ddtree.service", "restart ddtree.service (changed: deps, ship, sync, unit)"],
    }


def test_a_deployed_host_plans_nothing_and_nothing_restarts(profile):
    assert plans(profile, deployed_facts(profile, fixture_facts(profile))) == {
        "training": [], "sync": [], "deps": [], "ship": [], "unit": [], "kernels": [], "start": []}


def test_a_new_release_alone_restarts_the_unit(profile):
    facts = deployed_facts(profile, fixture_facts(profile))
    newer = plans(profile, replace(facts, release="0.1.0+newer"))
    assert newer["ship"] == ["install ddtree-runtime 0.1.0+newer into /opt/ddtree/venv (now: 0.1.0+new)"]
    assert newer["start"] == ["restart ddtree.service (changed: ship)"]
    assert [k for k, v in newer.items() if v] == ["ship", "start"]


def test_a_new_release_plans_how_to_reinstall_the_one_in_place(profile):
    facts = deployed_facts(profile, fixture_facts(profile))
    record = json.dumps({"release": "0.1.0+new", "wheel": "ddtree_runtime-0.1.0-py3-none-any.whl"})
    served = facts.inspections["ct200"]
    files = {**served.files, "/opt/ddtree/venv/ddtree-release.json": replace(
        served.files["/opt/ddtree/venv/ddtree-release.json"], text=record)}
    facts = replace(facts, release="0.1.0+newer", inspections={**facts.inspections, "ct200": replace(served, files=files)})
    ctx = PlanContext(profile=profile, inventory=LAB, facts=facts, rendered=render(profile, {}))
    ship = next(step for step in pivot_steps() if step.name == "ship")
    install, = ship.plan(ctx)
    assert install.data["previous"] == {
        "release": "0.1.0+new", "python": "/opt/ddtree/venv/bin/python",
        "wheel": "/var/cache/ddops/releases/0.1.0+new/ddtree_runtime-0.1.0-py3-none-any.whl",
        "record": "/opt/ddtree/venv/ddtree-release.json", "record_text": record}


def test_plans_are_data_with_their_undos(profile):
    ctx = PlanContext(profile=profile, inventory=LAB, facts=fixture_facts(profile), rendered=render(profile, {}),
                      kill_training=False)
    training, = pivot_steps()[0].plan(ctx)
    assert training.undo == StartAgain("dflash-train.service")
    assert training.requires == "a real run must stop training on ct200, so it needs --kill-training"
    assert training.data == {"pids": [412, 413], "limit": 20}
    assert training.figures == {"step": 1200, "checkpoint_step": 1180, "checkpoint": "/root/train/checkpoints/step_1180.ckpt",
                                "lost_steps": 20, "limit": 20, "checkpoint_request": "SIGUSR1"}
    assert pivot_steps()[0].plan(ctx) == [training]  # the same facts, the same plan: plan() changes nothing
    start = pivot_steps()[-1].plan(replace(ctx, before={"unit": [Operation("write unit")]}))
    assert [argv for op in start for argv in op.commands] == [
        ("systemctl", "enable", "ddtree.service"), ("systemctl", "reset-failed", "ddtree.service"),
        ("systemctl", "restart", "ddtree.service")]


# -- the flow over a fake executor -----------------------------------------------------------------

@dataclass
class FakeExecutor:
    """Answers like ct200: the lock, the history append, the unitfile action and systemctl; a command in
    `fail` exits 1, one in `unreachable` raises HostUnreachable. Every argv is kept in `commands`."""

    fail: set[str] = field(default_factory=set)
    unreachable: set[str] = field(default_factory=set)
    commands: list[list[str]] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)
    backups: list[dict] = field(default_factory=list)

    def run(self, host, argv, *, timeout=None, stdin=None, on_output=None) -> CommandResult:
        name = next((n for n in ("lock", "unitfile") if argv[:2] == ["python3", "-c"] and argv[2] == probe_source(n)),
                    None)
        shown = [name or argv[0], *argv[3:]] if name else list(argv)
        self.commands.append(shown)
        line = " ".join(shown)
        if any(word in line for word in self.unreachable):
            raise HostUnreachable(f"lost the SSH connection to {host.name}")
        if any(word in line for word in self.fail):
            return self.result(host, 1, "", f"{line}: failed")
        if name == "lock":
            return self.result(host, 0, json.dumps({"acquired": True, "released": True, "cleared": False,
                                                    "journal": None}))
        if name == "unitfile":
            spec = json.loads(stdin)
            # a restore finds the unit the pivot installed, and puts back what the backup holds
            out = self.backups if spec["action"] == "list" else {"before": {"unit": "installed"}, "after": {},
                                                                   "daemon_reload": {"rc": 0, "stderr": ""}}
            return self.result(host, 0, json.dumps(out))
        if argv[:2] == ["bash", "-c"] and "history" in argv[-1]:
            self.history.append(json.loads(stdin))
        return self.result(host, 0, "")

    @staticmethod
    def result(host, code: int, stdout: str, stderr: str = "") -> CommandResult:
        return CommandResult(host=host.name, command="", exit_code=code, stdout=stdout, stderr=stderr, duration_s=0)

    def systemctl(self) -> list[str]:
        """The systemctl commands that act (not the is-active reads)."""
        return [" ".join(c[1:]) for c in self.commands if c[0] == "systemctl" and c[1] != "is-active"]


class FakeStep:
    """Plans what it is given; its apply notes a change (with the undo it is given) or fails."""

    def __init__(self, name: str, operations: list[Operation], *, undo: Operation | None = None,
                 error: Exception | None = None, interrupt: bool = False) -> None:
        self.name, self.title = name, name.title()
        self.operations, self.undo, self.error, self.interrupt = operations, undo, error, interrupt
        self.applied: list[list[Operation]] = []

    def plan(self, ctx):
        return list(self.operations)

    def apply(self, ctx, operations):
        self.applied.append(operations)
        if self.interrupt:
            ctx.interrupted = "SIGINT"
        ctx.journal.change(self.name, undo=self.undo)
        if self.error is not None:
            raise self.error
        return f"applied {len(operations)}"


class FakeGate:
    def __init__(self, name: str, error: Exception | None = None) -> None:
        self.name, self.title, self.error, self.checked = name, name.title(), error, 0

    def describe(self, ctx):
        return f"check {self.name}"

    def check(self, ctx):
        self.checked += 1
        if self.error is not None:
            raise self.error
        return GateResult(f"{self.name} ok", {"ok": True})


def run_pivot(monkeypatch, profile, steps, gates=None, executor=None, **options):
    executor = executor or FakeExecutor()
    monkeypatch.setattr(pivot_module, "preflight", lambda *a, **k: (fixture_facts(profile), "1 host(s) ok"))
    console = Console(file=io.StringIO(), width=160, force_terminal=False)
    flow = pivot_module.Pivot(profile, LAB, executor, console, options=pivot_module.PivotOptions(yes=True, **options),
                              steps=steps, gates=[FakeGate("health")] if gates is None else gates)
    return flow.execute().as_json(), executor


def op(what: str, **data) -> Operation:
    return Operation(what, data=data)


def test_nothing_to_change_applies_nothing_restarts_nothing_and_still_gates(monkeypatch, profile):
    step, gate = FakeStep("unit", []), FakeGate("health")
    report, ex = run_pivot(monkeypatch, profile, [step], [gate])
    assert (report["outcome"], report["exit_code"]) == ("unchanged", 0)
    assert step.applied == [] and gate.checked == 1 and ex.systemctl() == []
    assert report["state"] == "ddtree.service on ct200 was already in place; nothing restarted; gates passed"
    assert [s["status"] for s in report["steps"]] == ["done", "skipped", "done", "done"]
    assert ex.history[-1]["outcome"] == "unchanged" and ex.history[-1]["gates"] == {"health": {"ok": True}}


def test_a_step_gets_exactly_the_operations_it_planned(monkeypatch, profile):
    planned = [op("write a", path="a"), op("write b", path="b")]
    step = FakeStep("unit", planned)
    report, ex = run_pivot(monkeypatch, profile, [FakeStep("sync", []), step])
    assert step.applied == [planned]
    assert (report["outcome"], report["exit_code"], report["changed"]) == ("ok", 0, ["unit"])
    assert [json.loads(c[1])["action"] for c in ex.commands if c[0] == "lock"] == [
        "acquire", "journal-open", "journal-note", "journal-note", "journal-note", "journal-close", "release"]


def test_a_failed_gate_after_a_change_replays_the_undos_newest_first(monkeypatch, profile):
    steps = [FakeStep("training", [op("stop training")], undo=StartAgain("dflash-train.service")),
             FakeStep("start", [op("stop conflicting sglang-qwen.service")], undo=StartAgain("sglang-qwen.service"))]
    report, ex = run_pivot(monkeypatch, profile, steps, [FakeGate("health", StepFailed("not healthy within 5s"))])
    assert (report["outcome"], report["exit_code"], report["failed_step"]) == ("rolled-back", 2, "health")
    assert ex.systemctl() == ["start sglang-qwen.service", "start dflash-train.service"]
    assert report["rollback"] == {"restarted": ["sglang-qwen.service", "dflash-train.service"]}
    assert report["state"] == ("rolled back on ct200: ddtree.service untouched; "
                               "running again: sglang-qwen.service, dflash-train.service")
    assert ex.history[-1]["outcome"] == "rolled-back"


def test_a_restore_restarts_what_its_backup_names_once(monkeypatch, profile):
    backup = {"id": "B1", "meta": {"unit_existed": False, "restart_after_rollback": ["dflash-train.service"]}}
    ex = FakeExecutor(backups=[backup])
    monkeypatch.setattr("ddops.rollback._settle", lambda *a, **k: "active")
    steps = [FakeStep("training", [op("stop training")], undo=StartAgain("dflash-train.service")),
             FakeStep("unit", [op("write unit")], undo=RestoreBackup("ddtree.service", "B1"))]
    report, ex = run_pivot(monkeypatch, profile, steps, [FakeGate("health", StepFailed("crashed"))], executor=ex)
    assert report["outcome"] == "rolled-back" and report["rollback"]["restarted"] == ["dflash-train.service"]
    assert ex.systemctl().count("start dflash-train.service") == 1
    assert report["state"] == ("rolled back on ct200: ddtree.service removed (it did not exist before); "
                               "running again: dflash-train.service")


def test_a_rollback_reinstalls_the_previous_release_before_it_restarts_anything(monkeypatch, profile):
    """A release that crashes on start: the old unit must come back on the old code, not on the new
    release left in the venv."""
    backup = {"id": "B1", "meta": {"unit_existed": True, "restart_after_rollback": ["ddtree.service"]}}
    ex = FakeExecutor(backups=[backup])
    monkeypatch.setattr("ddops.rollback._settle", lambda *a, **k: "active")
    monkeypatch.setattr("ddops.gates.health.wait_healthy",  # the restored unit's health gate
                        lambda *a, **k: {"seconds": 0.1, "health": {"status": "ok"}, "unreachable_polls": 0})
    previous = {"release": "0.1.0+old", "python": "/opt/ddtree/venv/bin/python", "wheel": "/var/cache/w.whl",
                "record": "/opt/ddtree/venv/ddtree-release.json", "record_text": '{"release": "0.1.0+old"}'}
    steps = [FakeStep("ship", [op("install 0.1.0+new")], undo=Reinstall(previous)),
             FakeStep("unit", [op("write unit")], undo=RestoreBackup("ddtree.service", "B1"))]
    report, ex = run_pivot(monkeypatch, profile, steps, [FakeGate("health", StepFailed("crashed on start"))],
                           executor=ex)
    assert report["outcome"] == "rolled-back" and report["rollback"]["reinstalled"] == "0.1.0+old"
    shown = [" ".join(c) for c in ex.commands]
    pip = next(i for i, c in enumerate(shown) if "pip install" in c and "/var/cache/w.whl" in c)
    record = next(i for i, c in enumerate(shown)   # the record written whole: its path, then its size
                  if c.endswith(f"/opt/ddtree/venv/ddtree-release.json {len(previous['record_text'])}"))
    restore = next(i for i, c in enumerate(shown) if c.startswith("unitfile"))  # the backup's list, then restore
    assert pip < record < restore, shown


def test_a_failure_before_any_change_is_failed_and_rolls_nothing_back(monkeypatch, profile):
    class Unchanged(FakeStep):
        def apply(self, ctx, operations):
            raise StepFailed("pip install failed")

    report, ex = run_pivot(monkeypatch, profile, [Unchanged("deps", [op("pip install x")]), FakeStep("unit", [op("w")])])
    assert (report["outcome"], report["exit_code"], report["changed"]) == ("failed", 2, [])
    assert "rolled_back" not in report and ex.systemctl() == []
    assert [s["status"] for s in report["steps"]] == ["done", "failed", "skipped", "skipped", "done"]


def test_a_training_stop_refused_after_its_checkpoint_request_is_recorded_as_refused(monkeypatch, profile):
    """The stop_training action sent SIGUSR1, got no newer checkpoint and left the job running: the pivot
    changed nothing, so neither the report nor the history line may call it a failed pivot."""
    refused = {"refused": True, "stopped": False, "pids": [412, 413], "unit": "dflash-train.service", "limit": 0,
               "step_now": 1205, "lost_at_kill": 25, "left": [412, 413],
               "checkpoint": {"path": "/root/train/checkpoints/step_1180.ckpt", "step": 1180},
               "request": {"sent": "SIGUSR1", "new_checkpoint": False, "waited_s": 30.0}}
    asked: list[str] = []
    monkeypatch.setattr("ddops.steps.training.run_probe",
                        lambda executor, host, name, args, **kw: asked.append(name) or refused)
    unit = FakeStep("unit", [op("write unit")])
    report, ex = run_pivot(monkeypatch, profile, [TrainingStep(), unit], kill_training=True)
    assert asked == ["stop_training"] and unit.applied == [] and ex.systemctl() == []
    assert (report["outcome"], report["exit_code"], report["changed"]) == ("refused", 2, [])
    assert report["state"] == "the training step refused: nothing was changed on ct200; ddtree.service is as it was"
    assert report["error"].startswith("stopping training on ct200 would lose 25 step(s) (step 1205, newest "
                                      "checkpoint step 1180), more than the 0 this run allows; SIGUSR1 got no newer")
    assert "rolled_back" not in report and "\n" not in report["error"]
    line, = ex.history
    assert (line["kind"], line["outcome"], line["error"]) == ("pivot", "refused", report["error"])
    assert line["training"]["refused"] and line["stopped_units"] == []


def test_a_gate_that_fails_when_nothing_changed_leaves_the_unit_as_it_was(monkeypatch, profile):
    report, ex = run_pivot(monkeypatch, profile, [FakeStep("unit", [])], [FakeGate("smoke", StepFailed("wrong"))])
    assert (report["outcome"], report["exit_code"], report["failed_step"]) == ("failed", 2, "smoke")
    assert report["state"] == "nothing was changed on ct200; ddtree.service is as it was"
    assert "rolled_back" not in report and ex.systemctl() == []


def test_no_rollback_leaves_the_host_and_says_how_to_restore_it(monkeypatch, profile):
    steps = [FakeStep("training", [op("stop")], undo=StartAgain("dflash-train.service"))]
    report, ex = run_pivot(monkeypatch, profile, steps, [FakeGate("health", StepFailed("crashed"))], no_rollback=True)
    assert (report["outcome"], report["exit_code"]) == ("failed", 2) and ex.systemctl() == []
    assert report["state"].startswith("--no-rollback: ct200 is left as the failed pivot made it")


def test_a_rollback_that_fails_needs_a_human(monkeypatch, profile):
    ex = FakeExecutor(fail={"systemctl start dflash-train.service"})
    steps = [FakeStep("training", [op("stop")], undo=StartAgain("dflash-train.service"))]
    report, _ = run_pivot(monkeypatch, profile, steps, [FakeGate("smoke", GateFailed("wrong answer", {"ok": False}))],
                          executor=ex)
    assert (report["outcome"], report["exit_code"], report["rolled_back"]) == ("rollback-failed", 2, False)
    assert report["gates"]["smoke"] == {"ok": False}  # what the failed gate measured is kept
    assert report["state"].startswith("ROLLBACK FAILED on ct200: needs a human")


def test_an_unreachable_host_before_any_change_exits_4(monkeypatch, profile):
    report, _ = run_pivot(monkeypatch, profile, [FakeStep("sync", [op("sync")], error=HostUnreachable("gone"))])
    # FakeStep notes its change before failing: a host lost after a change is a failed step (2), not 4
    assert report["exit_code"] == 2

    class Lost(FakeStep):
        def apply(self, ctx, operations):
            raise HostUnreachable("gone")

    report, _ = run_pivot(monkeypatch, profile, [Lost("sync", [op("sync")])])
    assert (report["outcome"], report["exit_code"]) == ("failed", 4)


def test_ctrl_c_stops_at_the_next_safe_point_rolls_back_and_exits_130(monkeypatch, profile):
    later = FakeStep("unit", [op("write")])
    steps = [FakeStep("training", [op("stop")], undo=StartAgain("dflash-train.service"), interrupt=True), later]
    report, ex = run_pivot(monkeypatch, profile, steps)
    assert later.applied == [] and (report["outcome"], report["exit_code"]) == ("rolled-back", 130)
    assert report["state"].startswith("interrupted by SIGINT during training; rolled back on ct200")
    assert report["error"] == "interrupted by SIGINT during training: stopped at a safe point, before unit"
    assert ex.systemctl() == ["start dflash-train.service"]


def test_an_interrupt_s_summary_names_the_step_that_was_running(monkeypatch, profile):
    """SIGINT while pip ran in deps: the summary says deps (it said ship, the step it stopped before)."""
    steps = [FakeStep("deps", [op("pip install")], interrupt=True), FakeStep("ship", [op("install wheel")])]
    report, _ = run_pivot(monkeypatch, profile, steps)
    assert report["state"].startswith("interrupted by SIGINT during deps;")
    assert report["failed_step"] == "ship" and "during deps" in report["error"]


def test_a_dry_run_changes_nothing_and_says_what_a_real_run_needs(monkeypatch, profile):
    step = FakeStep("training", [Operation("stop training", requires="a real run needs --kill-training")])
    report, ex = run_pivot(monkeypatch, profile, [step], dry_run=True)
    assert (report["outcome"], report["exit_code"]) == ("dry-run", 0)
    assert report["state"] == "nothing was changed; a real run needs --kill-training"
    assert step.applied == [] and ex.commands == []  # not even the lock


@dataclass(frozen=True)
class RemoveMarker(Undo):
    """A kind of undo the rollback has never heard of: it takes its own change back, and asks for the
    unit that read the marker to be started again."""

    path: str

    def apply(self, ctx):
        ctx.executor.run(ctx.host, ["rm", "-f", "--", self.path]).check(f"removing {self.path}")
        ctx.start_again("marker-reader.service")


def test_a_step_with_its_own_kind_of_undo_is_rolled_back_by_it(monkeypatch, profile):
    steps = [FakeStep("training", [op("stop training")], undo=StartAgain("dflash-train.service")),
             FakeStep("marker", [op("write /run/ddops-marker")], undo=RemoveMarker("/run/ddops-marker"))]
    report, ex = run_pivot(monkeypatch, profile, steps, [FakeGate("health", StepFailed("not healthy within 5s"))])
    assert (report["outcome"], report["exit_code"]) == ("rolled-back", 2)
    shown = [" ".join(c) for c in ex.commands]
    removed = shown.index("rm -f -- /run/ddops-marker")
    assert removed < shown.index("systemctl start marker-reader.service") < shown.index(
        "systemctl start dflash-train.service")   # newest first: the marker's undo before the training's
    assert report["rollback"] == {"restarted": ["marker-reader.service", "dflash-train.service"]}


def test_a_pivot_in_a_log_prints_its_step_list_once(monkeypatch, profile):
    monkeypatch.setattr(pivot_module, "preflight", lambda *a, **k: (fixture_facts(profile), "1 host(s) ok"))
    out = io.StringIO()
    flow = pivot_module.Pivot(profile, LAB, FakeExecutor(), Console(file=out, width=160, force_terminal=False),
                              options=pivot_module.PivotOptions(yes=True),
                              steps=[FakeStep("sync", [op("copy a")]), FakeStep("unit", [op("write unit")])])
    flow.execute()
    lines = out.getvalue().splitlines()
    assert sum("Preflight" in line for line in lines) == 2          # the banner, and its row in the one table
    assert [line.split() for line in lines if "Unit" in line] == [["•", "Unit", "planned", "write", "unit"],
                                                                  ["▶", "Unit", "..."],
                                                                  ["✔", "Unit:", "done", "0.0s:", "applied", "1"]]

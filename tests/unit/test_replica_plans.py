"""Replicas behind HAProxy and the rolling restart, without a lab: the profile, what renders, what every
step plans from fixture facts, preflight's checks, and the flow over a fake host that answers the
balancer's socket, the unit watch and the backups as ct200 would."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import yaml
from rich.console import Console

import ddops.pivot as pivot_module
from ddops.errors import ConfigError, StepFailed
from ddops.executor import CommandResult
from ddops.facts import HostFacts, Inspection, PivotFacts
from ddops.gates import GateFailed, GateResult
from ddops.inventory import load_inventory
from ddops.plan import Checks, Operation, PlanContext
from ddops.preflight import check_replicas, check_tensor_parallel, serving_args
from ddops.probes import probe_source
from ddops.profile import load_profile
from ddops.report import Report
from ddops.steps import pivot_steps
from ddops.steps.unit import install_spec, render

REPO = Path(__file__).resolve().parents[2]
LAB = load_inventory(REPO / "inventories" / "lab.yaml")
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "pivot_facts.json").read_text())
PLAYBOOK = REPO / "playbooks" / "lab-replicas.yaml"


def variant(tmp_path: Path, **changes) -> Path:
    """The lab replicas profile with `section__key` (or top-level) changes."""
    doc = yaml.safe_load(PLAYBOOK.read_text())
    for key, value in changes.items():
        section, _, sub = key.partition("__")
        if sub and value is None:
            doc[section].pop(sub)
        elif sub:
            doc.setdefault(section, {})[sub] = value
        elif value is None:
            doc.pop(section, None)
        else:
            doc[section] = value
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def profile():
    return load_profile(PLAYBOOK, repo_root=REPO)


# -- the profile -------------------------------------------------------------------------------------

def test_each_replica_gets_its_own_unit_port_and_gpu(profile):
    assert profile.replicated and profile.unit == "ddtree@.service"
    assert [(r.unit, r.port, r.gpus, r.server) for r in profile.replicas.members] == [
        ("ddtree@1.service", 8201, (0,), "r1"), ("ddtree@2.service", 8202, (1,), "r2")]
    assert profile.balancer.drain_timeout_s == 60 and profile.balancer.check_interval_s == 0.5


def test_replicas_slice_the_listed_gpus(tmp_path):
    p = load_profile(variant(tmp_path, gpus=[4, 5, 6, 7], serve__replicas={"count": 2, "gpus_each": 2,
                                                                          "first_port": 9000}), repo_root=REPO)
    assert [(r.port, r.gpus) for r in p.replicas.members] == [(9000, (4, 5)), (9001, (6, 7))]


@pytest.mark.parametrize("changes, message", [
    ({"unit": "ddtree.service", "conflicts": []},
     "replicas run as instances of a template unit, and ddtree.service is not one"),
    ({"serve__replicas": None}, "ddtree@.service is a template unit: it needs `serve.replicas`"),
    ({"gpus": [0], "serve__replicas": 2}, "2 replicas x 1 GPU(s) need 2 GPUs, `gpus` lists 1"),
    ({"serve__replicas": {"count": 2, "first_port": 8199}}, "leave the public port 8200 to the balancer"),
    ({"serve__replicas": {"count": 2, "gpus": 1}}, "unknown key `serve.replicas.gpus`"),
    ({"health__path": "/health#x"}, "cannot go into HAProxy's health check"),
    ({"balancer__drain_s": 3}, "unknown key `balancer.drain_s`"),
])
def test_bad_replica_settings_are_one_clear_line(tmp_path, changes, message):
    with pytest.raises(ConfigError) as err:
        load_profile(variant(tmp_path, **changes), repo_root=REPO)
    assert message in err.value.line() and "profile.yaml:" in err.value.line()


def test_a_plain_profile_is_not_replicated():
    plain = load_profile(REPO / "playbooks" / "lab-ddtree16.yaml", repo_root=REPO)
    assert not plain.replicated and plain.replicas is None and plain.balancer is None
    assert pivot_steps(plain)[-1].name == "start"


# -- what renders --------------------------------------------------------------------------------------

def test_the_template_unit_takes_port_and_gpus_from_each_instance(profile):
    rendered = render(profile, {})
    lines = rendered.unit_text.splitlines()
    assert "EnvironmentFile=/etc/ddops/ddtree@.env" in lines and "EnvironmentFile=/etc/ddops/ddtree@%i.env" in lines
    exec_start = next(line for line in lines if line.startswith("ExecStart="))
    assert "--host 127.0.0.1 --port ${DDOPS_REPLICA_PORT} " in exec_start  # only the balancer faces clients
    assert "CUDA_VISIBLE_DEVICES" not in rendered.env_text
    files = {f.path: f for f in rendered.files}
    assert files["/etc/ddops/ddtree@2.env"].text.splitlines()[1:] == [
        "DDOPS_REPLICA=2", "DDOPS_REPLICA_PORT=8202", "CUDA_VISIBLE_DEVICES=1"]
    assert files["/etc/ddops/ddtree@2.env"].mode == 0o600


def test_the_balancer_config_checks_each_replica_and_opens_the_admin_socket(profile):
    config = next(f for f in render(profile, {}).files if f.path == "/etc/haproxy/haproxy.cfg").text
    body = [line.strip() for line in config.splitlines() if line.strip() and not line.startswith("#")]
    assert "bind 127.0.0.1:8200" in body
    assert "stats socket /run/haproxy/admin.sock mode 600 level admin" in body
    assert "http-check send meth GET uri /health" in body and "http-check expect status 200" in body
    assert [line for line in body if line.startswith("server ")] == [
        "server r1 127.0.0.1:8201 check", "server r2 127.0.0.1:8202 check"]
    assert "timeout server 600000ms" in body  # a long generation is not a balancer error


def test_a_value_haproxy_would_split_is_refused_at_render(profile):
    # what a field added to the template later might carry: refused, never written
    hostile = replace(profile, balancer=replace(profile.balancer, backend="replicas\n    server evil 10.0.0.1:80"))
    with pytest.raises(ConfigError, match="HAProxy would not read as one word"):
        render(hostile, {})


def test_the_install_backs_up_every_replica_file_with_the_unit(profile):
    rendered = render(profile, {})
    spec = install_spec(profile, rendered, "B1", {})
    assert [f["path"] for f in spec["files"]] == ["/etc/ddops/ddtree@1.env", "/etc/ddops/ddtree@2.env",
                                                  "/etc/haproxy/haproxy.cfg", "/var/lib/ddops/replicas/ddtree@.json"]
    manifest = json.loads(spec["files"][-1]["text"])
    assert manifest["balancer"]["port"] == 8200 and [r["port"] for r in manifest["replicas"]] == [8201, 8202]


# -- plans from fixture facts --------------------------------------------------------------------------

def fixture_facts(profile) -> PivotFacts:
    local = json.loads(json.dumps(FIXTURE["inspect"]["local"]).replace("LOCAL_TARGET", profile.model("target").source.path))
    inspections = {name: Inspection.from_json(data) for name, data in FIXTURE["inspect"].items() if name != "local"}
    inspections["local"] = Inspection.from_json(local)
    return PivotFacts(serving="ct200", hosts={n: HostFacts.from_json(f) for n, f in FIXTURE["facts"].items()},
                      inspections=inspections, release="0.1.0+new")


def deployed(profile, facts: PivotFacts, deployed_profile=None) -> PivotFacts:
    """ct200 after `deployed_profile` (default: the same) was pivoted: replicas and HAProxy up."""
    rendered = render(deployed_profile or profile, {})
    files = {"/etc/systemd/system/ddtree@.service": {"exists": True, "sha256": rendered.unit_sha256, "text": rendered.unit_text},
             "/etc/ddops/ddtree@.env": {"exists": True, "sha256": rendered.env_sha256, "text": rendered.env_masked},
             "/opt/ddtree/venv/ddtree-release.json": {"exists": True, "sha256": "x",
                                                      "text": json.dumps({"release": facts.release})}}
    files.update({f.path: {"exists": True, "sha256": f.sha256, "text": f.text} for f in rendered.files})
    units = {r.unit: {"ActiveState": "active", "UnitFileState": "enabled"} for r in profile.replicas.members}
    units["haproxy.service"] = {"ActiveState": "active", "UnitFileState": "enabled"}
    served = Inspection.from_json({"files": files, "units": units, "commands": {"haproxy": "/usr/sbin/haproxy"},
                                   "imports": {"venv": True, "modules": {m: {"ok": True} for m in profile.runtime.packages}}})
    served = replace(served, trees={**facts.dest.trees, **{m.path: facts.source_tree(m) for m in profile.models}})
    host = replace(facts.host, training=replace(facts.host.training, running=False))
    return replace(facts, hosts={**facts.hosts, "ct200": host}, inspections={**facts.inspections, "ct200": served})


def plans(profile, facts, batch=1) -> dict[str, list[str]]:
    before: dict[str, list[Operation]] = {}
    for step in pivot_steps(profile):
        ctx = PlanContext(profile=profile, inventory=LAB, facts=facts, rendered=render(profile, {}),
                          kill_training=True, before=dict(before), batch=batch)
        before[step.name] = step.plan(ctx)
    return {name: [op.what for op in ops] for name, ops in before.items()}


def test_the_first_pivot_installs_haproxy_and_starts_every_replica(profile):
    planned = plans(profile, fixture_facts(profile))
    assert planned["deps"][0] == "apt-get install haproxy (the balancer in front of the replicas)"
    assert planned["unit"] == ["write /etc/systemd/system/ddtree@.service (new)",
                               "write /etc/ddops/ddtree@.env (mode 0600) (new)",
                               "write /etc/ddops/ddtree@1.env (new)", "write /etc/ddops/ddtree@2.env (new)",
                               "write /etc/haproxy/haproxy.cfg (new)", "write /var/lib/ddops/replicas/ddtree@.json (new)"]
    assert planned["start"] == ["enable ddtree@1.service", "start ddtree@1.service (port 8201 on GPU 0; not running)",
                                "enable ddtree@2.service", "start ddtree@2.service (port 8202 on GPU 1; not running)",
                                "enable haproxy.service", "start haproxy.service (port 8200; not running)"]
    assert planned["roll"] == []  # nothing was serving: nothing to roll


def test_a_deployed_host_plans_nothing(profile):
    assert plans(profile, deployed(profile, fixture_facts(profile))) == {
        "training": [], "sync": [], "deps": [], "ship": [], "unit": [], "kernels": [], "start": [], "roll": []}


def test_a_change_to_serving_replicas_is_a_rolling_restart_in_batches(profile, tmp_path):
    changed = load_profile(variant(tmp_path, serve__tree_budget=8), repo_root=REPO)
    facts = deployed(changed, fixture_facts(changed), deployed_profile=profile)
    one = plans(changed, facts)
    assert one["unit"] == ["write /etc/systemd/system/ddtree@.service"] and one["start"] == []
    assert one["roll"] == [
        "batch 1/2: ddtree@1.service — drain, restart (changed: unit), health + smoke, readmit",
        "batch 2/2: ddtree@2.service — drain, restart (changed: unit), health + smoke, readmit"]
    assert plans(changed, facts, batch=2)["roll"] == [
        "batch 1/1: ddtree@1.service, ddtree@2.service — drain, restart (changed: unit), health + smoke, readmit"]


def test_a_new_balancer_config_reloads_haproxy_without_a_restart(profile, tmp_path):
    changed = load_profile(variant(tmp_path, balancer={"timeout_s": 900}), repo_root=REPO)
    planned = plans(changed, deployed(changed, fixture_facts(changed), deployed_profile=profile))
    assert planned["unit"] == ["write /etc/haproxy/haproxy.cfg", "write /var/lib/ddops/replicas/ddtree@.json"]
    assert planned["start"] == ["reload haproxy.service (/etc/haproxy/haproxy.cfg changed)"]
    assert planned["roll"] == [f"batch {n}/2: ddtree@{n}.service — drain, restart (changed: unit), health + smoke, "
                               "readmit" for n in (1, 2)]


def test_fewer_replicas_stop_the_ones_dropped(profile, tmp_path):
    three = load_profile(variant(tmp_path, gpus=[0, 1, 2], serve__replicas=3), repo_root=REPO)
    facts = fixture_facts(profile)
    facts = replace(facts, hosts={**facts.hosts, "ct200": replace(facts.host, gpu_count=3)})
    planned = plans(profile, deployed(profile, facts, deployed_profile=three))
    assert planned["start"][0] == "stop and disable ddtree@3.service (no longer a replica)"
    assert "write /etc/haproxy/haproxy.cfg" in planned["unit"]


# -- preflight -----------------------------------------------------------------------------------------

def test_preflight_reads_every_replica_port_unit_and_file(profile):
    args = serving_args(profile, "dflash-train.service")
    assert args["ports"] == [8201, 8202] and args["commands"] == ["haproxy"]
    assert {"ddtree@1.service", "ddtree@2.service", "haproxy.service"} <= set(args["units"])
    assert {"/etc/ddops/ddtree@1.env", "/etc/haproxy/haproxy.cfg", "/var/lib/ddops/replicas/ddtree@.json"} <= set(args["files"])


def test_preflight_needs_a_gpu_per_replica(tmp_path):
    three = load_profile(variant(tmp_path, serve__replicas=3), repo_root=REPO)
    problem, = check_tensor_parallel(three, fixture_facts(three).host)  # the fixture's ct200 has 2 GPUs
    assert problem.startswith("ct200 has 2 GPU(s), and 3 replica(s) x 1 GPU(s) need 3: ddtree@1.service on GPU 0; "
                              "ddtree@2.service on GPU 1; ddtree@3.service on GPU 2 (")
    assert "profile.yaml:" in problem and problem.endswith("); lower serve.replicas, or deploy to a host with at least 3 GPUs")


def test_preflight_names_whatever_holds_a_replica_port(profile):
    facts = fixture_facts(profile)
    holder = {"pid": 77, "cmdline": "python3 -m http.server 8202", "unit": None}
    dest = replace(facts.dest, ports={8201: {"pid": 5, "cmdline": "ddtree-serve", "unit": "ddtree@1.service"},
                                      8202: holder},
                   port_holder={"pid": 9, "cmdline": "haproxy -Ws", "unit": "haproxy.service"})
    problems = check_replicas(profile, replace(facts, inspections={**facts.inspections, "ct200": dest}))
    assert problems == ["replica port 8202 on ct200 (for ddtree@2.service) is held by pid 77 (python3 -m http.server 8202)"]


# -- the flow over a fake ct200 ------------------------------------------------------------------------

@dataclass
class FakeCt200:
    """Answers the lock, history, unitfile (install, list, restore), balancer and unitwatch scripts, `cat`
    of the replicas manifest and systemctl; keeps every command and HAProxy's server states."""

    manifest: str
    backups: list[dict] = field(default_factory=list)
    commands: list[list[str]] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)
    haproxy: dict[str, str] = field(default_factory=lambda: {"r1": "UP", "r2": "UP"})
    timeline: list[str] = field(default_factory=list)   # what happened to each server, in order

    SCRIPTS = ("lock", "unitfile", "balancer", "unitwatch")

    def run(self, host, argv, *, timeout=None, stdin=None, on_output=None) -> CommandResult:
        name = next((n for n in self.SCRIPTS if argv[:2] == ["python3", "-c"] and argv[2] == probe_source(n)), None)
        shown = [name, *argv[3:]] if name else list(argv)
        self.commands.append(shown)
        if name == "lock":
            return self.ok(json.dumps({"acquired": True, "released": True, "cleared": False, "journal": None}))
        if name == "unitfile":
            spec = json.loads(stdin)
            if spec["action"] == "list":
                return self.ok(json.dumps(self.backups))
            if spec["action"] == "backup":  # the backup the pivot takes before any change, as the action records it
                self.backups.append({"id": spec["backup_id"], "meta": {**spec["meta"], "unit_existed": True}})
                return self.ok(json.dumps({"backup_id": spec["backup_id"], "meta": spec["meta"]}))
            return self.ok(json.dumps({"before": {}, "after": {}, "changed": [], "daemon_reload": {"rc": 0, "stderr": ""}}))
        if name == "balancer":
            spec = json.loads(stdin)
            for server in spec["servers"]:
                if spec["action"] in ("drain", "ready"):
                    self.haproxy[server] = {"drain": "DRAIN", "ready": "UP"}[spec["action"]]
                    self.timeline.append(f"{spec['action']} {server}")
            states = {s: {"status": st, "sessions": 0, "queued": 0} for s, st in self.haproxy.items()}
            return self.ok(json.dumps({"ok": True, "waited_s": 0.1, "states": states, "error": None}))
        if name == "unitwatch":
            unit = json.loads(argv[3])["unit"]
            return self.ok(json.dumps({"unit": {"ActiveState": "active", "SubState": "running", "MainPID": "42",
                                                "NRestarts": "0", "unit": unit},
                                       "health": {"http_status": 200, "body": {"status": "ok"}}}))
        if argv[:1] == ["cat"]:
            return self.ok(self.manifest)
        if argv[:2] == ["systemctl", "is-active"]:
            return self.ok("active\n")
        if argv[:2] == ["systemctl", "restart"]:
            self.timeline.append(f"restart {argv[2]}")
        if argv[:2] == ["bash", "-c"] and "history" in argv[-1]:
            if stdin is None:  # history.read
                return self.ok("".join(json.dumps(r) + "\n" for r in self.history))
            self.history.append(json.loads(stdin))
        return self.ok("")

    @staticmethod
    def ok(stdout: str) -> CommandResult:
        return CommandResult(host="ct200", command="", exit_code=0, stdout=stdout, stderr="", duration_s=0)


class BatchGate:
    """A gate that fails for the replicas in `bad` (and remembers what it checked)."""

    def __init__(self, name: str, bad: set[str] = frozenset()) -> None:
        self.name, self.title, self.bad, self.checked = name, name.title(), bad, []

    def describe(self, ctx):
        return f"check {self.name}"

    def check(self, ctx):
        units = [r.unit for r in ctx.serving()]
        self.checked.append(units)
        if self.bad & set(units):
            raise GateFailed(f"{', '.join(sorted(self.bad & set(units)))} crashed on start", {"units": units})
        return GateResult(f"{self.name} ok on {len(units)}", {"units": units})


def rolling_pivot(monkeypatch, tmp_path, profile, gates, batch=1, ct200=FakeCt200):
    changed = load_profile(variant(tmp_path, serve__tree_budget=8), repo_root=REPO)
    facts = deployed(changed, fixture_facts(changed), deployed_profile=profile)
    monkeypatch.setattr(pivot_module, "preflight", lambda *a, **k: (facts, "1 host(s) ok"))
    manifest = next(f.text for f in render(profile, {}).files if f.path.endswith("ddtree@.json"))
    ex = ct200(manifest=manifest)
    console = Console(file=io.StringIO(), width=160, force_terminal=False)
    flow = pivot_module.Pivot(changed, LAB, ex, console, gates=gates,
                              options=pivot_module.PivotOptions(yes=True, batch=batch))
    return flow, ex


def test_a_rolling_restart_drains_restarts_gates_and_readmits_one_at_a_time(monkeypatch, tmp_path, profile):
    health, smoke = BatchGate("health"), BatchGate("smoke")
    flow, ex = rolling_pivot(monkeypatch, tmp_path, profile, [health, smoke])
    report = flow.execute().as_json()
    assert (report["outcome"], report["exit_code"]) == ("ok", 0), report
    assert ex.timeline == ["drain r1", "restart ddtree@1.service", "ready r1",
                           "drain r2", "restart ddtree@2.service", "ready r2"]
    # each batch checked alone by both gates, then every replica by the run's gates
    assert health.checked == [["ddtree@1.service"], ["ddtree@2.service"], ["ddtree@1.service", "ddtree@2.service"]]
    assert smoke.checked == health.checked
    assert [(b["batch"], b["replicas"], b["ok"]) for b in report["rolling"]] == [
        (1, ["ddtree@1.service"], True), (2, ["ddtree@2.service"], True)]
    assert all(b["total_s"] >= 0 and b["drained"] for b in report["rolling"])
    assert ex.history[-1]["rolling"] == report["rolling"]


def test_a_failed_batch_halts_is_rolled_back_and_the_rest_never_stops(monkeypatch, tmp_path, profile):
    flow, ex = rolling_pivot(monkeypatch, tmp_path, profile, [BatchGate("health", {"ddtree@1.service"})])
    report = flow.execute().as_json()
    assert (report["outcome"], report["exit_code"], report["failed_step"]) == ("rolled-back", 2, "roll")
    assert "rolling restart halted at batch 1/2 (ddtree@1.service): health failed" in report["error"]
    assert "ddtree@2.service kept serving the old release" in report["error"]
    # replica 2 was never drained nor restarted; replica 1 went back on the restored files, then readmitted
    assert ex.timeline == ["drain r1", "restart ddtree@1.service", "drain r1", "restart ddtree@1.service", "ready r1"]
    assert report["state"] == ("rolled back on ct200: batch 1 (ddtree@1.service) failed at health; ddtree@1.service "
                               "returned to the previous release and healthy; ddtree@2.service never stopped serving")
    assert report["rollback"]["restarted"] == ["ddtree@1.service"]
    assert ex.backups[0]["meta"]["replicas_before"] == ["ddtree@1.service", "ddtree@2.service"]
    assert report["rolling"] == [{"batch": 1, "replicas": ["ddtree@1.service"], "ok": False, "drain_s": 0.1,
                                  "drained": True, "sessions_left": 0, "failed_at": "health",
                                  "error": "ddtree@1.service crashed on start",
                                  "total_s": report["rolling"][0]["total_s"]}]


def test_ctrl_c_during_a_batch_exits_130_after_rolling_it_back(monkeypatch, tmp_path, profile):
    class CtrlC(BatchGate):
        def check(self, ctx):
            ctx.interrupted = "SIGINT"
            ctx.check_interrupt()

    flow, ex = rolling_pivot(monkeypatch, tmp_path, profile, [CtrlC("health")])
    report = flow.execute().as_json()
    assert (report["outcome"], report["exit_code"]) == ("rolled-back", 130), report
    assert report["rolling"][0]["error"] == "interrupted"
    assert ex.timeline == ["drain r1", "restart ddtree@1.service", "drain r1", "restart ddtree@1.service", "ready r1"]


INSTALLED_SHA = "ab" * 32   # the template unit's checksum, as the pivot that installed it recorded it


@dataclass
class RecordedCt200(FakeCt200):
    """ct200 whose history holds the pivot that installed the replicas now in place (the lab profile,
    found by the unit file's checksum), whose replicas report that profile's mode and block size, and
    answer the smoke probe: wrongly on the replicas in `bad_smoke`."""

    bad_smoke: set[str] = field(default_factory=set)

    def run(self, host, argv, *, timeout=None, stdin=None, on_output=None) -> CommandResult:
        script = argv[2] if argv[:2] == ["python3", "-c"] else None
        if argv[:1] == ["tail"]:
            checks = Checks.of(load_profile(PLAYBOOK, repo_root=REPO)).record()
            return self.ok(json.dumps({"kind": "pivot", "outcome": "ok", "unit": "ddtree@.service",
                                       "unit_sha256": INSTALLED_SHA, "checks": checks}) + "\n")
        if argv[:1] == ["sha256sum"]:
            return self.ok(f"{INSTALLED_SHA}  {argv[-1]}\n")
        if script == probe_source("unitwatch"):
            return self.ok(json.dumps({"unit": {"ActiveState": "active", "SubState": "running", "MainPID": "42",
                                                "NRestarts": "0"},
                                       "health": {"http_status": 200,
                                                  "body": {"status": "ok", "mode": "ddtree", "block_size": 16}}}))
        if script == probe_source("smoke"):
            spec = json.loads(stdin)
            unit = f"ddtree@{spec['port'] - 8200}.service"
            self.timeline.append(f"smoke {unit}")
            ok = unit not in self.bad_smoke
            return self.ok(json.dumps({"ok": ok, "results": [
                {"prompt": p["prompt"], "ok": ok, "lossless": True,
                 "problems": [] if ok else [f"answer 'x' does not match {p['expect']!r}"]} for p in spec["prompts"]]}))
        return super().run(host, argv, timeout=timeout, stdin=stdin, on_output=on_output)


def test_the_rollback_runs_the_restored_profile_s_smoke_on_each_restored_replica(monkeypatch, tmp_path, profile):
    flow, ex = rolling_pivot(monkeypatch, tmp_path, profile, [BatchGate("health", {"ddtree@1.service"})],
                             ct200=RecordedCt200)
    report = flow.execute().as_json()
    assert (report["outcome"], report["exit_code"]) == ("rolled-back", 2), report
    assert ex.timeline == ["drain r1", "restart ddtree@1.service", "drain r1", "restart ddtree@1.service",
                           "smoke ddtree@1.service", "ready r1"]
    assert report["rollback"]["checked"] == {"ddtree@1.service": {"profile": "lab-replicas", "health": "passed",
                                                                  "smoke": "passed"}}
    assert report["rollback"]["replicas"]["ddtree@1.service"]["smoke"]["ok"]
    assert report["state"].endswith("ddtree@2.service never stopped serving; smoke passed on ddtree@1.service")


def test_a_restored_replica_that_fails_smoke_is_reported_and_left_drained(monkeypatch, tmp_path, profile):
    flow, ex = rolling_pivot(monkeypatch, tmp_path, profile, [BatchGate("health", {"ddtree@1.service"})],
                             ct200=lambda manifest: RecordedCt200(manifest=manifest, bad_smoke={"ddtree@1.service"}))
    report = flow.execute().as_json()
    assert (report["outcome"], report["exit_code"], report["rolled_back"]) == ("rollback-failed", 2, False)
    assert report["rollback_error"].startswith("smoke test failed on ct200: ddtree@1.service 'What is 2+3?'")
    assert report["rollback"]["checked"] == {"ddtree@1.service": {"profile": "lab-replicas", "health": "passed",
                                                                  "smoke": "failed"}}
    assert ex.timeline[-1] == "smoke ddtree@1.service"    # never readmitted: HAProxy keeps it drained
    assert report["state"].startswith("ROLLBACK FAILED on ct200: needs a human (smoke test failed")
    assert "smoke failed on ddtree@1.service" in report["state"] and "healthy" not in report["state"]


def test_a_restored_replica_no_pivot_recorded_gets_its_health_check_and_the_report_says_so(monkeypatch, tmp_path,
                                                                                             profile):
    flow, ex = rolling_pivot(monkeypatch, tmp_path, profile, [BatchGate("health", {"ddtree@1.service"})])
    report = flow.execute().as_json()
    assert report["outcome"] == "rolled-back"
    assert report["rollback"]["checked"] == {"ddtree@1.service": {
        "profile": None, "health": "passed",
        "smoke": "not run: no pivot recorded the restored unit's profile (its smoke test is unknown)"}}
    assert "smoke" not in report["state"]


def test_ddops_rollback_may_skip_the_smoke_never_the_health(profile):
    from ddops.rollback import rollback_command

    manifest = next(f.text for f in render(profile, {}).files if f.path.endswith("ddtree@.json"))
    ex = RecordedCt200(manifest=manifest, backups=[{"id": "B1", "meta": {
        "unit_existed": True, "replicas_before": ["ddtree@1.service", "ddtree@2.service"]}}])
    report = rollback_command(ex, LAB, LAB.host("ct200"), "ddtree@.service", None, lambda m: None, skip_smoke=True)
    assert report["restarted"] == ["ddtree@1.service", "ddtree@2.service"]
    assert ex.timeline == ["drain r1", "restart ddtree@1.service", "ready r1",
                           "drain r2", "restart ddtree@2.service", "ready r2"]
    assert report["checked"] == {u: {"profile": "lab-replicas", "health": "passed", "smoke": "not run: --skip-smoke"}
                                 for u in ("ddtree@1.service", "ddtree@2.service")}
    assert ex.history[-1]["checked"] == report["checked"]


def test_dry_run_prints_the_rolling_plan_and_touches_nothing(monkeypatch, tmp_path, profile):
    changed = load_profile(variant(tmp_path, serve__tree_budget=8), repo_root=REPO)
    facts = deployed(changed, fixture_facts(changed), deployed_profile=profile)
    monkeypatch.setattr(pivot_module, "preflight", lambda *a, **k: (facts, "1 host(s) ok"))
    out = io.StringIO()
    ex = FakeCt200(manifest="{}")
    report = pivot_module.Pivot(changed, LAB, ex, Console(file=out, width=200, force_terminal=False),
                                options=pivot_module.PivotOptions(dry_run=True, batch=1)).execute().as_json()
    assert report["outcome"] == "dry-run" and ex.commands == []
    text = out.getvalue()
    assert "Rolling restart" in text and "batch 2/2: ddtree@2.service" in text and "--tree-budget 8" in text


# -- host by host --------------------------------------------------------------------------------------

class HostGate:
    """Passes, except on the hosts in `bad`; remembers the hosts it checked, in order."""

    def __init__(self, bad: set[str], seen: list[str]) -> None:
        self.name, self.title, self.bad, self.seen = "health", "Health", bad, seen

    def describe(self, ctx):
        return "check"

    def check(self, ctx):
        self.seen.append(ctx.profile.host)
        if ctx.profile.host in self.bad:
            raise StepFailed(f"not healthy on {ctx.profile.host}")
        return GateResult("ok", {})


def group_rollout(monkeypatch, bad: set[str]):
    from ddops.undo import StartAgain
    from ddops.rollout import rollout

    plain = load_profile(REPO / "playbooks" / "lab-ddtree16.yaml", repo_root=REPO)
    group = replace(plain, host="serving")     # the lab's serving role: ct200, then llm-two
    monkeypatch.setattr(pivot_module, "preflight", lambda profile, *a, **k: (
        replace(fixture_facts(profile), serving=profile.host,
                hosts={**fixture_facts(profile).hosts, "llm-two": fixture_facts(profile).host},
                inspections={**fixture_facts(profile).inspections, "llm-two": fixture_facts(profile).dest}), "ok"))
    seen: list[str] = []

    class Change:
        name, title = "unit", "Unit"

        def plan(self, ctx):
            return [Operation(f"write the unit on {ctx.profile.host}")]

        def apply(self, ctx, operations):
            ctx.journal.change("unit", undo=StartAgain("x.service"))
            return "written"

    ex = FakeCt200(manifest="{}")
    console = Console(file=io.StringIO(), width=160, force_terminal=False)
    report = rollout(group, LAB, ex, console, options=pivot_module.PivotOptions(yes=True),
                     steps=[Change()], gates=[HostGate(bad, seen)])
    return report, seen


def test_a_group_is_pivoted_host_by_host(monkeypatch):
    report, seen = group_rollout(monkeypatch, set())
    assert seen == ["ct200", "llm-two"] and report["hosts"] == ["ct200", "llm-two"]
    assert (report["outcome"], report["exit_code"], report["halted_at"]) == ("ok", 0, None)
    assert [r["host"] for r in report["reports"]] == ["ct200", "llm-two"]


def test_a_group_rollout_halts_at_the_first_failed_host(monkeypatch):
    report, seen = group_rollout(monkeypatch, {"ct200"})
    assert seen == ["ct200"]                       # llm-two never touched
    assert (report["outcome"], report["exit_code"], report["halted_at"]) == ("rolled-back", 2, "ct200")
    assert report["not_reached"] == ["llm-two"] and "not reached: llm-two" in report["state"]
    report, seen = group_rollout(monkeypatch, {"llm-two"})
    assert seen == ["ct200", "llm-two"] and report["halted_at"] == "llm-two"
    assert report["reports"][0]["outcome"] == "ok" and "done before it: ct200" in report["state"]


# -- nothing a profile holds can add a line or a word to the balancer's config -------------------------

# each starts with / so that a health path gets past its own check and meets HAProxy's
HOSTILE = ["/x\n    server evil 10.0.0.1:80", "/a b", "/health#comment", '/q"uote', "/back\\slash", "/${HOME}", "/a'b"]


@pytest.mark.parametrize("payload", HOSTILE)
@pytest.mark.parametrize("key", ["name", "bind", "health__path"])
def test_values_that_reach_haproxy_cfg_are_refused_at_load(tmp_path, key, payload):
    changes = {key: payload} if key != "bind" else {key: payload, "secrets": {"DDTREE_API_KEY": {"env": "K"}}}
    with pytest.raises(ConfigError):
        load_profile(variant(tmp_path, **changes), repo_root=REPO)


def test_the_config_has_exactly_the_directives_of_a_plain_render(tmp_path, profile):
    """A bind host name, an API key and a long health path change values, never the config's shape."""
    other = load_profile(variant(tmp_path, bind="serving.example.org", health__path="/v1/health-check_2",
                                 secrets={"DDTREE_API_KEY": {"env": "K"}}), repo_root=REPO)

    def shape(p):
        config = next(f.text for f in render(p, {"DDTREE_API_KEY": "k\ney"}).files if f.path.endswith(".cfg"))
        return [line.split()[0] for line in config.splitlines() if line.strip() and not line.startswith("#")]

    assert shape(other) == shape(profile)

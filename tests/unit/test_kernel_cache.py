"""The kernel store without a lab: which host's cache is seeded from which store (an empty cache only, the
store of its own GPU model only, before a (re)start only), the exact rsync that seeds it, the store replaced
whole by a harvest, and a harvest that fails: a warning, never a failed deploy."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console
from test_flow import REPO, LAB, FakeExecutor, FakeGate, FakeStep, deployed_facts, fixture_facts, op, run_pivot

import ddops.pivot as pivot_module
from ddops import kernels
from ddops.errors import HostUnreachable, StepFailed
from ddops.facts import Gpu, PathFact
from ddops.plan import Operation, PlanContext, RunContext
from ddops.profile import load_profile
from ddops.steps import pivot_steps
from ddops.steps.kernels import KernelsStep, seed_decision
from ddops.steps.unit import render
from ddops.views import render_summary

H100 = "NVIDIA H100 80GB HBM3"   # the fixture host's GPUs


@pytest.fixture(scope="module")
def profile():
    return load_profile(REPO / "playbooks" / "lab-ddtree16.yaml", repo_root=REPO)


def plan_contexts(profile, facts, kernel_seed: bool = True) -> tuple[dict[str, list[Operation]], PlanContext]:
    """Every step's plan, as the flow makes them, and the context the last one saw."""
    before: dict[str, list[Operation]] = {}
    ctx = PlanContext(profile=profile, inventory=LAB, facts=facts, rendered=render(profile, {}), kill_training=True,
                      kernel_seed=kernel_seed)
    for step in pivot_steps(profile):
        before[step.name] = step.plan(replace(ctx, before=dict(before)))
    return before, replace(ctx, before=before)


def kernel_plan(profile, facts, kernel_seed: bool = True) -> list[str]:
    return [o.what for o in plan_contexts(profile, facts, kernel_seed)[0]["kernels"]]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """A control machine's cache of its own for every test (the store lives under it)."""
    monkeypatch.setenv("DDOPS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def stored(model: str = H100, files: dict[str, str] | None = None, host: str = "h1") -> kernels.Stored:
    """A store for `model`, as a harvest from `host` would leave it."""
    files = files or {"5f2a/fused_rms.json": "{}", "5f2a/fused_rms.cubin": "x" * 2048}

    def fill(staging: Path) -> None:
        for rel, text in files.items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_text(text)

    kernels.replace_store(model, fill, {"gpu_model": model, "host": host, "harvested_at": "2026-12-03T10:00:00Z",
                                        "files": len(files), "bytes": sum(len(t) for t in files.values())})
    return kernels.read_store(model)


def with_cache(facts, entries: int | None, *, store=None, gpus=None, record=None):
    """The fixture facts with ct200's Triton cache holding `entries` names (None: no such dir)."""
    directory = "/var/cache/ddtree/triton"
    fact = PathFact(real=directory, exists=entries is not None, dir=entries is not None, entries=entries or 0)
    dest = replace(facts.dest, paths={**facts.dest.paths, directory: fact})
    host = facts.host if gpus is None else replace(facts.host, gpus=gpus)
    return replace(facts, kernel_store=store, kernel_record=record, inspections={**facts.inspections, "ct200": dest},
                   hosts={**facts.hosts, "ct200": host})


def with_record(model: str, host: str, harvested_at: str) -> kernels.Stored:
    """A store for `model` whose cache holds the runtime's compile record."""
    store = stored(model, {kernels.RECORD: "record", "5f2a/fused_rms.cubin": "x" * 64}, host=host)
    manifest = kernels.store_dir(model) / kernels.MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "harvested_at": harvested_at}))
    return replace(store, harvested_at=harvested_at)


# -- the decision -----------------------------------------------------------------------------------

def test_the_store_is_keyed_by_the_gpu_model_as_the_facts_name_it(profile):
    assert kernels.slug("NVIDIA RTX PRO 6000 Blackwell Server Edition") == "nvidia-rtx-pro-6000-blackwell-server-edition"
    assert kernels.store_dir("NVIDIA RTX A6000").name == "nvidia-rtx-a6000"
    facts = fixture_facts(profile)
    assert kernels.gpu_model(facts.host) == H100
    mixed = replace(facts.host, gpus=(Gpu(0, "NVIDIA RTX A6000"), Gpu(1, H100)))
    assert kernels.gpu_model(mixed) == f"{H100} + NVIDIA RTX A6000"   # a mixed host shares with no one
    assert kernels.gpu_model(replace(facts.host, gpus=(), gpu_error="nvidia-smi not found")) is None


@pytest.mark.parametrize("entries, has_store, enabled, deployed, outcome", [
    (None, True, True, False, "seed"),     # no cache dir yet: seeded
    (0, True, True, False, "seed"),        # an empty one: seeded
    (3, True, True, False, "kept"),        # the host has its own: never overwritten
    (0, False, True, False, "none"),       # no store for its model
    (0, True, False, False, "off"),        # --no-kernel-seed
    (0, True, True, True, "idle"),         # nothing (re)starts: nothing to seed before
])
def test_only_an_empty_cache_is_seeded_and_only_before_a_start(profile, entries, has_store, enabled, deployed,
                                                                outcome):
    store = stored() if has_store else None
    facts = fixture_facts(profile)
    facts = with_cache(deployed_facts(profile, facts) if deployed else facts, entries, store=store)
    plans, ctx = plan_contexts(profile, facts, kernel_seed=enabled)
    assert [o.what for o in plans["kernels"]] == (
        [f"seed /var/cache/ddtree/triton from the kernel store for {H100} (2 files, 0.0 MiB, "
         "harvested from h1 at 2026-12-03T10:00:00Z)"] if outcome == "seed" else [])
    decision = seed_decision(ctx)   # what the report says, from the same plans
    assert decision.outcome == outcome
    assert decision.words() == {
        "seed": "seeded from store (2 files, 0.0 MiB, harvested from h1 at 2026-12-03T10:00:00Z)",
        "kept": "kept (host has its own)", "none": f"none for {H100} yet", "off": "not seeded (--no-kernel-seed)",
        "idle": "not seeded: nothing (re)starts"}[outcome]


def test_a_store_of_another_gpu_model_is_never_read(profile):
    stored("NVIDIA RTX A6000")
    facts = fixture_facts(profile)
    assert kernels.read_store(kernels.gpu_model(facts.host)) is None
    assert kernels.read_store("NVIDIA RTX A6000").host == "h1"
    a6000 = (Gpu(0, "NVIDIA RTX A6000"), Gpu(1, "NVIDIA RTX A6000"))
    matched = with_cache(facts, 0, store=kernels.read_store("NVIDIA RTX A6000"), gpus=a6000)
    assert kernel_plan(profile, matched)[0].startswith(
        "seed /var/cache/ddtree/triton from the kernel store for NVIDIA RTX A6000 (2 files")
    unknown = with_cache(facts, 0, gpus=())
    assert kernel_plan(profile, unknown) == []


def test_a_model_without_a_store_gets_the_newest_compile_record_of_another(profile):
    """With no store for the host's model, the newest store of another model that holds the runtime's
    compile record is the source, for that file alone; never the host's own model's, nor one without a
    record."""
    assert kernels.read_record_store(H100) is None                       # no store at all
    stored("NVIDIA RTX A6000")                                           # a store, but no record in it
    assert kernels.read_record_store(H100) is None
    with_record("NVIDIA H200", "h200-a", "2026-12-02T09:00:00Z")
    newest = with_record("NVIDIA RTX PRO 6000 Blackwell Server Edition", "ct200", "2026-12-03T11:00:00Z")
    with_record(H100, "h100-b", "2026-12-04T08:00:00Z")                  # the host's own model: never this way
    assert kernels.read_record_store(H100) == newest
    assert kernels.read_record_store(None) is None
    facts = with_cache(fixture_facts(profile), 0, record=newest)
    plans, ctx = plan_contexts(profile, facts)
    assert [o.what for o in plans["kernels"]] == [
        "seed /var/cache/ddtree/triton with the compile record from the kernel store for NVIDIA RTX PRO 6000 "
        f"Blackwell Server Edition (no store for {H100} yet)"]
    decision = seed_decision(ctx)
    assert decision.outcome == "record" and decision.store == newest
    assert decision.words() == ("seeded with the compile record of NVIDIA RTX PRO 6000 Blackwell Server Edition "
                                "(harvested from ct200 at 2026-12-03T11:00:00Z): the first warm-up compiles those "
                                "kernels at once")
    own = with_cache(fixture_facts(profile), 0, store=stored(), record=newest)   # its own model's store wins
    assert seed_decision(plan_contexts(profile, own)[1]).outcome == "seed"
    for facts, outcome in ((with_cache(fixture_facts(profile), 4, record=newest), "kept"),
                           (with_cache(deployed_facts(profile, fixture_facts(profile)), 0, record=newest), "idle")):
        assert seed_decision(plan_contexts(profile, facts)[1]).outcome == outcome
    assert seed_decision(plan_contexts(profile, facts, kernel_seed=False)[1]).outcome == "off"
    argv = kernels.seed_argv(LAB, LAB.host("ct200"), newest, "/var/cache/ddtree/triton", record_only=True)
    assert argv[7:9] == [f"--include=/{kernels.RECORD}", "--exclude=*"]    # that one file, nothing else
    assert argv[-2] == f"{newest.path}/"


def test_the_seed_pushes_into_the_cache_through_pct_deleting_nothing_and_root_s(profile):
    store = stored()
    argv = kernels.seed_argv(LAB, LAB.host("ct200"), store, "/var/cache/ddtree/triton")
    assert argv[:7] == ["rsync", "-a", "--delay-updates", "--ignore-existing", "--no-owner", "--no-group",
                        "--chmod=D755,F644"]
    assert not any(a.startswith("--delete") for a in argv)   # nothing the host has is removed
    assert argv[argv.index("--rsync-path") + 1] == "pct exec 200 -- rsync"
    assert argv[-3:] == ["--", f"{store.path}/", "root@127.0.0.1:/var/cache/ddtree/triton/"]


def test_a_failed_seed_empties_the_cache_again_and_the_deploy_goes_on(profile, monkeypatch):
    store = stored()
    decision = kernels.SeedDecision("seed", "/var/cache/ddtree/triton", "ct200", H100, store)
    monkeypatch.setattr(kernels, "rsync", lambda *a, **k: (_ for _ in ()).throw(
        StepFailed("seed ct200:/var/cache/ddtree/triton: rsync exit 11: file I/O error")))
    ex = FakeExecutor()
    ctx = RunContext(profile=profile, inventory=LAB, executor=ex)
    summary = KernelsStep().apply(ctx, [op("seed", decision=decision)])
    assert summary.startswith("not seeded (seed ct200:/var/cache/ddtree/triton: rsync exit 11")
    assert ex.commands == [["mkdir", "-p", "--", "/var/cache/ddtree/triton"],
                           ["find", "/var/cache/ddtree/triton", "-mindepth", "1", "-delete"]]
    assert ctx.journal.changed == [] and ctx.journal.kernels["seed"]["outcome"] == "failed"
    words = kernels.report(decision, ctx.journal.kernels["seed"], None, dry_run=False)
    assert words["line"] == "not seeded" and words["warnings"][0].startswith(
        "kernel cache not seeded on ct200: seed ct200:/var/cache/ddtree/triton: rsync exit 11")


# -- the store and the harvest -------------------------------------------------------------------------

class Host1(FakeExecutor):
    """ct200 answering the inspect probe with its Triton cache (`files`: relative path -> size)."""

    def __init__(self, files: dict[str, int]) -> None:
        super().__init__()
        self.files = files

    def run(self, host, argv, *, timeout=None, stdin=None, on_output=None):
        if argv[:2] == ["python3", "-c"] and "trees" in argv[-1]:
            tree = {"exists": bool(self.files), "files": {r: [s, 0, None] for r, s in self.files.items()},
                    "bytes": sum(self.files.values()), "config": None}
            return self.result(host, 0, json.dumps({"trees": {"/var/cache/ddtree/triton": tree}}))
        return super().run(host, argv, timeout=timeout, stdin=stdin, on_output=on_output)


def test_a_harvest_replaces_the_store_whole_and_records_where_and_when(profile, monkeypatch, cache):
    old = stored(files={"old/k.json": "{}"})
    pulled: list[list[str]] = []

    def fake_rsync(argv, progress, what, timeout):
        pulled.append(argv)
        staging = Path(argv[-1])
        (staging / "9c1e").mkdir(parents=True)
        (staging / "9c1e" / "attn.cubin").write_text("y" * 4096)

    monkeypatch.setattr(kernels, "rsync", fake_rsync)
    result = kernels.harvest(Host1({"9c1e/attn.cubin": 4096}), LAB, LAB.host("ct200"), profile,
                             fixture_facts(profile).host, lambda m: None)
    assert result == {"outcome": "harvested", "gpu_model": H100, "files": 1, "bytes": 4096}
    argv = pulled[0]
    assert f"--link-dest={old.path}" in argv and "--delete-after" in argv   # unchanged files linked, not copied
    assert argv[-2] == "root@127.0.0.1:/var/cache/ddtree/triton/"
    new = kernels.read_store(H100)
    assert (new.host, new.files, new.bytes) == ("ct200", 1, 4096)
    assert sorted(p.relative_to(new.path).as_posix() for p in Path(new.path).rglob("*") if p.is_file()) == [
        "9c1e/attn.cubin"]
    manifest = json.loads((Path(new.path).parent / "manifest.json").read_text())
    assert manifest["profile"] == "lab-ddtree16" and manifest["dir"] == "/var/cache/ddtree/triton"
    assert sorted(p.name for p in (cache / "kernels").iterdir()) == [".nvidia-h100-80gb-hbm3.lock",
                                                                    "nvidia-h100-80gb-hbm3"]
    assert kernels.report(kernels.SeedDecision("kept", "/var/cache/ddtree/triton", "ct200", H100), None, result,
                          dry_run=False)["line"] == "kept (host has its own); harvested (1 files, 0.0 MiB)"


@pytest.mark.parametrize("files, failure, warning", [
    ({"a/k.cubin": 10}, StepFailed("harvest ct200:/var/cache/ddtree/triton: rsync exit 12: protocol data stream "
                                   "broke (connection lost?)"), "rsync exit 12: protocol data stream broke"),
    ({"a/k.cubin": 10}, HostUnreachable("lost the SSH connection to ct200"), "lost the SSH connection to ct200"),
    ({"a/k.cubin": 5 * 2**30}, None, "holds 5120.0 MiB, over the store's bound of 4096.0 MiB: not harvested"),
])
def test_a_failed_harvest_is_a_warning_and_the_old_store_stays(profile, monkeypatch, files, failure, warning):
    old = stored()

    def fake_rsync(argv, progress, what, timeout):
        (Path(argv[-1]) / "half").mkdir()   # what arrived before it failed
        raise failure

    monkeypatch.setattr(kernels, "rsync", fake_rsync)
    result = kernels.harvest(Host1(files), LAB, LAB.host("ct200"), profile, fixture_facts(profile).host,
                             lambda m: None)
    assert result["outcome"] in ("failed", "too-big") and warning in result["error"]
    assert kernels.read_store(H100) == old
    assert sorted(p.name for p in Path(old.path).parent.parent.iterdir()) == [".nvidia-h100-80gb-hbm3.lock",
                                                                            "nvidia-h100-80gb-hbm3"]
    decision = kernels.SeedDecision("seed", "/var/cache/ddtree/triton", "ct200", H100, old)
    words = kernels.report(decision, {"outcome": "seeded"}, result, dry_run=False)
    assert words["warnings"] == [f"kernel cache not harvested from ct200: {result['error']}"]


def test_an_empty_cache_harvests_nothing(profile, monkeypatch):
    monkeypatch.setattr(kernels, "rsync", lambda *a, **k: pytest.fail("nothing to pull"))
    result = kernels.harvest(Host1({}), LAB, LAB.host("ct200"), profile, fixture_facts(profile).host,
                             lambda m: None)
    assert result == {"outcome": "empty", "gpu_model": H100, "files": 0, "bytes": 0}
    assert kernels.read_store(H100) is None


# -- in the flow: after the gates, and never failing a deploy that passed ---------------------------------

def test_a_harvest_that_fails_leaves_the_deploy_ok_with_a_warning(monkeypatch, profile):
    report, ex = run_pivot(monkeypatch, profile, [FakeStep("unit", [op("write unit")])])
    assert (report["outcome"], report["exit_code"]) == ("ok", 0)
    cache = report["kernel_cache"]
    assert cache["seed"]["outcome"] == "none" and cache["line"] == f"none for {H100} yet"
    assert cache["harvest"]["outcome"] == "failed"   # the fake host answers the probe with nothing
    assert cache["warnings"] == [f"kernel cache not harvested from ct200: {cache['harvest']['error']}"]
    assert ex.history[-1]["outcome"] == "ok" and ex.history[-1]["kernel_cache"] == cache
    console = Console(file=io.StringIO(), width=300, force_terminal=False)
    render_summary(report, console)
    shown = console.file.getvalue()
    assert f"  kernel cache: none for {H100} yet\n" in shown and "  warning: kernel cache not harvested from ct200" in shown


def test_nothing_is_harvested_when_a_gate_fails(monkeypatch, profile):
    report, ex = run_pivot(monkeypatch, profile, [FakeStep("unit", [op("write unit")])],
                           [FakeGate("health", StepFailed("not healthy within 5s"))])
    assert report["outcome"] == "rolled-back" and report["kernel_cache"]["harvest"] is None
    assert not [c for c in ex.commands if c[:2] == ["python3", "-c"]]   # no inspect probe for a harvest


def test_a_dry_run_says_what_it_would_seed(monkeypatch, profile):
    store = stored()
    monkeypatch.setattr("ddops.pivot.preflight", lambda *a, **k: (with_cache(fixture_facts(profile), 0, store=store),
                                                                  "1 host(s) ok"))
    flow = pivot_module.Pivot(profile, LAB, FakeExecutor(), Console(file=io.StringIO()),
                              options=pivot_module.PivotOptions(dry_run=True), steps=[KernelsStep()], gates=[])
    report = flow.execute().as_json()
    assert report["kernel_cache"]["line"] == ("would be seeded from store (2 files, 0.0 MiB, harvested from h1 at "
                                              "2026-12-03T10:00:00Z)")
    assert report["kernel_cache"]["harvest"] is None


def test_ddops_kernels_lists_the_store_by_gpu_model_newest_first(monkeypatch):
    """`ddops kernels`: a row per GPU model, whether its cache holds the compile record, and --json."""
    from click.testing import CliRunner

    from ddops.cli import cli

    empty = CliRunner().invoke(cli, ["kernels"], catch_exceptions=False)
    assert empty.exit_code == 0 and "no kernel store in" in empty.output
    with_record("NVIDIA H200", "h200-a", "2026-12-02T09:00:00Z")
    stored("NVIDIA RTX A6000", host="a6000-1")
    listed = CliRunner().invoke(cli, ["kernels", "--json"], catch_exceptions=False)
    assert listed.exit_code == 0
    rows = json.loads(listed.output)
    assert [(r["gpu_model"], r["host"], r["compile_record"], r["files"]) for r in rows] == [
        ("NVIDIA RTX A6000", "a6000-1", False, 2), ("NVIDIA H200", "h200-a", True, 2)]
    table = CliRunner().invoke(cli, ["kernels"], catch_exceptions=False, env={"COLUMNS": "200"})
    assert "h200-a" in table.output and "2026-12-02T09:00:00Z" in table.output and "yes" in table.output


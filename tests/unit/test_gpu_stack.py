"""Issue 37 without hosts: the facts probe's GPU health parsers on nvidia-smi, kernel-log and pip samples
(tests/unit/fixtures/gpuhealth), the health words, and the CUDA stack checks preflight makes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddops import cudastack, gpuhealth
from ddops.facts import HostFacts
from ddops.gpucheck import check_gpus, used_gpus
from ddops.lab.paths import ASSETS
from ddops.probes import probe_source

FIXTURES = Path(__file__).parent / "fixtures" / "gpuhealth"


def probe(answers: dict[str, tuple[int, str]], kmsg: Path | None = None) -> dict:
    """The facts probe's functions, their commands answered from `answers` (by the argv's first two words)."""
    source = probe_source("facts")
    namespace: dict = {}
    exec(source[:source.rindex("main()")], namespace)
    namespace["KMSG"] = str(kmsg or "/nonexistent/kmsg")
    asked: list[list[str]] = []

    def run(argv, timeout=10):
        asked.append(argv)
        key = " ".join(argv[:2]).split("=")[0]
        code, text = answers.get(key, (127, ""))
        return code, text, "" if code == 0 else f"{argv[0]}: not found"

    namespace["run"] = run
    namespace["asked"] = asked
    return namespace


def sample(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_health_fields_parse_from_an_h100_query_with_holders_and_the_kernel_log():
    ns = probe({"nvidia-smi --query-gpu": (0, sample("h100_query.csv")),
                "nvidia-smi --query-compute-apps": (0, sample("compute_apps.csv")),
                "nvidia-smi --version": (0, sample("smi_version.txt"))}, kmsg=FIXTURES / "kmsg.txt")
    gpus = ns["gpus"](True)
    first, second, third = gpus["list"]
    assert gpus["driver"] == {"version": "550.54.15", "cuda": "12.4"}
    assert (first["ecc_volatile"], first["remap_pending"], first["retired_pending"], first["throttle"]) == (0, False, None, [])
    assert (second["ecc_volatile"], second["ecc_aggregate"], second["remap_pending"]) == (2, 7, True)
    assert third["throttle"] == ["SwPowerCap", "HwThermalSlowdown"]          # 0x44
    assert first["processes"] == [{"pid": 4190001, "name": "/usr/bin/python3", "used_mib": 71230, "unit": None,
                                   "seen": False}]   # no such pid here: another namespace's
    assert second["processes"] == [] and third["processes"][0]["pid"] == 4190002
    assert gpus["xid"]["source"] == str(FIXTURES / "kmsg.txt")
    assert [(e["xid"], e["bus"], e["at_s"]) for e in gpus["xid"]["events"]] == [(79, "0000:2a:00", 1337.85),
                                                                               (13, "0000:18:00", 1400.0)]


def test_a_real_h200s_answer_parses_healthy():
    """Captured from an H200 (driver 580.159.04): "No" remapping pending, "[N/A]" retired pages (Hopper
    remaps rows instead), throttle 0x1 (idle, a setting) -> a healthy card, nothing unknown but the pages."""
    ns = probe({"nvidia-smi --query-gpu": (0, sample("h200_query_captured.csv")),
                "nvidia-smi --query-compute-apps": (0, ""),
                "nvidia-smi --version": (0, sample("h200_version_captured.txt"))})
    gpus = ns["gpus"](True)
    gpu, = gpus["list"]
    assert gpus["error"] is None and gpus["driver"] == {"version": "580.159.04", "cuda": "13.0"}
    assert (gpu["name"], gpu["memory_total_mib"], gpu["compute_cap"], gpu["bus_id"]) == (
        "NVIDIA H200", 143771, 9.0, "00000000:00:06.0")
    assert (gpu["ecc_volatile"], gpu["ecc_aggregate"], gpu["remap_pending"], gpu["retired_pending"],
            gpu["throttle"]) == (0, 0, False, None, [])
    health, = gpuhealth.assess({"gpus": gpus}, [])
    assert not health.faults and not health.warnings


def test_cards_without_ecc_or_remapping_are_unknown_not_errors():
    ns = probe({"nvidia-smi --query-gpu": (0, sample("rtx4090_query.csv") + sample("t4_query.csv")),
                "nvidia-smi --query-compute-apps": (0, "")})
    rtx, t4 = ns["gpus"]()["list"]
    assert (rtx["ecc_volatile"], rtx["ecc_aggregate"], rtx["remap_pending"], rtx["retired_pending"]) == (None,) * 4
    assert rtx["throttle"] == ["SwPowerCap"]
    assert (t4["remap_pending"], t4["retired_pending"]) == (None, True)
    assert rtx["processes"] == []   # 412 MiB used: asked, and nobody on it


def test_idle_gpus_cost_no_second_nvidia_smi_call_and_no_kernel_log_is_unknown():
    idle = "0, NVIDIA RTX A6000, 1, 49140, 0, 8.6, 570.133.20, 00000000:18:00.0, 0, 0, No, [N/A], 0x0000000000000001\n"
    ns = probe({"nvidia-smi --query-gpu": (0, idle)})
    gpus = ns["gpus"]()
    assert len(ns["asked"]) == 2 and ns["asked"][1][0] == "journalctl"   # the query, then the journal
    assert gpus["list"][0]["processes"] == [] and gpus["driver"]["cuda"] is None
    assert gpus["xid"]["events"] is None and "/nonexistent/kmsg" in gpus["xid"]["error"]


def test_xids_from_the_journal_and_the_cuda_version_from_the_table_header():
    ns = probe({"journalctl -k": (0, sample("journal_k.txt")), "nvidia-smi --version": (0, "NVIDIA-SMI version  : 470.1\n"),
                "nvidia-smi": (0, sample("smi_table_header.txt"))})
    assert ns["xid_events"]() == {"source": "journalctl -k", "error": None, "events": [
        {"xid": 48, "bus": "0000:3a:00", "at_s": 2211.005, "text": sample("journal_k.txt").split("48, ")[1].split("\n")[0]}]}
    assert ns["cuda_version"]() == "12.2"


def facts_with(rows: list[dict], events=(), training=None, services=()) -> dict:
    return {"gpus": {"list": rows, "error": None, "driver": {"version": "570.133.20", "cuda": "12.8"},
                     "xid": {"source": "/dev/kmsg", "error": None, "events": list(events)}},
            "training": training, "services": list(services)}


def gpu(index: int, **health) -> dict:
    bus = f"0000:{0x18 + 0x10 * index:02x}:00"
    return {"index": index, "name": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "memory_total_mib": 97887,
            "compute_cap": 12.0, "bus_id": f"0000{bus.upper()}.0", "bus": bus, "ecc_volatile": 0, "ecc_aggregate": 0,
            "remap_pending": False, "retired_pending": None, "throttle": [], "processes": [], **health}


def test_health_words_and_faults():
    training = {"pids": [700], "unit": {"unit": "dflash-train.service"}}
    facts = facts_with([gpu(0, processes=[{"pid": 700, "name": "python3", "used_mib": 9000, "unit": None}]),
                        gpu(1, ecc_volatile=3), gpu(2, remap_pending=True), gpu(3, throttle=["SwPowerCap"]),
                        gpu(4, throttle=["HwSlowdown"]),
                        gpu(5, processes=[{"pid": 9, "name": "x", "used_mib": 10, "unit": "user@0.service"},
                                          {"pid": 8, "name": "y", "used_mib": 10, "unit": None, "seen": False}]),
                        gpu(6), gpu(7)],
                       events=[{"xid": 79, "bus": "0000:78:00", "at_s": 12.5, "text": "off the bus"},
                               {"xid": 13, "bus": "0000:88:00", "at_s": 13.0, "text": "app fault"}], training=training)
    health = gpuhealth.assess(facts)
    assert [h.word for h in health] == ["ok", "ecc", "remap", "ok", "throttled", "held by 9", "xid 79", "ok"]
    assert health[6].faults == ("Xid 79 (GPU has fallen off the bus) at 12.5 s since boot",)
    assert health[7].faults == () and "Xid 13" in health[7].warnings[0]
    assert gpuhealth.stray_xids(facts) == []
    lost = facts_with([gpu(0)], events=[{"xid": 79, "bus": "0000:3b:00", "at_s": 9.0, "text": "off"}])
    assert gpuhealth.stray_xids(lost) == ["Xid 79 (GPU has fallen off the bus) on bus 0000:3b:00, which no listed "
                                          "GPU has, at 9 s since boot"]
    assert gpuhealth.words([h.as_json() for h in health]) == (
        "ok x3, GPU 1 ecc, GPU 2 remap, GPU 4 throttled, GPU 5 held by 9, GPU 6 xid 79")


def test_the_lab_nvidia_smi_answers_the_health_fields_as_the_real_one(tmp_path):
    config = {"model": "NVIDIA RTX A6000", "count": 2, "memory_mib": 49140, "uuids": ["GPU-a", "GPU-b"],
              "bus_ids": ["00000000:18:00.0", "00000000:28:00.0"], "ecc": True,
              "faults": {"1": {"ecc_volatile": 1, "remap_pending": True, "throttle": ["HwSlowdown"]}}}
    (tmp_path / "gpus.json").write_text(json.dumps(config))
    env = {"DDOPS_GPU_CONFIG": str(tmp_path / "gpus.json"), "DDOPS_GPU_HOLD_DIR": str(tmp_path / "holds"),
           "DDOPS_KMSG": str(tmp_path / "kmsg"), "PYTHONPATH": str(ASSETS)}
    fields = ("ecc.errors.uncorrected.volatile.total,remapped_rows.pending,retired_pages.pending,"
              "clocks_throttle_reasons.active")
    out = subprocess.run([sys.executable, str(ASSETS / "nvidia-smi"), f"--query-gpu={fields}", "--format=csv"],
                         capture_output=True, text=True, env=env, timeout=30)
    assert out.stdout.splitlines() == [
        "ecc.errors.uncorrected.volatile.total, remapped_rows.pending, retired_pages.pending, "
        "clocks_throttle_reasons.active", "0, No, [N/A], 0x0000000000000001", "1, Yes, [N/A], 0x0000000000000009"]
    xid = subprocess.run([sys.executable, "-m", "ddops_lab_gpu", "xid", "1", "79"], capture_output=True, text=True,
                         env=env, timeout=30)
    assert xid.returncode == 0 and (tmp_path / "kmsg").read_text().split(";", 1)[1] == (
        "NVRM: Xid (PCI:0000:28:00): 79, pid=1234, name=python3, GPU has fallen off the bus.\n")
    (tmp_path / "kmsg").unlink()   # `clear` leaves the log as lab up made it, an empty root-only file, even then
    clear = subprocess.run([sys.executable, "-m", "ddops_lab_gpu", "clear"], capture_output=True, text=True, env=env,
                           timeout=30)
    assert clear.returncode == 0 and (tmp_path / "kmsg").read_text() == ""
    assert (tmp_path / "kmsg").stat().st_mode & 0o777 == 0o600


# -- the CUDA stack ------------------------------------------------------------------------------------

def test_the_cuda_of_a_torch_build():
    assert cudastack.cuda_of("2.7.1+cu128") == ((12, 8), True)
    assert cudastack.cuda_of("2.9.0+cu130") == ((13, 0), True)
    assert cudastack.cuda_of("2.13.0+cpu") == (None, True)
    assert cudastack.cuda_of("2.6.0") == (None, False)
    pypi = json.loads(sample("pip_report_pypi.json"))
    assert cudastack.from_report(pypi, "pip").cuda == (12, 4)
    assert cudastack.from_report(json.loads(sample("pip_report_cu128.json")), "pip").version == "2.7.1+cu128"


@pytest.mark.parametrize("archs, capability, covered", [
    ("7.0;7.5;8.0;8.6;9.0;10.0;12.0", 12.0, True), ("5.0;6.0;7.0;7.5;8.0;8.6;9.0", 12.0, False),
    ("5.0;6.0;7.0;7.5;8.0;8.6;9.0", 8.9, True),    # sm_86 binaries run on 8.9
    ("7.5;8.0;8.6;9.0;10.0;12.0+PTX", 12.1, True), ("7.0;7.5;8.0;8.6;9.0;10.0;12.0", 10.3, True),
    ("7.5;8.0;8.6;9.0", 7.0, False)])
def test_arch_coverage(archs, capability, covered):
    assert cudastack.covers(archs, capability) is covered


@pytest.mark.parametrize("torch_version, fla, refused", [
    ("2.6.0+cu126", "fla-core==0.6.0", True), ("2.6.0+cu126", "fla-core", True),
    ("2.6.0+cu126", "fla-core>=0.5", True), ("2.6.0+cu126", "fla-core<0.6", False),
    ("2.6.0+cu126", "fla-core==0.5.1", False), ("2.7.1+cu128", "fla-core==0.6.0", False),
    ("2.13.0+cpu", "fla-core==0.6.0", False)])
def test_fla_core_asks_its_torch_where_pip_does_not(torch_version, fla, refused):
    """fla-core 0.6's torch>=2.7 sits under its cuda extra, which a plain `fla-core` skips: preflight asks it."""
    build = cudastack.TorchBuild(torch_version, (12, 6), "runtime.torch")
    problems = cudastack.check_companions(build, {"torch": "torch", "fla": fla, "fastapi": "fastapi>=0.100"})
    assert bool(problems) is refused
    if refused:
        assert f"{fla} needs torch 2.7.0 or newer" in problems[0] and "pin torch>=2.7.0" in problems[0]


def test_the_stack_checks_name_the_fix():
    blackwell = [(0, "NVIDIA RTX PRO 6000", 12.0)]
    cu128 = cudastack.TorchBuild("2.7.1+cu128", (12, 8), "runtime.torch")
    assert cudastack.check_build(cu128, "ct200", "570.133.20", blackwell) == []
    old, = cudastack.check_build(cu128, "ct200", "535.104.05", blackwell)
    assert "needs CUDA 12.8, which needs NVIDIA driver 570.26 or newer, and ct200 has driver 535.104.05" in old
    assert "upgrade the driver to 570.26 or newer and pin `runtime.torch: {version: \"2.7.0\", cuda: \"12.8\"}`" in old
    cu126 = cudastack.TorchBuild("2.6.0+cu126", (12, 6), "pip")
    arch, = cudastack.check_build(cu126, "ct200", "570.133.20", blackwell)
    assert "not ct200's GPU 0 (NVIDIA RTX PRO 6000, sm_120)" in arch and 'cuda: "12.8"' in arch
    cpu, = cudastack.check_build(cudastack.TorchBuild("2.13.0+cpu", None, "pip"), "ct200", "570.133.20", blackwell)
    assert "is a CPU build" in cpu
    assert cudastack.check_dtype("bfloat16", "t4box", [(0, "Tesla T4", 7.5)])[0].startswith("dtype bfloat16 needs")


def test_a_wheelhouse_names_its_torch(tmp_path):
    for name in ("torch-2.7.1+cu128-cp311-cp311-manylinux_2_28_x86_64.whl",
                 "torch-2.8.0+cu129-cp311-cp311-manylinux_2_28_x86_64.whl", "numpy-2.0.0-cp311-cp311-any.whl"):
        (tmp_path / name).write_bytes(b"")
    assert cudastack.from_wheelhouse(str(tmp_path), "torch>=2.4").version == "2.8.0+cu129"
    pinned = cudastack.from_wheelhouse(str(tmp_path), "torch==2.7.1+cu128")
    assert pinned.cuda == (12, 8) and pinned.source.startswith("wheelhouse file torch-2.7.1+cu128")


def test_preflight_refuses_faults_only_on_the_gpus_the_profile_uses(tmp_path):
    from test_render_safety import BASE, profile_from

    profile = profile_from(tmp_path, BASE, {"device": "cuda", "gpus": [0]})
    facts = facts_with([gpu(0), gpu(1, ecc_volatile=2)],
                       events=[{"xid": 79, "bus": "0000:18:00", "at_s": 3.0, "text": "x"}])
    host = HostFacts.from_json({"hostname": "ct200", **facts})
    assert used_gpus(profile, 2) == [0]
    found = {"keeps": True, "installed": {"version": "2.7.1+cu128", "cuda": "12.8"}}
    problems, check = check_gpus(profile, host, found, accept_faults=False)
    assert len(problems) == 1 and "GPU 0 (00000000:18:00.0): Xid 79" in problems[0]
    assert any("GPU 1" in w and "does not use" in w for w in check.warnings)
    problems, check = check_gpus(profile, host, found, accept_faults=True)
    assert problems == [] and check.accepted[0].startswith("GPU 0 (00000000:18:00.0): Xid 79")


def test_runtime_torch_pins_the_build_and_its_index(tmp_path):
    from test_render_safety import BASE, profile_from

    from ddops.errors import ConfigError
    from ddops.steps.deps import pip_argv

    pin = {"version": "2.7.1", "cuda": 12.8, "index": "https://download.pytorch.org/whl/cu128"}
    profile = profile_from(tmp_path, BASE, {"runtime.torch": pin})
    assert profile.runtime.packages["torch"] == "torch==2.7.1+cu128"
    argv = pip_argv(profile, ["torch"])
    assert argv[-3:] == ["--extra-index-url", "https://download.pytorch.org/whl/cu128", "torch==2.7.1+cu128"]
    with pytest.raises(ConfigError, match="both runtime.torch and runtime.packages.torch"):
        profile_from(tmp_path, BASE, {"runtime.torch": pin, "runtime.packages": {"torch": "torch>=2.4"}})
    with pytest.raises(ConfigError, match="runtime.torch.cuda must be a CUDA version"):
        profile_from(tmp_path, BASE, {"runtime.torch": {"version": "2.7.1", "cuda": "cu128"}})


def test_a_pinned_torch_replaces_another_build_in_the_venv(tmp_path):
    from test_render_safety import BASE, profile_from

    from ddops.facts import Imports
    from ddops.steps.deps import plan_deps

    profile = profile_from(tmp_path, BASE, {"runtime.torch": {"version": "2.7.1", "cuda": "12.8"}})
    everything = Imports.from_json({"venv": True, "modules": {m: {"ok": True} for m in profile.runtime.packages}})
    assert plan_deps(profile, everything, "2.7.1+cu128") == []
    replace, = plan_deps(profile, everything, "2.13.0+cpu")
    assert replace.data == {"modules": ["torch"]} and replace.what.startswith("pip install torch==2.7.1+cu128")


def test_a_cuda_past_the_table_is_matched_to_the_drivers_own_cuda_version():
    future = cudastack.TorchBuild("3.1.0+cu131", (13, 1), "runtime.torch")
    blackwell = [(0, "NVIDIA RTX PRO 6000", 12.0)]
    problem, = cudastack.check_build(future, "ct200", "580.65.06", blackwell, driver_cuda="13.0")
    assert "needs CUDA 13.1, and ct200's driver 580.65.06 supports CUDA 13.0 at most" in problem
    assert cudastack.check_build(future, "ct200", "590.1", blackwell, driver_cuda="13.1") == []

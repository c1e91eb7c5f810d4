"""Issue 37 on the real lab: the runtime's CUDA stack matched to the host and a sick GPU seen before anything
is changed. The lab's nvidia-smi and kernel log (/dev/kmsg) are set per test with ddops_lab_gpu on the host;
every test leaves them as `lab up` made them."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml
from test_pivot import REPO, ddops, step

pytestmark = pytest.mark.lab

DDTREE = REPO / "playbooks" / "lab-ddtree16.yaml"
SGLANG = REPO / "playbooks" / "lab-sglang-dflash.yaml"
SGLANG_RESET = ("systemctl disable --now sglang-dflash.service; rm -f /etc/systemd/system/sglang-dflash.service "
                "/etc/ddops/sglang-dflash.env /var/lib/ddops/pivot.lock; rm -rf /var/lib/ddops/backups; "
                "systemctl daemon-reload; systemctl reset-failed; systemctl start sglang-qwen.service")
SNAPSHOT = r"""
for p in /etc/systemd/system /etc/ddops /var/lib/ddops /root/models /opt/ddtree; do
  [ -e "$p" ] && find "$p" -type f -o -type l | sort | xargs -r sha256sum
done
systemctl show dflash-train.service -p ActiveState -p MainPID
"""


def lab_gpu(lab, host: str, *args: str) -> str:
    done = lab.ssh(host, ["python3", "-m", "ddops_lab_gpu", *args], timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def gpus(lab):
    """ct200 training, and every GPU host's faults and driver as `lab up` made them, before and after."""
    for host in ("ct200", "llm-two"):
        lab_gpu(lab, host, "clear")
    lab.ssh("ct200", "systemctl start dflash-train.service")
    yield lab
    for host in ("ct200", "llm-two"):
        lab_gpu(lab, host, "clear")


def cuda_profile(tmp_path, cuda: str | None, venv: str | None = None) -> str:
    """lab-ddtree16 on ct200's GPU 0, with torch pinned to a CUDA build (None: its packages' torch==2.13.0)."""
    doc = yaml.safe_load(DDTREE.read_text())
    doc.update(device="cuda", gpus=[0])
    if cuda is not None:
        del doc["runtime"]["packages"]["torch"]
        doc["runtime"]["torch"] = {"version": "2.7.1", "cuda": cuda}
    if venv is not None:
        doc["runtime"]["venv"] = venv
    path = tmp_path / "cuda.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def pivot(lab, profile: str, *extra: str) -> tuple[int, dict]:
    done = ddops(lab, "pivot", "--kill-training", "--deploy", profile, "--yes", "--json", *extra)
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"no JSON report (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}")


def refused_unchanged(lab, profile: str, host: str = "ct200") -> dict:
    before = lab.ssh(host, SNAPSHOT).stdout
    code, report = pivot(lab, profile)
    assert code == 2 and report["outcome"] == "failed" and report["failed_step"] == "preflight", report
    assert "\n" not in report["error"] and report["changed"] == []
    assert lab.ssh(host, SNAPSHOT).stdout == before   # no file changed, training still running
    return report


def test_a_driver_too_old_for_the_wheels_cuda_is_refused_with_nothing_changed(gpus, tmp_path):
    lab_gpu(gpus, "ct200", "set", 'driver_version="535.104.05"', 'cuda_version="12.2"')
    report = refused_unchanged(gpus, cuda_profile(tmp_path, "12.8"))
    assert ("torch 2.7.1+cu128 (runtime.torch (" in report["error"] and "needs CUDA 12.8, which needs NVIDIA driver "
            "570.26 or newer, and ct200 has driver 535.104.05: upgrade the driver to 570.26+" in report["error"])
    assert gpus.ssh("ct200", "systemctl is-active dflash-train.service").stdout.strip() == "active"


def test_a_wheel_without_the_gpus_architecture_is_refused(gpus, tmp_path):
    report = refused_unchanged(gpus, cuda_profile(tmp_path, "12.6"))
    assert "has kernels for sm 50;60;70;75;80;86;90 only, not ct200's GPU 0 (NVIDIA RTX PRO 6000" in report["error"]
    assert 'pin `runtime.torch: {version: "2.7.0" or newer, cuda: "12.8"}`' in report["error"]


SCRATCH_VENV = "/opt/gpucheck/venv"   # a venv of these tests' own: other modules' pivots use /opt/ddtree/venv


def test_the_torch_pip_would_install_is_resolved_on_the_host_without_installing_it(gpus, tmp_path):
    """No pin and no venv: pip's --dry-run --report on ct200 (from a throwaway venv, removed again) resolves
    the lab's torch==2.13.0 to its wheel there, a CPU build, which a profile on the GPU cannot run."""
    gpus.ssh("ct200", "rm -rf /opt/gpucheck")
    report = refused_unchanged(gpus, cuda_profile(tmp_path, None, venv=SCRATCH_VENV))
    assert "torch 2.13.0+cpu (pip --dry-run on ct200) is a CPU build, and the profile runs on ct200's GPU(s)" in (
        report["error"])
    assert 'pin `runtime.torch: {version: "2.7.0" or newer, cuda: "12.8"}`' in report["error"]   # 12.9 needs 575
    assert gpus.ssh("ct200", "ls -d /opt/gpucheck /tmp/ddops-pip-* 2>/dev/null").stdout == ""


def test_a_rerun_checks_the_torch_the_venv_already_holds(gpus, tmp_path):
    site = f"{SCRATCH_VENV}/lib/python3.11/site-packages/torch"
    made = gpus.ssh("ct200", f"python3 -m venv --without-pip {SCRATCH_VENV} && mkdir -p {site} && touch {site}/__init__.py"
                             f" && printf \"__version__ = '2.6.0+cu126'\\ncuda: Optional[str] = '12.6'\\n\" > {site}/version.py")
    assert made.returncode == 0, made.stderr
    try:
        report = refused_unchanged(gpus, cuda_profile(tmp_path, None, venv=SCRATCH_VENV))
    finally:
        gpus.ssh("ct200", "rm -rf /opt/gpucheck")
    assert ("torch 2.6.0+cu126 (installed in /opt/gpucheck/venv) has kernels for sm 50;60;70;75;80;86;90 only, "
            "not ct200's GPU 0 (NVIDIA RTX PRO 6000") in report["error"]


def test_ecc_on_a_gpu_the_profile_does_not_use_is_shown_not_refused(gpus, tmp_path):
    lab_gpu(gpus, "ct200", "fault", "3", "ecc_volatile=2")
    done = ddops(gpus, "pivot", "--deploy", cuda_profile(tmp_path, "12.8"), "--dry-run", "--json")
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["outcome"] == "dry-run", report
    summary = step(report, "preflight")["summary"]
    assert "torch 2.7.1+cu128" in summary and "fits the driver and GPUs" in summary
    assert "GPU 3 (00000000:48:00.0), which this profile does not use: 2 uncorrectable ECC error(s)" in summary
    status = {r["host"]: r for r in json.loads(ddops(gpus, "--limit", "ct200", "status", "--json").stdout)}
    words = [g["word"] for g in status["ct200"]["gpu_health"]]
    assert words == ["ok", "ok", "ok", "ecc", "ok", "ok", "ok", "ok"]


def test_status_and_top_show_each_gpus_health_and_the_driver(gpus, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")   # the table's cells unfolded
    lab_gpu(gpus, "llm-two", "fault", "1", 'throttle=["HwThermalSlowdown"]')
    done = ddops(gpus, "status", "--json")
    assert done.returncode == 0, done.stderr
    hosts = {r["host"]: r for r in json.loads(done.stdout)}
    assert hosts["ct200"]["driver"]["version"] == "570.133.20"
    assert [g["word"] for g in hosts["ct200"]["gpu_health"]] == ["ok"] * 8
    assert [g["word"] for g in hosts["llm-two"]["gpu_health"]] == ["ok", "throttled"]
    assert hosts["llm-two"]["gpu_health"][1]["warnings"] == ["throttled (HwThermalSlowdown)"]
    assert hosts["ct200"]["kernel_log"] == {"source": "/dev/kmsg", "error": None, "stray": []}
    table = ddops(gpus, "status").stdout
    assert "driver 570.133.20" in table and "health ok x8" in table and "GPU 1 throttled" in table
    top = ddops(gpus, "top", "--once", "--json", "--interval", "1")
    frame = {h["host"]: h for h in json.loads(top.stdout)["hosts"]}
    assert frame["llm-two"]["driver"]["version"] == "570.133.20"
    assert [g["word"] for g in frame["llm-two"]["gpu_health"]] == ["ok", "throttled"]


def test_an_xid_79_on_the_profiles_gpu_is_refused_and_accepted_with_the_flag(gpus, tiny_hybrid_models):
    llm_two = "llm-two"
    gpus.ssh(llm_two, SGLANG_RESET)
    line = lab_gpu(gpus, llm_two, "xid", "0", "79")
    assert line.startswith("NVRM: Xid (PCI:0000:18:00): 79,")
    try:
        report = refused_unchanged(gpus, str(SGLANG), host=llm_two)
        assert ("llm-two has a faulty GPU the profile would use: GPU 0 (00000000:18:00.0): Xid 79 (GPU has fallen "
                "off the bus)" in report["error"] and "--accept-gpu-faults" in report["error"])
        code, report = pivot(gpus, str(SGLANG), "--accept-gpu-faults")
        assert code == 0 and report["outcome"] == "ok", report
        assert report["accepted_gpu_faults"][0].startswith("GPU 0 (00000000:18:00.0): Xid 79")
        history = json.loads(ddops(gpus, "history", "--host", llm_two, "--json").stdout)
        assert history[-1]["accepted_gpu_faults"] == report["accepted_gpu_faults"]
    finally:
        gpus.ssh(llm_two, SGLANG_RESET)


def test_top_fail_on_gpu_exits_1_within_two_refreshes_of_an_xid(gpus):
    argv = [sys.executable, "-m", "ddops", "-i", str(gpus.inventory_path), "--limit", "eval-a6000", "top", "--json",
            "--interval", "1", "--count", "3", "--fail-on", "gpu"]
    top = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(top.stdout.readline())
        assert first["alarms"] == []
        lab_gpu(gpus, "eval-a6000", "xid", "1", "48")
        later = [json.loads(line) for line in top.stdout]
        assert top.wait(timeout=60) == 1
    finally:
        top.kill()
        top.wait()
        lab_gpu(gpus, "eval-a6000", "clear")
    alarms = [a for frame in later for a in frame["alarms"] if a["kind"] == "gpu"]
    assert alarms and "GPU 1: Xid 48 (double-bit ECC error)" in alarms[0]["text"]
    assert time.time() - first["time"] < 30

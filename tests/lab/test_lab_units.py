"""Lab pieces that need no booted hosts: the inventory reading and the imitation nvidia-smi."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddops.lab import LabError
from ddops.lab.hostlimits import LIMITS, Limit, ensure_limits
from ddops.lab.paths import ASSETS
from ddops.lab.spec import read_inventory, write_inventory

LAB_YAML = Path(__file__).resolve().parents[2] / "inventories" / "lab.yaml"


def test_lab_inventory_hosts() -> None:
    _, hosts = read_inventory(LAB_YAML)
    by_name = {h.name: h for h in hosts}
    assert [(h.name, h.port) for h in hosts] == [("pve", 2200), ("ct200", 2201), ("llm-two", 2202),
                                                 ("eval-a6000", 2203)]
    assert by_name["pve"].containers == ((200, "ct200", 2201),)
    assert by_name["ct200"].gpus.count == 8 and by_name["ct200"].fixtures == ("training",)
    assert not any(h.extra for h in hosts)


def test_extra_hosts_are_added_to_the_written_inventory(tmp_path: Path) -> None:
    doc, hosts = read_inventory(LAB_YAML, extra=3)
    extra = [h for h in hosts if h.extra]
    assert [(h.name, h.port, h.gpus.model, h.gpus.count) for h in extra] == [
        (f"eval-0{i}", 2209 + i, "NVIDIA RTX A6000", 2) for i in (1, 2, 3)]
    out = tmp_path / "inventory.yaml"
    write_inventory(doc, out)
    written = yaml.safe_load(out.read_text())
    assert written["groups"]["extra"] == ["eval-01", "eval-02", "eval-03"]
    assert written["hosts"]["eval-03"]["expect"] == {"hostname": "eval-03", "gpu_model": "RTX A6000",
                                                     "gpu_count": 2}
    _, again = read_inventory(out)  # the written inventory is itself a valid lab inventory
    assert [h.name for h in again] == [h.name for h in hosts]


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["hosts"]["llm-two"]["lab"].update(fixtures=["nope"]), "unknown lab fixture 'nope'"),
    (lambda d: d["hosts"]["llm-two"].update(port=2203), "port 2203 is used by both"),
    (lambda d: d["hosts"]["llm-two"]["expect"].update(hostname="other"), "differs from the host name"),
])
def test_bad_lab_inventories_are_lab_errors(tmp_path: Path, edit, message: str) -> None:
    doc = yaml.safe_load(LAB_YAML.read_text())
    edit(doc)
    path = tmp_path / "lab.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(LabError, match=message):
        read_inventory(path)


# --- imitation nvidia-smi, run against a temporary config and hold dir ---------------------------

@pytest.fixture
def smi(tmp_path: Path):
    config = {"model": "NVIDIA RTX A6000", "count": 2, "memory_mib": 49140, "uuids": ["GPU-a", "GPU-b"],
              "bus_ids": ["00000000:18:00.0", "00000000:28:00.0"], "idle_used_mib": 1}
    (tmp_path / "gpus.json").write_text(json.dumps(config))
    holds = tmp_path / "holds"
    holds.mkdir()
    env = {**os.environ, "DDOPS_GPU_CONFIG": str(tmp_path / "gpus.json"), "DDOPS_GPU_HOLD_DIR": str(holds)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ASSETS / "nvidia-smi"), *args], env=env,
                              capture_output=True, text=True, timeout=30)

    run.holds = holds
    return run


def hold(holds: Path, pid: int, gpus: list[int], mib: int, starttime: int | None = None) -> None:
    (holds / f"{pid}.json").write_text(json.dumps({"gpus": gpus, "used_mib": mib, "name": "train",
                                                   "starttime": starttime}))


@pytest.mark.parametrize("args, expected", [
    (["--query-gpu=index,name,memory.used,memory.total", "--format=csv,noheader,nounits"],
     "0, NVIDIA RTX A6000, 1, 49140\n1, NVIDIA RTX A6000, 1, 49140\n"),
    (["--query-gpu=index,memory.used", "--format=csv"],
     "index, memory.used [MiB]\n0, 1 MiB\n1, 1 MiB\n"),
    (["--query-gpu", "uuid,utilization.gpu", "--format", "csv,noheader", "-i", "1"], "GPU-b, 0 %\n"),
    (["-L"], "GPU 0: NVIDIA RTX A6000 (UUID: GPU-a)\nGPU 1: NVIDIA RTX A6000 (UUID: GPU-b)\n"),
    (["--query-compute-apps=pid,used_memory", "--format=csv"], "pid, used_gpu_memory [MiB]\n"),
])
def test_nvidia_smi_idle_answers(smi, args: list[str], expected: str) -> None:
    done = smi(*args)
    assert (done.returncode, done.stdout) == (0, expected)


@pytest.mark.parametrize("args", [["--bogus"], ["--query-gpu=nonsense", "--format=csv"],
                                  ["--query-gpu=index"], ["--format=json"]])
def test_nvidia_smi_refuses_what_the_real_one_refuses(smi, args: list[str]) -> None:
    assert smi(*args).returncode != 0


def test_nvidia_smi_counts_only_live_holders(smi) -> None:
    me = os.getpid()
    hold(smi.holds, me, [1], 4000)
    hold(smi.holds, 2 ** 22 + 7, [0, 1], 9000)          # no such pid
    hold(smi.holds, 1, [0], 5000, starttime=123456789)   # pid 1 exists, but started at another time
    assert smi("--query-gpu=memory.used", "--format=csv,noheader,nounits").stdout == "1\n4001\n"
    apps = smi("--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv,noheader,nounits")
    assert apps.stdout == f"{me}, train, 4000, GPU-b\n"
    table = smi().stdout
    assert "4001MiB / 49140MiB" in table and "train" in table
    assert {len(line) for line in table.splitlines()[1:]} == {91}


# --- the machine's limits for N hosts (ddops/lab/hostlimits.py) ---------------------------------

def fake_limit(name: str, value: int, *, may_raise: bool, per_host: int = 8, reserve: int = 64):
    """A limit held in a dict instead of the kernel; raising it fails as a read-only /proc/sys does."""
    held = {"value": value}

    def raise_to(new: int) -> None:
        if not may_raise:
            raise OSError(30, "Read-only file system")
        held["value"] = new

    return Limit(name, per_host, reserve, fix=f"sysctl -w {name}={{value}}", lasts="until reboot",
                 read=lambda: held["value"], raise_to=raise_to), held


def test_what_a_lab_of_n_hosts_needs() -> None:
    by_name = {limit.name: limit for limit in LIMITS}
    assert set(by_name) == {"fs.inotify.max_user_instances", "fs.inotify.max_user_watches", "RLIMIT_NOFILE"}
    # the default lab (4 hosts) fits the kernel's defaults; the --extra 64 one (68 hosts) does not
    assert by_name["fs.inotify.max_user_instances"].needed(4) == 96 <= 128
    assert by_name["fs.inotify.max_user_instances"].needed(68) == 608
    assert by_name["fs.inotify.max_user_watches"].needed(68) == 6400 <= 8192  # the oldest kernels' default
    assert by_name["RLIMIT_NOFILE"].needed(68) == 608 <= 1024


def test_limits_enough_for_the_hosts_are_left_alone() -> None:
    limit, held = fake_limit("fs.inotify.max_user_instances", 200, may_raise=False)
    said: list[str] = []
    ensure_limits(17, said.append, limits=(limit,))  # needs exactly 64 + 8 * 17 = 200
    assert said == [] and held["value"] == 200


def test_a_low_limit_is_raised_to_what_the_hosts_need_in_one_line() -> None:
    instances, held_instances = fake_limit("fs.inotify.max_user_instances", 128, may_raise=True)
    watches, held_watches = fake_limit("fs.inotify.max_user_watches", 100_000, may_raise=True,
                                       per_host=64, reserve=2048)
    said: list[str] = []
    ensure_limits(68, said.append, limits=(instances, watches))
    assert said == ["Raised for 68 lab hosts: fs.inotify.max_user_instances 128 -> 608 (until reboot)"]
    assert held_instances["value"] == 608 and held_watches["value"] == 100_000


def test_a_limit_that_may_not_be_raised_is_one_line_naming_the_sysctl_and_the_value() -> None:
    limit, held = fake_limit("fs.inotify.max_user_instances", 128, may_raise=False)
    with pytest.raises(LabError) as caught:
        ensure_limits(68, lambda _: None, limits=(limit,))
    assert caught.value.line() == (
        "68 lab hosts need more than this machine allows: fs.inotify.max_user_instances is 128, they need 608 "
        "(as root: sysctl -w fs.inotify.max_user_instances=608)")
    assert "\n" not in caught.value.line() and held["value"] == 128


def test_open_files_are_raised_within_the_hard_limit() -> None:
    """Any user may raise the soft RLIMIT_NOFILE up to the hard one: done in a child, ours stays put."""
    code = ("import resource; from ddops.lab.hostlimits import LIMITS, ensure_limits\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (100, 4096))\n"
            "ensure_limits(68, print, limits=tuple(l for l in LIMITS if l.name == 'RLIMIT_NOFILE'))\n"
            "print(resource.getrlimit(resource.RLIMIT_NOFILE))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["Raised for 68 lab hosts: RLIMIT_NOFILE 100 -> 608 (for this run)",
                                        "(608, 4096)"]

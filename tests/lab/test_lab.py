"""The lab itself: real Debian hosts, their sshd, imitation GPUs, fixtures, the pct node, `up` again."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from ddops.lab import LabError, lab_status, lab_up
from ddops.lab.hostlimits import LIMITS, read_sysctl, write_sysctl

pytestmark = pytest.mark.lab

GPU_QUERY = "nvidia-smi --query-gpu=index,name,uuid,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits"


def ok(res) -> str:
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr}"
    return res.stdout


def wait_for(probe, timeout: float = 20.0, every: float = 0.25):
    """Poll `probe()` until it returns something truthy; return it (or fail after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value or time.monotonic() > deadline:
            assert value, f"gave up after {timeout}s"
            return value
        time.sleep(every)


def gpu_rows(lab, host: str) -> list[list[str]]:
    return [line.split(", ") for line in ok(lab.ssh(host, GPU_QUERY)).splitlines()]


# --- hosts ---------------------------------------------------------------------------------------

def test_every_host_boots_with_its_hostname_and_systemd(lab) -> None:
    for name in lab.hosts:
        out = ok(lab.ssh(name, "hostname; cat /etc/hostname; cat /proc/1/comm; "
                               "systemctl is-system-running || true"))
        hostname, etc_hostname, pid1, state = out.split()
        assert hostname == etc_hostname == name
        assert pid1 == "systemd"
        assert state in ("running", "degraded")


def test_each_host_has_its_own_sshd_port_and_host_key(lab) -> None:
    states = {s.name: s for s in lab_status()}
    keys = {}
    for name, info in lab.hosts.items():
        assert states[name].running and states[name].sshd_ok and states[name].port == info.port
        assert f"Port {info.port}" in ok(lab.ssh(name, "cat /etc/ssh/sshd_config"))
        keys[name] = ok(lab.ssh(name, "cat /etc/ssh/ssh_host_ed25519_key.pub")).split()[1]
    assert len(set(keys.values())) == len(keys), "hosts share an SSH host key"
    known = Path(lab.known_hosts).read_text()
    for name, info in lab.hosts.items():
        assert f"[127.0.0.1]:{info.port} ssh-ed25519 {keys[name]}" in known


def test_pip_inside_a_host_sees_the_wheels_and_the_ca(lab) -> None:
    out = ok(lab.ssh("eval-a6000", "cat /etc/pip.conf; test -s /etc/ddops-lab/ca.crt && echo CA; "
                                   "test -d /opt/wheels && echo WHEELS; touch /opt/wheels/x 2>/dev/null || echo RO"))
    assert "find-links = /opt/wheels" in out and "cert = /etc/ddops-lab/ca.crt" in out
    assert "WHEELS" in out and "RO" in out
    if Path("/etc/ssl/certs/ca-certificates.crt").is_file():
        assert "CA" in out


# --- imitation GPUs ------------------------------------------------------------------------------

def test_nvidia_smi_lists_the_inventory_gpus(lab) -> None:
    rows = gpu_rows(lab, "eval-a6000")
    assert [r[1] for r in rows] == ["NVIDIA RTX A6000"] * 2
    assert all(r[4] == "49140" and r[2].startswith("GPU-") for r in rows)
    listed = ok(lab.ssh("llm-two", "nvidia-smi -L")).splitlines()
    assert len(listed) == 2 and listed[0].startswith("GPU 0: NVIDIA RTX PRO 6000 Blackwell")
    header = ok(lab.ssh("eval-a6000", "nvidia-smi --query-gpu=index,memory.used --format=csv")).splitlines()
    assert header[0] == "index, memory.used [MiB]" and header[1].endswith(" MiB")
    assert "Processes:" in ok(lab.ssh("ct200", "nvidia-smi"))
    bad = lab.ssh("ct200", "nvidia-smi --no-such-flag")
    assert bad.returncode != 0 and "Invalid combination" in bad.stdout
    assert lab.ssh("pve", "command -v nvidia-smi").returncode != 0  # the node has no GPUs


def test_training_holds_gpu_memory_until_it_stops(lab) -> None:
    rows = wait_for(lambda: (r := gpu_rows(lab, "ct200")) and all(int(x[3]) > 10000 for x in r) and r)
    assert len(rows) == 8 and {r[1] for r in rows} == {"NVIDIA RTX PRO 6000 Blackwell Server Edition"}
    apps = ok(lab.ssh("ct200", "nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid "
                               "--format=csv,noheader,nounits")).splitlines()
    main_pid = ok(lab.ssh("ct200", "systemctl show -p MainPID --value dflash-train")).strip()
    assert len(apps) == 8 and {a.split(", ")[0] for a in apps} == {main_pid}
    assert {a.split(", ")[3] for a in apps} == {r[2] for r in rows}
    try:
        ok(lab.ssh("ct200", "systemctl stop dflash-train"))
        rows = gpu_rows(lab, "ct200")
        assert all(int(r[3]) < 100 for r in rows), rows
        assert ok(lab.ssh("ct200", "nvidia-smi --query-compute-apps=pid --format=csv,noheader")) == ""
    finally:
        ok(lab.ssh("ct200", "systemctl start dflash-train"))
    wait_for(lambda: all(int(r[3]) > 10000 for r in gpu_rows(lab, "ct200")), timeout=10)


def test_dead_holder_frees_memory_even_with_its_file_left(lab) -> None:
    """A process killed with SIGKILL leaves /run/ddops-gpu/PID.json behind; it must not count."""
    script = ("import ddops_lab_gpu, time; ddops_lab_gpu.hold([0], 5000, name='holder'); time.sleep(60)")
    ok(lab.ssh("eval-a6000", f"nohup python3 -c \"{script}\" </dev/null >/dev/null 2>&1 & echo $! > /tmp/holder.pid"))
    wait_for(lambda: gpu_rows(lab, "eval-a6000")[0][3] == "5001")
    ok(lab.ssh("eval-a6000", "kill -9 $(cat /tmp/holder.pid)"))
    wait_for(lambda: gpu_rows(lab, "eval-a6000")[0][3] == "1", timeout=5)
    assert ok(lab.ssh("eval-a6000", "ls /run/ddops-gpu")).strip().endswith(".json")


# --- training fixture ----------------------------------------------------------------------------

def test_training_logs_steps_and_checkpoints_and_saves_on_sigterm(lab) -> None:
    def checkpoints() -> list[str]:
        return ok(lab.ssh("ct200", "ls /root/train/checkpoints")).split()

    wait_for(lambda: any(c.startswith("step_") and not c.endswith("-final.ckpt") for c in checkpoints()),
             timeout=15)
    log = ok(lab.ssh("ct200", "grep -E '^step [0-9]+ loss [0-9.]+$' /root/train/train.log")).splitlines()
    assert len(log) >= 10
    losses = [float(line.split()[3]) for line in log]
    assert losses[-1] < losses[0] + 0.5
    # An earlier test may have stopped the job already, so a final checkpoint can sort first.
    periodic = next(c for c in checkpoints() if c.startswith("step_") and not c.endswith("-final.ckpt"))
    meta = json.loads(ok(lab.ssh("ct200", f"cat /root/train/checkpoints/{periodic}")))
    assert meta["step"] % 10 == 0 and meta["final"] is False
    started_lines = "grep 'training started' /root/train/train.log"
    before = set(checkpoints())
    runs = len(ok(lab.ssh("ct200", started_lines)).splitlines())
    try:
        ok(lab.ssh("ct200", "systemctl stop dflash-train"))
        final = [c for c in set(checkpoints()) - before if c.endswith("-final.ckpt")]
        assert len(final) == 1, checkpoints()
        show = ok(lab.ssh("ct200", "systemctl show -p Result -p ExecMainStatus dflash-train"))
        assert "Result=success" in show and "ExecMainStatus=0" in show
        tail = ok(lab.ssh("ct200", "tail -3 /root/train/train.log"))
        assert "received SIGTERM" in tail and final[0] in tail
    finally:
        ok(lab.ssh("ct200", "systemctl start dflash-train"))
    # A restarted job resumes from the final checkpoint.
    lines = wait_for(lambda: (out := ok(lab.ssh("ct200", started_lines)).splitlines())[runs:] and out)
    step = int(final[0].removeprefix("step_").removesuffix("-final.ckpt"))
    assert lines[-1].endswith(f"at step {step}")


def test_training_can_be_told_to_ignore_sigterm(lab) -> None:
    unit = "stubborn-train"
    ok(lab.ssh("ct200", ["systemd-run", f"--unit={unit}", "--collect", "-E", "DFLASH_IGNORE_SIGTERM=1",
                         "-E", "DDOPS_GPU_HOLD_DIR=/tmp/nogpu", "-E", "DFLASH_STEP_SECONDS=0.1",
                         "python3", "/opt/train/train_dflash_pipeline.py", "--log", "/tmp/stubborn.log",
                         "--checkpoints", "/tmp/stubborn"]))
    try:
        wait_for(lambda: "step 2 " in lab.ssh("ct200", "cat /tmp/stubborn.log").stdout)
        ok(lab.ssh("ct200", ["systemctl", "kill", "-s", "TERM", unit]))
        time.sleep(0.5)
        assert ok(lab.ssh("ct200", ["systemctl", "is-active", unit])).strip() == "active"
        assert "ignoring it" in ok(lab.ssh("ct200", "cat /tmp/stubborn.log"))
    finally:
        lab.ssh("ct200", ["systemctl", "kill", "-s", "KILL", unit])


# --- sglang fixture ------------------------------------------------------------------------------

def test_sglang_stand_in_answers(lab) -> None:
    assert ok(lab.ssh("llm-two", "systemctl is-active sglang-qwen")).strip() == "active"
    probe = ("import urllib.request as u; "
             "print(u.urlopen('http://127.0.0.1:30000/health', timeout=5).status)")
    assert ok(lab.ssh("llm-two", ["python3", "-c", probe])).strip() == "200"
    # The lab shares the control machine's network, so tests reach it on 127.0.0.1 too.
    models = json.load(urllib.request.urlopen("http://127.0.0.1:30000/v1/models", timeout=5))
    model = models["data"][0]["id"]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "ping"}]}).encode()
    req = urllib.request.Request("http://127.0.0.1:30000/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    answer = json.load(urllib.request.urlopen(req, timeout=5))
    assert answer["choices"][0]["message"]["content"] == "echo: ping"
    assert all(int(r[3]) > 10000 for r in gpu_rows(lab, "llm-two"))


def test_models_dir_on_the_eval_box(lab) -> None:
    """lab up puts the tiny drafter where the lab profile syncs it from, byte-identical to its fixture."""
    from ddops.lab.tiny import QWEN3, fixtures_dir

    listing = ok(lab.ssh("eval-a6000", "ls /root/models; sha256sum /root/models/tiny-draft/model.safetensors"))
    assert "README" in listing and "tiny-draft" in listing
    fixture = json.loads((fixtures_dir() / QWEN3 / "MANIFEST.json").read_text())
    assert fixture["files"]["draft/model.safetensors"] in listing


# --- the Proxmox node ----------------------------------------------------------------------------

def test_pct_exec_runs_in_the_container_with_argv_intact(lab) -> None:
    assert ok(lab.ssh("pve", "pct exec 200 -- hostname")).strip() == "ct200"
    tricky = ["pct", "exec", "200", "--", "bash", "-lc", 'printf %s "a;b \\$(x)"']
    assert ok(lab.ssh("pve", tricky)) == "a;b $(x)"
    argv = ["pct", "exec", "200", "--", "python3", "-c", "import sys; print(sys.argv[1:])",
            "it's", "two words", "", "$HOME", "*"]
    assert ok(lab.ssh("pve", argv)).strip() == repr(["it's", "two words", "", "$HOME", "*"])
    assert lab.ssh("pve", "pct exec 200 -- sh -c 'exit 7'").returncode == 7
    assert ok(lab.ssh("pve", "pct exec 200 -- tr a-z A-Z", input="piped\n")) == "PIPED\n"
    err = lab.ssh("pve", "pct exec 200 -- sh -c 'echo oops >&2'")
    assert err.stderr.strip() == "oops" and err.stdout == ""


def test_pct_status_and_list(lab) -> None:
    assert ok(lab.ssh("pve", "pct status 200")).strip() == "status: running"
    listing = ok(lab.ssh("pve", "pct list")).splitlines()
    assert listing[0].split() == ["VMID", "Status", "Lock", "Name"]
    assert listing[1].split() == ["200", "running", "ct200"]
    assert lab.ssh("pve", "pct exec 999 -- true").returncode != 0


def test_rsync_through_pct(lab, tmp_path: Path) -> None:
    """rsync -e '<ssh to pve> pct exec 200 --': stdin/stdout must pass through untouched."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "blob.bin").write_bytes(bytes(range(256)) * 4096)
    (src / "name with spaces.txt").write_text("hello\n")
    wrapper = tmp_path / "pct-rsh"
    # rsync calls `RSH HOST rsync --server ...`: drop HOST, quote the rest for pve's shell.
    wrapper.write_text("#!/bin/bash\nshift\nexec " + " ".join(lab.ssh_argv("pve", "")[:-1]) +
                       ' pct exec 200 -- $(printf "%q " "$@")\n')
    wrapper.chmod(0o755)
    done = subprocess.run(["rsync", "-a", "-e", str(wrapper), f"{src}/", "ct:/root/rsync-test/"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = ok(lab.ssh("ct200", "cd /root/rsync-test && sha256sum blob.bin && cat 'name with spaces.txt'"))
    assert hashlib.sha256((src / "blob.bin").read_bytes()).hexdigest() in out and "hello" in out


# --- lab up, again -------------------------------------------------------------------------------

def test_up_again_leaves_running_hosts_alone(lab) -> None:
    before = {s.name: s.pid for s in lab_status()}
    started = time.monotonic()
    states = lab_up(lab.inventory_path, progress=lambda _: None)
    assert time.monotonic() - started < 10
    assert {s.name: s.pid for s in states} == {n: before[n] for n in lab.hosts}
    assert all(s.running and s.sshd_ok and s.boot_seconds is None for s in states)


INSTANCES = "fs.inotify.max_user_instances"


@pytest.fixture
def inotify_limit_just_short_of(lab):
    """Lower root's inotify instances to one below what the lab with `extra` hosts needs; restore it after."""
    original = read_sysctl(INSTANCES)
    instances = next(limit for limit in LIMITS if limit.name == INSTANCES)

    def lower(extra: int) -> int:
        needed = instances.needed(len(lab.hosts) + extra)
        write_sysctl(INSTANCES, needed - 1)  # still above what the running hosts use
        return needed

    yield lower
    write_sysctl(INSTANCES, original)


def test_extra_hosts_come_and_go_raising_a_low_inotify_limit(lab, inotify_limit_just_short_of) -> None:
    needed = inotify_limit_just_short_of(2)
    said: list[str] = []
    try:
        states = lab_up(lab.inventory_path, extra=2, progress=said.append)
        assert f"Raised for {len(lab.hosts) + 2} lab hosts: {INSTANCES} {needed - 1} -> {needed} (until reboot)" in said
        assert read_sysctl(INSTANCES) == needed
        by_name = {s.name: s for s in states}
        assert {"eval-01", "eval-02"} <= set(by_name)
        assert (by_name["eval-01"].port, by_name["eval-02"].port) == (2210, 2211)
        written = yaml.safe_load((lab.lab_dir / "inventory.yaml").read_text())
        assert set(written["hosts"]) == set(lab.hosts) | {"eval-01", "eval-02"}
        assert written["hosts"]["eval-02"]["port"] == 2211
        for name, port in (("eval-01", 2210), ("eval-02", 2211)):
            lab.hosts[name] = type(lab.hosts["eval-a6000"])(name, port, gpu_count=2)
            assert ok(lab.ssh(name, "hostname")).strip() == name
            assert [r[1] for r in gpu_rows(lab, name)] == ["NVIDIA RTX A6000"] * 2
    finally:
        states = lab_up(lab.inventory_path, progress=lambda _: None)
        lab.hosts.pop("eval-01", None)
        lab.hosts.pop("eval-02", None)
    assert {s.name for s in lab_status() if s.running} == set(lab.hosts)
    assert "eval-01" not in yaml.safe_load((lab.lab_dir / "inventory.yaml").read_text())["hosts"]


def test_a_limit_it_may_not_raise_is_refused_before_anything_boots(lab, inotify_limit_just_short_of) -> None:
    """/proc/sys read-only, as in a container: `lab up --extra 2` refuses in one line, nothing boots."""
    needed = inotify_limit_just_short_of(2)
    before = {s.name: s.pid for s in lab_status() if s.running}
    read_only_sysctls = "mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && exec \"$@\""
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", read_only_sysctls, "sh",
                           sys.executable, "-m", "ddops", "-i", str(lab.inventory_path), "lab", "up", "--extra", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (
        f"error: {len(lab.hosts) + 2} lab hosts need more than this machine allows: {INSTANCES} is {needed - 1}, they need {needed} "
        f"(as root: sysctl -w {INSTANCES}={needed})")
    assert read_sysctl(INSTANCES) == needed - 1
    assert {s.name: s.pid for s in lab_status() if s.running} == before


def test_port_taken_by_another_process_is_a_clear_error(lab) -> None:
    with socket.socket() as squatter:
        # The previous test's eval-01 just left 2210: its connections may linger in TIME_WAIT.
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", 2210))
        squatter.listen(1)
        with pytest.raises(LabError, match="port 2210 .* already in use"):
            lab_up(lab.inventory_path, extra=1, progress=lambda _: None)
    assert {s.name for s in lab_status() if s.running} == set(lab.hosts)

"""`ddops status` against the real lab: all hosts, a dead host, a silent host, a jump host, an impostor, host keys."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.lab


def ddops(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddops", *args], capture_output=True, text=True, timeout=timeout)


def status_json(inventory: Path, *extra: str) -> tuple[int, dict[str, dict]]:
    done = ddops("-i", str(inventory), *extra, "status", "--json")
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, {r["host"]: r for r in json.loads(done.stdout)}


def derived_inventory(lab, tmp_path: Path, edit) -> Path:
    """A copy of the lab inventory changed by edit(data)."""
    data = yaml.safe_load(Path(lab.inventory_path).read_text())
    edit(data)
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def training_running(lab) -> None:
    """Other tests stop ct200's training job; this one needs it running and logging."""
    lab.ssh("ct200", "systemctl start dflash-train.service")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if lab.ssh("ct200", "grep -q 'step ' /root/train/train.log").returncode == 0:
            return
        time.sleep(0.5)
    pytest.fail("ct200's training job logged no step within 30 s")


def test_status_shows_the_whole_lab(lab, training_running) -> None:
    code, hosts = status_json(lab.inventory_path)
    assert code == 0, hosts
    assert set(hosts) == {"pve", "ct200", "llm-two", "eval-a6000"}
    assert all(h["reachable"] and h["identity"]["ok"] for h in hosts.values())
    ct200 = hosts["ct200"]
    assert ct200["identity"]["hostname"] == "ct200" and ct200["reached_as"] == "pct 200 on pve"
    assert len(ct200["gpus"]) == 8 and all("RTX PRO 6000 Blackwell" in g["name"] for g in ct200["gpus"])
    assert all(g["memory_used_mib"] > 0 for g in ct200["gpus"])  # the training job holds GPU memory
    training = ct200["training"]
    assert training["running"] and training["pid"] > 1 and "train_dflash_pipeline.py" in training["cmdline"]
    assert training["last_step"] is not None and training["unit"]["ActiveState"] == "active"
    sglang = hosts["llm-two"]
    assert sglang["services"][0]["unit"] == "sglang-qwen.service"
    assert sglang["services"][0]["ActiveState"] == "active"
    assert sglang["services"][0]["tensor_parallel"] == 1   # from systemd's ExecStart: SGLang without --tp-size
    assert sglang["runtime"][0]["healthy"] is True
    assert hosts["eval-a6000"]["identity"]["gpu_model"] == "NVIDIA RTX A6000"


def test_table_output_names_every_host(lab) -> None:
    done = ddops("-i", str(lab.inventory_path), "status")
    assert done.returncode == 0, done.stderr
    for name in ("pve", "ct200", "llm-two", "eval-a6000", "sglang-qwen.service", "TP 1"):
        assert name in done.stdout


def test_impostor_a6000_box_is_loudly_a_mismatch(lab, tmp_path: Path) -> None:
    """The eval box answering where the Pro6000 box is expected must never pass."""
    def edit(data: dict) -> None:
        data["hosts"]["llm-two"]["port"] = data["hosts"]["eval-a6000"]["port"]

    inventory = derived_inventory(lab, tmp_path, edit)
    code, hosts = status_json(inventory)
    assert code == 2
    ident = hosts["llm-two"]["identity"]
    assert not ident["ok"]
    assert "hostname is 'eval-a6000', expected 'llm-two'" in ident["mismatches"]
    assert any("GPU model is 'NVIDIA RTX A6000'" in m for m in ident["mismatches"])
    table = ddops("-i", str(inventory), "--limit", "llm-two", "status")
    assert "IDENTITY MISMATCH on llm-two" in table.stdout and table.returncode == 2


@pytest.fixture
def silent_port():
    """A TCP port that accepts connections and never says a word (a hung sshd)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(timeout=5)
    for conn in held:
        conn.close()
    server.close()


def test_dead_and_silent_hosts_do_not_hide_the_others(lab, tmp_path: Path, silent_port: int) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]

    def edit(data: dict) -> None:
        data["hosts"]["dead"] = {"address": "127.0.0.1", "port": dead_port}
        data["hosts"]["silent"] = {"address": "127.0.0.1", "port": silent_port, "connect_timeout": 2}

    inventory = derived_inventory(lab, tmp_path, edit)
    started = time.monotonic()
    code, hosts = status_json(inventory)
    elapsed = time.monotonic() - started
    assert code == 4
    assert not hosts["dead"]["reachable"] and "cannot reach dead" in hosts["dead"]["error"]
    assert not hosts["silent"]["reachable"]
    assert all(hosts[n]["reachable"] and hosts[n]["identity"]["ok"] for n in ("pve", "ct200", "llm-two"))
    assert elapsed < 30, f"a silent host stalled status for {elapsed:.1f}s"


def test_ssh_jump_host(lab, tmp_path: Path) -> None:
    """ct200 reached by an SSH jump through pve (direct-tcpip), instead of `pct exec`."""
    def edit(data: dict) -> None:
        ct = data["hosts"]["ct200"]
        del ct["pct"]
        ct.update(address="127.0.0.1", port=ct["lab"]["port"])

    code, hosts = status_json(derived_inventory(lab, tmp_path, edit), "--limit", "ct200")
    assert code == 0
    assert hosts["ct200"]["reached_as"].endswith("via pve")
    assert hosts["ct200"]["identity"]["ok"] and len(hosts["ct200"]["gpus"]) == 8


def test_host_keys_are_verified(lab, tmp_path: Path) -> None:
    known = Path(lab.known_hosts).read_text().splitlines()
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    wrong = tmp_path / "wrong_known_hosts"
    # Every host's line, but llm-two's entry carries eval-a6000's key: a changed key.
    eval_key = next(l for l in known if l.startswith("[127.0.0.1]:2203 ")).split(" ", 1)[1]
    wrong.write_text("\n".join(f"[127.0.0.1]:2202 {eval_key}" if l.startswith("[127.0.0.1]:2202 ") else l
                               for l in known) + "\n")

    def with_known_hosts(path: Path):
        return lambda data: data["defaults"].update(known_hosts=str(path))

    code, hosts = status_json(derived_inventory(lab, tmp_path, with_known_hosts(wrong)), "--limit", "llm-two")
    assert code == 4 and "has CHANGED" in hosts["llm-two"]["error"] and "ssh-keygen" in hosts["llm-two"]["error"]

    inventory = derived_inventory(lab, tmp_path, with_known_hosts(empty))
    code, hosts = status_json(inventory, "--limit", "llm-two")
    assert code == 4 and "is unknown" in hosts["llm-two"]["error"]
    code, hosts = status_json(inventory, "--limit", "llm-two", "--accept-new-host-keys")
    assert code == 0 and hosts["llm-two"]["identity"]["ok"]
    assert "[127.0.0.1]:2202 " in empty.read_text()
    code, _ = status_json(inventory, "--limit", "llm-two")  # now known: strict mode passes
    assert code == 0


def test_logs_names_the_unit_and_says_when_it_is_not_installed(lab) -> None:
    done = ddops("-i", str(lab.inventory_path), "logs", "--host", "ct200", "--unit", "made-up.service")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: made-up.service is not installed on ct200 and has no journal entries (check the name; the "
        "inventory lists ddtree.service for ct200)"]
    done = ddops("-i", str(lab.inventory_path), "logs", "--host", "ct200", "--unit", "dflash-train.service", "-n", "3")
    assert done.returncode == 0, done.stderr
    assert "journal of dflash-train.service on ct200, last 3 lines" in done.stderr
    assert "ct200" in done.stdout


def test_history_with_nothing_recorded_says_so(lab) -> None:
    # eval-a6000 only ever serves as a sync source: nothing pivots it (llm-two is pivoted by the SGLang tests)
    done = ddops("-i", str(lab.inventory_path), "history", "--host", "eval-a6000")
    assert done.returncode == 0 and done.stdout == ""
    assert done.stderr.strip() == ("no pivots or rollbacks recorded on eval-a6000 yet (each host keeps its own in "
                                   "/var/lib/ddops/history.jsonl)")

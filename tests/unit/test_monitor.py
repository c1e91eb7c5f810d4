"""`ddops monitor`'s rendering: one discovery file per job, a job per API key with its token in a file
(never in the configuration), and the configuration Prometheus reads."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

import ddops.monitor as monitor_module
from ddops.errors import StepFailed
from ddops.executor import CommandResult
from ddops.inventory import load_inventory
from ddops.monitor import CONFIG, SD_DIR, ScrapeTarget, render

LAB = load_inventory(Path(__file__).resolve().parents[2] / "inventories" / "lab.yaml")


def test_targets_are_grouped_by_api_key_and_tokens_stay_out_of_the_config():
    found = [ScrapeTarget("ct200", "ddtree@1.service", "10.0.0.2", 8201, "s3cret"),
             ScrapeTarget("ct200", "ddtree@2.service", "10.0.0.2", 8202, "s3cret"),
             ScrapeTarget("llm-two", "sglang-qwen.service", "10.0.0.3", 30000, None)]
    rendered = render("mon", found)
    files = {f["path"]: f for f in rendered.files}
    config = yaml.safe_load(files[CONFIG]["text"])
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"prometheus", "ddops-serving", "ddops-serving-key1"}
    keyed = jobs["ddops-serving-key1"]
    assert keyed["authorization"] == {"type": "Bearer", "credentials_file": f"{SD_DIR}/ddops-serving-key1.token"}
    assert "authorization" not in jobs["ddops-serving"]
    assert "s3cret" not in files[CONFIG]["text"]
    assert files[f"{SD_DIR}/ddops-serving-key1.token"] == {
        "path": f"{SD_DIR}/ddops-serving-key1.token", "text": "s3cret", "mode": 0o640}
    assert rendered.secret_paths == [f"{SD_DIR}/ddops-serving-key1.token"]
    groups = json.loads(files[f"{SD_DIR}/ddops-serving-key1.json"]["text"])
    assert groups == [{"targets": ["10.0.0.2:8201"], "labels": {"ddops_host": "ct200", "unit": "ddtree@1.service"}},
                      {"targets": ["10.0.0.2:8202"], "labels": {"ddops_host": "ct200", "unit": "ddtree@2.service"}}]
    assert json.loads(files[f"{SD_DIR}/ddops-serving.json"]["text"])[0]["targets"] == ["10.0.0.3:30000"]


def test_a_scratch_render_moves_every_path():
    rendered = render("mon", [ScrapeTarget("ct200", "ddtree.service", "127.0.0.1", 8200, "k")],
                      root="/tmp/x", config_path="/tmp/x/prometheus.yml")
    assert all(f["path"].startswith("/tmp/x/") for f in rendered.files)
    assert "/etc/prometheus" not in rendered.files[0]["text"]


# -- the port, checked before anything changes (issue 36, defect 10) --------------------------------

class LocalExecutor:
    """Runs each command on this machine (the probes are plain python3), keeping every argv."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def run(self, host, argv, *, timeout=None, stdin=None, on_output=None) -> CommandResult:
        self.commands.append(list(argv))
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
        return CommandResult(host.name, "", done.returncode, done.stdout, done.stderr, 0)


def test_a_taken_port_is_refused_at_once_naming_its_holder(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(monitor_module, "PORT", port)
        executor = LocalExecutor()
        with pytest.raises(StepFailed) as err:
            monitor_module.monitor(executor, LAB, LAB.hosts["ct200"], [], {}, lambda message: None)
    line = err.value.line()
    assert f"port {port} on ct200 is held by " in line and f"pid {os.getpid()}" in line
    assert "nothing was changed" in line
    assert len(executor.commands) == 1       # the probe only: no apt-get, no install, no 60 s wait


def test_a_free_port_passes(monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(monitor_module, "PORT", port)
    monitor_module.check_port(LocalExecutor(), LAB.hosts["ct200"])

"""The command line as a new user types it (issue 36): global options before or after the command,
`rollback -y` as `pivot -y`, help that says what --kill-training does, and exit 3 documented."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import ddops.cli as cli_module
from ddops.cli import cli

INVENTORY = """\
hosts:
  ct200: {address: 10.0.0.2, services: [ddtree.service]}
  llm-two: {address: 10.0.0.3}
"""


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    path = tmp_path / "inv.yaml"
    path.write_text(INVENTORY)
    return path


@pytest.fixture
def seen(monkeypatch) -> list:
    """The Context each command builds its executor from; no host is contacted."""
    contexts: list = []

    def executor(self, inventory):
        contexts.append(self)
        return contextlib.nullcontext(None)

    monkeypatch.setattr(cli_module.Context, "executor", executor)
    monkeypatch.setattr("ddops.status.collect", lambda executor, hosts: [{"host": h.name} for h in hosts])
    monkeypatch.setattr("ddops.status.render", lambda records, console: None)
    monkeypatch.setattr("ddops.status.exit_code", lambda records: 0)
    return contexts


@pytest.mark.parametrize("where", ["before", "after", "split"])
def test_global_options_go_before_or_after_the_command(inventory, seen, where):
    options = ["-i", str(inventory), "--limit", "llm-two", "--accept-new-host-keys", "-vv"]
    args = {"before": [*options, "status"], "after": ["status", *options],
            "split": ["-i", str(inventory), "-v", "status", "--limit", "llm-two", "--accept-new-host-keys", "-v"]}[where]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (obj,) = seen
    assert (obj.inventory_path, obj.limit, obj.accept_new_host_keys, obj.verbose) == (inventory, "llm-two", True, 2)


def test_an_unknown_limit_after_the_command_is_the_same_one_line_error(inventory):
    for args in (["-i", str(inventory), "--limit", "nope", "status"], ["status", "-i", str(inventory), "--limit", "nope"]):
        done = subprocess.run([sys.executable, "-m", "ddops", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "no host or group named 'nope'" in done.stderr, done.stderr


def test_a_subgroup_s_commands_take_them_too(inventory, monkeypatch):
    monkeypatch.setattr("ddops.lab.lab_status", lambda: [])
    result = CliRunner().invoke(cli, ["lab", "status", "--json", "-i", str(inventory)], catch_exceptions=False)
    assert result.exit_code == 0 and result.output.strip() == "[]"


def test_rollback_takes_yes_as_pivot_does(inventory, seen, monkeypatch):
    monkeypatch.setattr("ddops.backups.list_backups", lambda executor, host, unit: [])
    for flag in ("-y", "--yes"):
        result = CliRunner().invoke(cli, ["-i", str(inventory), "rollback", "--host", "ct200", flag, "--list", "--json"],
                                    catch_exceptions=False)
        assert result.exit_code == 0 and result.output.strip() == "[]", result.output


def test_rollback_off_a_terminal_runs_without_asking(inventory, seen, monkeypatch):
    done = []
    monkeypatch.setattr("ddops.rollback.rollback_command",
                        lambda *a, **k: done.append(a[3]) or {"outcome": "rolled-back"})
    monkeypatch.setattr(cli_module, "_refresh_monitors", lambda *a: None)
    result = CliRunner().invoke(cli, ["-i", str(inventory), "rollback", "--host", "ct200", "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 0 and done == ["ddtree.service"], result.output


def test_kill_training_help_says_what_really_happens():
    text = " ".join(CliRunner().invoke(cli, ["pivot", "--help"]).output.split())
    assert "first the profile's checkpoint request" in text
    assert text.index("checkpoint request") < text.index("SIGTERM") < text.index("grace_s") < text.index("SIGKILL")


def test_exit_code_3_is_documented_and_used_for_a_bug(monkeypatch, capsys, tmp_path):
    assert "3 an internal error" in " ".join(CliRunner().invoke(cli, ["--help"]).output.split())

    def crash(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "main", crash)
    monkeypatch.setattr(sys, "argv", ["ddops", "status"])
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))   # where the crash log goes
    with pytest.raises(SystemExit) as exit_:
        cli_module.main()
    assert exit_.value.code == 3
    assert "internal error: RuntimeError('a bug')" in capsys.readouterr().err
    assert len(list(tmp_path.glob("ddops-crash-*.log"))) == 1

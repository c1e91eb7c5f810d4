"""Bad input through the real CLI entry point: one clear line, exit 2, no traceback, nothing touched.

The CLI runs in-process (`ddops.cli.main`) with SSH connections forbidden, so "nothing changed" is
proven: no host is ever contacted. Cases: every malformed inventory of tests/unit/test_inventory.py
(BAD, reused, not copied), the malformed profiles below (new ones; tests/unit/test_profile.py has
more at the loader level, tests/unit/test_render_safety.py the unit-file escaping), inventory numbers
Python cannot parse or print, broken unit templates and CLI misuse. Lab-only misuse (a rollback with
no backups) is at the end.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import yaml


REPO = Path(__file__).resolve().parents[2]
LAB_INVENTORY = REPO / "inventories" / "lab.yaml"
PROFILE = REPO / "playbooks" / "lab-ddtree16.yaml"
DELETE = object()


def _unit_inventory_cases() -> list:
    spec = importlib.util.spec_from_file_location("unit_test_inventory", REPO / "tests" / "unit" / "test_inventory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BAD


INVENTORY_CASES = _unit_inventory_cases()


def one_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert "Traceback" not in output and "internal error" not in output, output
    assert len(lines) == 1, output
    return lines[0]


@pytest.mark.parametrize("text,message,line", INVENTORY_CASES, ids=[c[1][:30] for c in INVENTORY_CASES])
def test_bad_inventory_via_cli(cli, tmp_path, text, message, line):
    path = tmp_path / "inv.yaml"
    path.write_text(text)
    code, output = cli("-i", str(path), "status")
    assert code == 2
    error = one_line(output)
    assert message in error and f"{path}:{line}:" in error, error


# (id, changes to the lab profile as {"dotted.key": value or DELETE} or raw YAML text, message)
PROFILE_CASES = [
    ("yaml-unclosed", "name: x\nport: [8200\n", "invalid YAML"),
    ("yaml-list", "- a\n- b\n", "must be a YAML mapping"),
    ("yaml-empty", "", "must be a YAML mapping"),
    ("yaml-duplicate", None, "duplicate key"),
    ("missing-unit", {"unit": DELETE}, "missing required key `unit`"),
    ("missing-port", {"port": DELETE}, "missing required key `port`"),
    ("missing-host", {"host": DELETE}, "missing required key `host`"),
    ("missing-runtime", {"runtime": DELETE}, "missing required key `runtime`"),
    ("missing-smoke", {"smoke": DELETE}, "missing required key `smoke`"),
    ("unknown-top", {"healthh": {}}, "did you mean `health`"),
    ("venv-relative", {"runtime.venv": "opt/venv"}, "absolute path"),
    ("model-relative", {"models.target.path": "models/t"}, "absolute path"),
    ("model-shallow", {"models.target.path": "/root"}, "too shallow"),
    ("model-system-dir", {"models.draft.path": "/usr/lib"}, "system directory"),
    ("model-role-typo", {"models.draf": {"path": "/root/models/x"}}, "did you mean `draft`"),
    ("model-from-no-host", {"models.draft.from": {"path": "/root/models/d"}}, "missing required key `models.draft.from.host`"),
    ("model-from-unknown-host", {"models.draft.from.host": "nosuch"}, "profile names host 'nosuch'"),
    ("model-min-free", {"models.target.min_free_gib": -1}, "between 0"),
    ("host-unknown", {"host": "ct999"}, "profile names host 'ct999'"),
    ("index-no-wheelhouse", {"runtime.index": False}, "needs a `wheelhouse`"),
    ("ship-nowhere", {"runtime.ship": "no/such/dir"}, "has no pyproject.toml"),
    ("package-import-name", {"runtime.packages.bad-name": "x"}, "invalid import name"),
    ("package-not-string", {"runtime.packages.torch": ["torch"]}, "must be a string"),
    ("runtime-typo", {"runtime.pacakges": {}}, "did you mean `packages`"),
    ("torch-cuda-word", {"runtime.torch": {"version": "2.7.1", "cuda": "cu128"}}, "must be a CUDA version"),
    ("torch-version-range", {"runtime.torch": {"version": ">=2.4", "cuda": "12.8"}}, "must be a release like"),
    ("torch-index-not-url", {"runtime.torch": {"version": "2.7.1", "cuda": "12.8", "index": "pytorch"}},
     "must be an http(s) URL"),
    ("torch-twice", {"runtime.torch": {"version": "2.7.1", "cuda": "12.8"}}, "both runtime.torch and"),
    ("tree-budget-zero", {"serve.tree_budget": 0}, "between 1 and 1024"),
    ("extra-args-string", {"serve.extra_args": "--x"}, "must be a list"),
    ("mode-without-draft", {"models.draft": DELETE}, "needs a `models.draft`"),
    ("smoke-empty", {"smoke.prompts": []}, "`smoke.prompts` is empty"),
    ("smoke-no-expect", {"smoke.prompts": [{"prompt": "hi"}]}, "missing required key `smoke.prompts[0].expect`"),
    ("smoke-bad-regex", {"smoke.prompts": [{"prompt": "hi", "expect": "("}]}, "not a valid regex"),
    ("smoke-max-tokens", {"smoke.max_tokens": 0}, "between 1 and 4096"),
    ("health-path", {"health.path": "health"}, "must be a URL path"),
    ("health-interval", {"health.interval_s": 0}, "between 0.1 and 60"),
    ("health-deadline-absurd", {"health.deadline_s": 1e9}, "between 1 and 7200"),
    ("grace-negative", {"training.grace_s": -5}, "between 0 and 3600"),
    ("env-not-scalar", {"env.X": [1]}, "must be a string or a number"),
    ("env-newline", {"env.X": "a\nb"}, "contains a newline"),
    ("dtype", {"dtype": "fp8"}, "must be one of"),
    ("gpus-negative", {"gpus": -1}, "list of GPU indexes"),
    ("conflicts-bad-unit", {"conflicts": ["bad unit"]}, "invalid systemd service name"),
    ("secret-unknown-key", {"secrets": {"DDTREE_API_KEY": {"env": "K", "extra": 1}}}, "unknown key"),
    ("secret-not-set", {"secrets": {"DDTREE_API_KEY": {"env": "DDOPS_REL_UNSET_SECRET"}}}, "is not set"),
    ("description-type", {"description": ["x"]}, "must be a string"),
    ("sglang-missing-section", {"engine": "sglang"}, "needs an `sglang:` section"),
    ("sglang-on-ddtree", {"sglang": {"python": "/usr/bin/python3", "num_draft_tokens": 8}},
     "only for `engine: sglang`"),
    ("sglang-dp-attention", {"engine": "sglang", "smoke.lossless_check": False,
                             "sglang": {"python": "/usr/bin/python3", "num_draft_tokens": 8, "dp_attention": True}},
     "dp-attention"),
    ("sglang-too-many-draft-tokens", {"engine": "sglang", "smoke.lossless_check": False,
                                      "sglang": {"python": "/usr/bin/python3", "num_draft_tokens": 32,
                                                 "draft_block_size": 16}}, "exceed the drafter's block size"),
    ("sglang-lossless", {"engine": "sglang", "sglang": {"python": "/usr/bin/python3", "num_draft_tokens": 8},
                         "smoke.lossless_check": True}, "lossless spot-check"),
    # issue 12: the runtime's limits (runtime/ddtree_runtime/limits.py), checked at load
    ("block-size-one", {"serve.block_size": 1}, "at least 2"),
    ("tree-budget-over-runtime", {"serve.tree_budget": 1025}, "between 1 and 1024"),
    ("mode-unknown", {"serve.mode": "tree"}, "must be one of ddtree, dflash, ar"),
    # issue 12: numbers Python cannot parse or print, and numbers that are not numbers
    ("int-5000-digits", PROFILE.read_text().replace("port: 8200", "port: " + "9" * 5000), "is too large"),
    ("int-huge-hex", PROFILE.read_text().replace("tree_budget: 16", "tree_budget: 0x" + "f" * 5000), "is too large"),
    ("number-nan", {"health.deadline_s": float("nan")}, "must be a finite number"),
    # issue 36: a path out of where it may live, a control character YAML's reader refuses, 1e308
    ("venv-parent-step", {"runtime.venv": "/opt/ddtree/../../usr"}, "has a `..` step"),
    ("venv-system-dir", {"runtime.venv": "/usr"}, "is a system directory or too shallow"),
    ("model-parent-step", {"models.target.path": "/root/models/../../etc/x"}, "has a `..` step"),
    ("control-char-bel", PROFILE.read_text().replace("name: lab-ddtree16", "name: lab\x07ddtree16"),
     "control character '\\x07'"),
    ("number-exponent", PROFILE.read_text().replace("deadline_s: 240", "deadline_s: 1e308"),
     "must be between 1 and 7200, got 1e+308"),
    # issue 12: values that would add a line to the unit or env file, or expand inside it
    ("name-newline", {"name": "x\nExecStartPre=/bin/touch /tmp/pwned"}, "profile name"),
    ("name-carriage-return", {"name": "x\r[Service]"}, "profile name"),
    ("name-specifier", {"name": "tiny%n"}, "profile name"),
    ("description-newline", {"description": "x\nExecStartPre=/bin/true"}, "line break or control character"),
    ("unit-trailing-newline", {"unit": "ddtree.service\n"}, "invalid systemd service name"),
    ("bind-newline", {"bind": "127.0.0.1\nExecStartPre=/bin/true"}, "IP address or a host name"),
    ("bind-extra-word", {"bind": "0.0.0.0 --insecure-no-auth"}, "IP address or a host name"),
    ("device-newline", {"device": "cpu\n"}, "cpu, cuda or cuda:N"),
    ("env-carriage-return", {"env.X": "a\rB=1"}, "contains a newline or control character"),
    ("env-name-newline", {"env": {"X\n": 1}}, "invalid environment variable name"),
    ("venv-dollar", {"runtime.venv": "/opt/$X/venv"}, "systemd cannot take"),
    ("model-path-carriage-return", {"models.target.path": "/root/models/t\rX=1"}, "control character"),
    ("served-name-nul", {"serve.served_model_name": "tiny\0"}, "NUL byte"),
    ("extra-args-nul", {"serve.extra_args": ["--x", "a\0"]}, "NUL byte"),
    ("health-path-crlf", {"health.path": "/health\r\nHost: x"}, "must be a URL path"),
    # issue 12: a local source is absolute, outside the system trees, and a model dir
    ("local-source-relative", {"models.target.from.path": "../../../../etc"}, "must be absolute"),
    ("local-source-variable", {"models.target.from.path": "$HOME/models/t"}, "must be absolute"),
    ("local-source-etc", {"models.target.from.path": "/root/../etc"}, "has a `..` step"),
    ("local-source-usr", {"models.target.from.path": "/usr/share"}, "is /usr/share, a system directory"),
    ("local-source-not-a-model", {"models.target.from.path": str(REPO / "docs")}, "not a model directory"),
]


def write_profile(folder: Path, changes) -> Path:
    path = folder / "profile.yaml"
    if isinstance(changes, str):
        path.write_text(changes)
        return path
    if changes is None:  # a duplicate key, which yaml.safe_dump cannot write
        path.write_text(PROFILE.read_text() + "port: 8300\n")
        return path
    doc = yaml.safe_load(PROFILE.read_text())
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = doc
        for key in parents:
            node = node.setdefault(key, {})
        if value is DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.parametrize("case,changes,message", PROFILE_CASES, ids=[c[0] for c in PROFILE_CASES])
def test_bad_profile_via_cli(cli, tmp_path, case, changes, message):
    os.environ.pop("DDOPS_REL_UNSET_SECRET", None)
    path = write_profile(tmp_path, changes)
    code, output = cli("-i", str(LAB_INVENTORY), "pivot", "--deploy", str(path), "--yes", "--kill-training")
    assert code == 2
    error = one_line(output)
    assert message in error, error
    assert f"{path}:" in error, error  # located in the user's file


def _inventory_with(old: str, new: str) -> str:
    text = LAB_INVENTORY.read_text()
    assert old in text
    return text.replace(old, new, 1)


# issue 12: the inventory's numbers, through the same YAML loader
INVENTORY_NUMBER_CASES = [
    ("port-5000-digits", _inventory_with("port: 2200", "port: " + "9" * 5000), "is too large", 14),
    ("pct-huge-hex", _inventory_with("pct: 200", "pct: 0x" + "f" * 5000), "is too large", 23),
    ("timeout-nan", _inventory_with("connect_timeout: 5", "connect_timeout: .nan"), "finite number", 8),
]


@pytest.mark.parametrize("case,text,message,line", INVENTORY_NUMBER_CASES, ids=[c[0] for c in INVENTORY_NUMBER_CASES])
def test_bad_inventory_numbers_via_cli(cli, tmp_path, case, text, message, line):
    path = tmp_path / "inv.yaml"
    path.write_text(text)
    code, output = cli("-i", str(path), "status")
    assert code == 2
    error = one_line(output)
    assert message in error and f"{path}:{line}:" in error, error


TEMPLATE_CASES = [
    ("missing-variable", "ExecStart={{ exec_start }} --x {{ profile.no_such_field }}\n", "no_such_field"),
    ("syntax-error", "[Service]\n{% if profile.port %}\nExecStart={{ exec_start }}\n", "template"),
    ("undefined-name", "ExecStart={{ exec_start }} {{ nope }}\n", "'nope' is undefined"),
]


@pytest.mark.parametrize("case,template,message", TEMPLATE_CASES, ids=[c[0] for c in TEMPLATE_CASES])
def test_bad_template_via_cli(cli, tmp_path, case, template, message):
    (tmp_path / "ddtree.service.j2").write_text(template)
    code, output = cli("-i", str(LAB_INVENTORY), "pivot", "--deploy", str(PROFILE), "--yes",
                       env={"DDOPS_TEMPLATES": str(tmp_path)})
    assert code == 2
    error = one_line(output)
    assert message in error and "ddtree.service.j2" in error, error


CLI_CASES = [
    ("unknown-limit", ["--limit", "ct200,nope", "status"], "no host or group named 'nope'"),
    ("unknown-group-limit", ["--limit", "gpus", "status"], "no host or group named 'gpus'"),
    ("rollback-unknown-host", ["rollback", "--host", "nope"], "nope"),
    ("logs-no-services", ["logs", "--host", "eval-a6000"], "lists no services"),
    ("history-unknown-host", ["history", "--host", "nope"], "nope"),
    ("pivot-unknown-profile", ["pivot", "--deploy", "no-such-profile", "--yes"], "no deploy profile named"),
    ("pivot-missing-profile-file", ["pivot", "--deploy", "/nonexistent/p.yaml", "--yes"], "/nonexistent/p.yaml"),
    ("pivot-needs-yes", ["pivot", "--deploy", "lab-ddtree16"], "needs --yes"),
    ("missing-inventory", ["-i", "/nonexistent/inv.yaml", "status"], "/nonexistent/inv.yaml"),
    ("logs-bad-n", ["logs", "--host", "ct200", "-n", "0"], "0"),
]


@pytest.mark.parametrize("case,args,message", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_misuse(cli, case, args, message):
    if args[0] != "-i":
        args = ["-i", str(LAB_INVENTORY), *args]
    code, output = cli(*args, env={"DDOPS_PLAYBOOKS": str(REPO / "playbooks")})
    assert code == 2
    error = one_line(output) if case != "logs-bad-n" else output  # click prints usage + the error
    assert message in error and "Traceback" not in output, output


@pytest.mark.lab
def test_rollback_with_no_backups_changes_nothing(lab):
    import subprocess

    snapshot = "ls -la /var/lib/ddops /var/lib/ddops/backups 2>&1; sha256sum /var/lib/ddops/history.jsonl 2>&1; " \
               "systemctl show sglang-qwen.service -p MainPID -p ActiveState"
    before = lab.ssh("llm-two", snapshot).stdout
    for args in (["rollback", "--host", "llm-two"], ["rollback", "--host", "llm-two", "--to", "20990101T000000Z-dead"]):
        done = subprocess.run([sys.executable, "-m", "ddops", "-i", str(lab.inventory_path), *args],
                              capture_output=True, text=True, timeout=120, cwd=REPO, stdin=subprocess.DEVNULL)
        assert done.returncode == 2, done.stderr
        error = one_line(done.stderr)
        assert "no backups of sglang-qwen.service on llm-two" in error
    assert lab.ssh("llm-two", snapshot).stdout == before

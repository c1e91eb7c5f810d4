"""Deploy profiles: the shipped ones load; malformed ones give one located line with the fix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from ddops.errors import ConfigError
from ddops.profile import load_profile, resolve_profile

REPO = Path(__file__).resolve().parents[2]

GOOD = """\
name: t
host: ct200
unit: ddtree.service
port: 8200
device: cpu
models:
  target: {path: /root/models/t, from: {host: local, path: /tmp/t}}
  draft: {path: /root/models/d, from: {host: eval-a6000, path: /root/models/d}}
runtime:
  venv: /opt/ddtree/venv
  packages: {torch: torch}
smoke:
  prompts:
    - {prompt: "What is 2+3?", expect: "5"}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("name", ["lab-ddtree16", "lab-sliding-ddtree16", "zlab-ddtree16", "llm-two-sglang-dflash"])
def test_shipped_profiles_load(name):
    profile = load_profile(resolve_profile(name, REPO / "playbooks"), repo_root=REPO)
    assert profile.name == name
    if profile.engine == "ddtree":
        assert profile.serve.block_size == 16 and profile.serve.tree_budget == 16
    # the service the pivot replaces ran a 131,072-token context; the lab keeps the runtime's default
    assert profile.serve.max_context == (131072 if name == "zlab-ddtree16" else None)
    # ...and 16 requests at once (its --max-running-requests), set there; elsewhere the runtime's default, 16
    assert profile.serve.max_running == 16
    assert ("max_running" in profile.serve.given) == (name == "zlab-ddtree16")


def test_a_number_with_an_exponent_is_the_number_it_looks_like(tmp_path):
    profile = load_profile(write(tmp_path, GOOD + "health: {deadline_s: 6e2}\n"), repo_root=REPO)
    assert profile.health.deadline_s == 600.0


def test_good_profile(tmp_path):
    p = load_profile(write(tmp_path, GOOD), repo_root=REPO)
    assert p.model("draft").source.host == "eval-a6000"
    assert p.env_file == "/etc/ddops/ddtree.env"
    assert p.bind == "127.0.0.1"


BAD = [
    ("prot: 8200", "unknown key `prot`", "did you mean `port`"),
    ("port: 70000", "between 1 and 65535", None),
    ("port: eighty", "must be an integer", None),
    ("unit: ddtree", "invalid systemd service name", None),
    ("bind: 0.0.0.0", "without an API key", "secrets"),
    ("conflicts: [ddtree.service]", "own unit", None),
    ("device: tpu", "cpu, cuda or cuda:N", None),
    ("gpus: [a]", "list of GPU indexes", None),
    ("serve: {mode: fast}", "must be one of ddtree, dflash, ar", None),
    ("serve: {block_size: 1}", "at least 2", None),           # the runtime's floor (limits.py)
    ("serve: {tree_budget: 1025}", "between 1 and 1024", None),  # the runtime's range
    ("serve: {max_context: 0}", "at least 1", None),
    ("serve: {max_context: 128k}", "must be an integer", None),
    ("serve: {max_running: 0}", "between 1 and 1024", None),     # limits.py, as the runtime's CLI
    ("serve: {max_queue: 100001}", "between 1 and 100000", None),
    ("serve: {mem_fraction: 0}", "between 0.01 and 1", None),
    ("serve: {mem_fraction: 1.5}", "between 0.01 and 1", None),
    ("serve: {mem_fraction: most}", "must be a number", None),
    ("serve: {prefix_cache: false, prefix_cache_rows: 4}", "needs the prefix cache", "prefix_cache: true"),
    ("serve: {prefix_cache: maybe}", "true or false", None),
    ("port: " + "9" * 5000, "(5000 characters) is too large", "18 digits"),
    ("port: 0x" + "f" * 5000, "is too large", None),         # parses, but could not be printed
    ("port: 12345678901234567890", "is too large", None),
    ("health: {deadline_s: .nan}", "must be a finite number", None),
    ("training: {grace_s: .inf}", "must be a finite number", None),
    ("health: {deadline_s: -1}", "between 1", None),
    ("health: {deadline_s: 1e308}", "`health.deadline_s` must be between 1 and 7200, got 1e+308", None),
    ("health: {deadline_s: 1e400}", "must be a finite number, got inf", None),
    ("port: 8e3", "`port` must be an integer, got 8e3 (a number with an exponent)", "in digits"),
    ("env: {BAD-NAME: 1}", "invalid environment variable name", None),
    ("secrets: {DDTREE_API_KEY: {env: 1x}}", "invalid environment variable name", None),
    ("training: {grace: 3}", "unknown key `training.grace`", "did you mean `grace_s`"),
    ("engine: vllm", "must be one of ddtree, sglang", None),
    ("description: ring\x07bell", "control character '\\x07' (U+0007)", "remove it"),  # YAML's reader refuses it
    ("description: nul\x00", "control character '\\x00' (U+0000)", None),
]


@pytest.mark.parametrize("line, message, fix", BAD)
def test_bad_profile_lines(tmp_path, line, message, fix):
    key = line.split(":", 1)[0]
    text = "\n".join(l for l in GOOD.splitlines() if not l.startswith(key + ":")) + "\n" + line + "\n"
    with pytest.raises(ConfigError) as err:
        load_profile(write(tmp_path, text), repo_root=REPO)
    assert message in err.value.line()
    assert str(tmp_path / "p.yaml") + ":" in err.value.line()
    if fix:
        assert fix in err.value.line()


@pytest.mark.parametrize("models, message", [
    ("models:\n  target: {path: /root}\n", "system directory or too shallow"),
    ("models:\n  target: {path: models/t}\n", "must be an absolute path"),
    ("models:\n  target: {path: /root/models/t}\n", "needs a `models.draft`"),
    ("models:\n  draft: {path: /root/models/d}\n", "needs a `models.target`"),
    ("models:\n  target: {path: /root/models/t, from: {host: h}}\n  draft: {path: /root/models/d}\n",
     "missing required key `models.target.from.path`"),
    ("models:\n  target: {path: /root/models/../../usr/lib}\n", "has a `..` step"),
    ("models:\n  target: {path: /root/t, from: {host: h, path: /root/models/../../etc}}\n", "has a `..` step"),
])
def test_bad_models(tmp_path, models, message):
    head = GOOD.split("models:")[0]
    tail = "runtime:" + GOOD.split("runtime:")[1]
    with pytest.raises(ConfigError) as err:
        load_profile(write(tmp_path, head + models + tail), repo_root=REPO)
    assert message in err.value.line()


@pytest.mark.parametrize("venv, message", [
    ("/opt/ddtree/../../usr", "`runtime.venv` '/opt/ddtree/../../usr' has a `..` step"),   # issue 36's escape
    ("/usr", "'/usr' is a system directory or too shallow"),
    ("/usr/local/ddtree", "inside /usr"),
    ("/var/lib/venv", "inside /var/lib"),
    ("/opt", "too shallow"),
])
def test_the_venv_stays_out_of_system_directories(tmp_path, venv, message):
    with pytest.raises(ConfigError) as err:
        load_profile(write(tmp_path, GOOD.replace("venv: /opt/ddtree/venv", f"venv: {venv}")), repo_root=REPO)
    assert message in err.value.line() and err.value.line().startswith(f"{tmp_path / 'p.yaml'}:10:")


def test_the_venv_path_is_normalised(tmp_path):
    profile = load_profile(write(tmp_path, GOOD.replace("venv: /opt/ddtree/venv", "venv: /opt//ddtree/./venv/")),
                           repo_root=REPO)
    assert profile.runtime.venv == "/opt/ddtree/venv"


def local_source(tmp_path: Path, path: str) -> Path:
    text = GOOD.replace("from: {host: local, path: /tmp/t}", f"from: {{host: local, path: '{path}'}}")
    return write(tmp_path, text)


@pytest.mark.parametrize("path, message", [
    ("../../../../etc", "must be absolute"),
    ("models/t", "must be absolute"),
    ("$HOME/models/t", "must be absolute"),  # only ${DDOPS_CACHE} and ~ are expanded
    ("/root/../etc", "has a `..` step"),
    ("/usr/share", "is /usr/share, a system directory"),
    ("/", "too shallow"),
])
def test_local_sources_stay_out_of_relative_and_system_paths(tmp_path, path, message):
    with pytest.raises(ConfigError) as err:
        load_profile(local_source(tmp_path, path), repo_root=REPO)
    assert message in err.value.line() and f"{tmp_path / 'p.yaml'}:7:" in err.value.line()


def test_local_source_symlink_into_etc_is_refused(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "model").symlink_to("/etc")
    with pytest.raises(ConfigError, match="is /etc, a system directory"):
        load_profile(local_source(tmp_path, str(tmp_path / "cache" / "model")), repo_root=REPO)


def test_local_source_that_exists_must_be_a_model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DDOPS_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "cache" / "m"
    model.mkdir(parents=True)
    with pytest.raises(ConfigError, match="is not a model directory: no config.json"):
        load_profile(local_source(tmp_path, "${DDOPS_CACHE}/m"), repo_root=REPO)
    (model / "config.json").write_text("{}")
    profile = load_profile(local_source(tmp_path, "${DDOPS_CACHE}/m"), repo_root=REPO)
    assert profile.model("target").source.path == str(model)
    # not built yet: accepted here, and refused by preflight (it inspects local sources) before any change
    assert load_profile(local_source(tmp_path, "${DDOPS_CACHE}/later"), repo_root=REPO).model(
        "target").source.path == str(tmp_path / "cache" / "later")


def test_serve_limits_are_the_runtimes():
    """One source of truth: ddops checks profiles against runtime/ddtree_runtime/limits.py, which the
    engine enforces; loading it pulls no torch onto the control machine."""
    from ddtree_runtime import limits

    import ddops.profile as profile

    assert profile.MODES == limits.MODES and profile.DTYPES == limits.DTYPE_NAMES
    assert (profile.LIMITS.MIN_BLOCK_SIZE, profile.LIMITS.MIN_TREE_BUDGET, profile.LIMITS.MAX_TREE_BUDGET) == (
        limits.MIN_BLOCK_SIZE, limits.MIN_TREE_BUDGET, limits.MAX_TREE_BUDGET)
    assert Path(profile.LIMITS.__file__) == REPO / "runtime" / "ddtree_runtime" / "limits.py"
    done = subprocess.run([sys.executable, "-c", "import sys, ddops.profile, ddtree_runtime.limits; "
                           "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


@pytest.mark.parametrize("runtime_installed", [True, False])
def test_limits_without_the_checkout(tmp_path, runtime_installed):
    """ddops installed on its own (no runtime/ beside it) reads the installed runtime's limits, or says
    in one line what to install."""
    shutil.copytree(REPO / "ddops", tmp_path / "ddops", ignore=shutil.ignore_patterns("__pycache__"))
    block = "" if runtime_installed else "sys.modules['ddtree_runtime'] = None; "
    code = (f"import sys; {block}from ddops.errors import ConfigError\n"
            "try:\n    import ddops.profile as p; print(p.__file__, p.LIMITS.__name__, p.LIMITS.MAX_TREE_BUDGET)\n"
            "except ConfigError as e:\n    print(e.line())")
    # this checkout's runtime stands for the installed one (the venv's may be another checkout's)
    path = os.pathsep.join([str(tmp_path), str(REPO / "runtime")] if runtime_installed else [str(tmp_path)])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr
    if runtime_installed:
        assert done.stdout.split() == [str(tmp_path / "ddops" / "profile.py"), "ddtree_runtime.limits", "1024"]
    else:
        assert "limits (ddtree_runtime.limits) are not installed" in done.stdout and "pip install" in done.stdout


def test_the_engine_enforces_the_same_limits():
    pytest.importorskip("torch")
    from ddtree_runtime import limits
    from ddtree_runtime.engine import engine, modes

    assert (tuple(modes.REGISTRY), engine.DTYPE_NAMES, engine.MIN_BLOCK_SIZE, engine.MAX_TREE_BUDGET) == (
        limits.MODES, limits.DTYPE_NAMES, limits.MIN_BLOCK_SIZE, limits.MAX_TREE_BUDGET)


SGLANG = """\
name: s
engine: sglang
host: llm-two
unit: sglang-dflash.service
port: 30000
models:
  target: {path: /root/models/t}
  draft: {path: /root/models/d}
runtime: {venv: /opt/sglang/venv}
sglang: {python: /opt/sglang/venv/bin/python, num_draft_tokens: %s, draft_block_size: 16, dp_attention: %s}
smoke:
  prompts: [{prompt: hi, expect: .}]
"""


@pytest.mark.parametrize("tokens, dp, message", [
    (16, "true", "dp-attention"),
    (17, "false", "exceed the drafter's block size 16"),
])
def test_sglang_rejections(tmp_path, tokens, dp, message):
    with pytest.raises(ConfigError) as err:
        load_profile(write(tmp_path, SGLANG % (tokens, dp)), repo_root=REPO)
    assert message in err.value.line()


def test_sglang_ok(tmp_path):
    p = load_profile(write(tmp_path, SGLANG % (8, "false")), repo_root=REPO)
    assert p.sglang.num_draft_tokens == 8 and not p.smoke.lossless_check


def test_unknown_profile_name_lists_known():
    with pytest.raises(ConfigError) as err:
        resolve_profile("nope", REPO / "playbooks")
    assert "lab-ddtree16" in err.value.line()


def test_a_shipped_runtime_needs_its_dependencies_in_the_profile(tmp_path):
    """The runtime's wheel goes in with --no-deps: a profile missing one of its dependencies (as the
    playbooks written before /metrics used prometheus_client would be) is refused at load, with the fix."""
    doc = yaml.safe_load((REPO / "playbooks" / "lab-ddtree16.yaml").read_text())
    del doc["runtime"]["packages"]["prometheus_client"]
    doc["runtime"]["ship"] = str(REPO / "runtime")
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as err:
        load_profile(path, repo_root=REPO)
    assert "runtime.packages lacks prometheus_client" in err.value.line()
    assert "`prometheus_client: prometheus_client>=0.17`" in err.value.line()

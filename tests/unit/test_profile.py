"""Deploy profiles: the shipped ones load; malformed ones give one located line with the fix."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("name", ["lab-ddtree16", "zlab-ddtree16", "llm-two-sglang-dflash"])
def test_shipped_profiles_load(name):
    profile = load_profile(resolve_profile(name, REPO / "playbooks"), repo_root=REPO)
    assert profile.name == name
    if profile.engine == "ddtree":
        assert profile.serve.block_size == 16 and profile.serve.tree_budget == 16


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
    ("serve: {block_size: 0}", "between 1 and 64", None),
    ("health: {deadline_s: -1}", "between 1", None),
    ("env: {BAD-NAME: 1}", "invalid environment variable name", None),
    ("secrets: {DDTREE_API_KEY: {env: 1x}}", "invalid environment variable name", None),
    ("training: {grace: 3}", "unknown key `training.grace`", "did you mean `grace_s`"),
    ("engine: vllm", "must be one of ddtree, sglang", None),
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
])
def test_bad_models(tmp_path, models, message):
    head = GOOD.split("models:")[0]
    tail = "runtime:" + GOOD.split("runtime:")[1]
    with pytest.raises(ConfigError) as err:
        load_profile(write(tmp_path, head + models + tail), repo_root=REPO)
    assert message in err.value.line()


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

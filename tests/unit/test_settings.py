"""One declaration per serve setting (runtime/ddtree_runtime/settings.py): the server's flags, both
configs, ddops's profile check and the unit's command line all come from it, with the same defaults and
bounds; a new declaration shows up in all of them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from test_render_safety import BASE, profile_from

from ddops.errors import ConfigError
from ddops.profile import Serve
from ddops.serverflags import parse_help
from ddops.steps.unit import exec_argv
from ddtree_runtime import settings
from ddtree_runtime.server.cli import UsageError, build_parser, config_from_args
from ddtree_runtime.server.config import ServerConfig

REPO = Path(__file__).resolve().parents[2]


def defaults(config_class) -> dict:
    return {f.name: f.default_factory() if callable(f.default_factory) else f.default for f in fields(config_class)}


def test_every_setting_is_a_flag_with_its_default_and_a_field_of_both_configs():
    parser = build_parser()
    text = " ".join(parser.format_help().split())
    assert parse_help(parser.format_help()) - {"--help"} == {f for s in settings.SERVE_SETTINGS for f in (s.flag, *s.aliases)}
    parsed = vars(parser.parse_args(["--target", "t"]))
    server = defaults(ServerConfig)
    for s in settings.SERVE_SETTINGS:
        assert " ".join(settings.help_text(s).split()) in text, s.name
        assert list(server).index(s.name) == settings.SERVE_SETTINGS.index(s)
        if not s.required:
            assert server[s.name] == s.default, s.name
            assert parsed[s.name] == ("{}" if s.type is dict else s.default), s.name


def test_the_engine_config_is_the_engine_settings():
    pytest.importorskip("torch")
    from ddtree_runtime.engine import EngineConfig

    engine = defaults(EngineConfig)
    assert list(engine) == [s.name for s in settings.ENGINE_SETTINGS]
    assert all(engine[s.name] == s.default for s in settings.ENGINE_SETTINGS if not s.required)
    assert set(ServerConfig("t", None).engine_kwargs()) == set(engine)


def test_the_profile_takes_the_profile_settings_with_the_runtimes_defaults():
    assert [f.name for f in fields(Serve)] == [s.name for s in settings.PROFILE_SETTINGS] + ["extra_args", "given"]
    serve = Serve()
    assert all(getattr(serve, s.name) == s.default for s in settings.PROFILE_SETTINGS)


BOUNDED = [s for s in settings.PROFILE_SETTINGS if s.type in (int, float) and s.minimum is not None]


@pytest.mark.parametrize("setting", BOUNDED, ids=[s.name for s in BOUNDED])
def test_profile_and_flags_share_the_bounds(tmp_path, setting):
    """At each bound both accept the value; past it both refuse it, naming the setting."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    model = str(tmp_path / "m")
    step = 1 if setting.type is int else 0.001
    edges = [(setting.minimum, True), (setting.minimum - step, False)]
    if setting.maximum is not None:
        edges += [(setting.maximum, True), (setting.maximum + step, False)]
    for value, ok in edges:
        value = setting.type(value)
        argv = ["--target", model, "--draft", model, setting.flag, str(value)]
        if ok:
            assert getattr(profile_from(tmp_path, BASE, {f"serve.{setting.name}": value}).serve, setting.name) == value
            assert getattr(config_from_args(build_parser().parse_args(argv), {}), setting.name) == value
        else:
            with pytest.raises(ConfigError, match=f"serve.{setting.name}"):
                profile_from(tmp_path, BASE, {f"serve.{setting.name}": value})
            with pytest.raises(UsageError, match=f"{setting.flag} {value}: must be"):
                config_from_args(build_parser().parse_args(argv), {})


def test_choices_are_the_runtimes(tmp_path):
    from ddtree_runtime.server.output_parsers import REASONING_PARSERS, TOOL_PARSERS

    assert settings.TOOL_CALL_PARSERS == tuple(sorted(TOOL_PARSERS)) and settings.REASONING_PARSERS == REASONING_PARSERS
    for s in (s for s in settings.PROFILE_SETTINGS if s.choices):
        assert getattr(profile_from(tmp_path, BASE, {f"serve.{s.name}": s.choices[-1]}).serve, s.name) == s.choices[-1]
        with pytest.raises(ConfigError, match="must be one of " + ", ".join(s.choices)):
            profile_from(tmp_path, BASE, {f"serve.{s.name}": "not-a-choice"})


def test_a_setting_reaches_the_unit_when_set_or_off_its_default(tmp_path):
    unset = exec_argv(profile_from(tmp_path, BASE, {"serve": {}}))
    assert not {s.flag for s in settings.PROFILE_SETTINGS} & set(unset)
    argv = exec_argv(profile_from(tmp_path, BASE, {"serve": {"max_running": 16, "prefix_cache": False,
                                                              "chat_template_kwargs": {"b": 1, "a": True}}}))
    assert argv[argv.index("--max-running") + 1] == "16"   # the default, but the profile says so: spelt out
    assert "--no-prefix-cache" in argv and argv[argv.index("--chat-template-kwargs") + 1] == '{"a": true, "b": 1}'


FAKE = '''    Setting("fake_knob", int, 7, "a knob only this test declares", minimum=2, maximum=9, engine=True,
            profile=True, metavar="K"),
'''
CHECK = """
import json, sys
from pathlib import Path
from ddtree_runtime.server.cli import build_parser, config_from_args
from ddtree_runtime.engine import EngineConfig
from ddops.errors import ConfigError
from ddops.profile import load_profile
from ddops.steps.unit import exec_argv
root, model = Path(sys.argv[1]), sys.argv[2]
out = {"help": build_parser().format_help(), "engine_default": EngineConfig("t", "d").fake_knob}
config = config_from_args(build_parser().parse_args(["--target", model, "--draft", model, "--fake-knob", "8"]), {})
out["server"], out["engine_kwarg"] = config.fake_knob, config.engine_kwargs()["fake_knob"]
base = (root / "playbooks" / "lab-ddtree16.yaml").read_text()
for value in (9, 10):
    path = root / f"p{value}.yaml"
    path.write_text(base.replace("serve:\\n", f"serve:\\n  fake_knob: {value}\\n"))
    try:
        out[str(value)] = exec_argv(load_profile(path, repo_root=root))
    except ConfigError as exc:
        out[str(value)] = exc.line()
print(json.dumps(out))
"""


def test_a_new_declaration_shows_up_everywhere(tmp_path):
    """One Setting(...) added to the table (in a copy of the repo): a flag with its help and default, a
    field of both configs handed to the engine, a profile key with the same bounds, a flag in the unit."""
    for part in ("ddops", "templates", "playbooks", "runtime/ddtree_runtime"):
        shutil.copytree(REPO / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "runtime" / "pyproject.toml", tmp_path / "runtime" / "pyproject.toml")
    table = tmp_path / "runtime" / "ddtree_runtime" / "settings.py"
    anchor = '    Setting("max_queue",'
    table.write_text(table.read_text().replace(anchor, FAKE + anchor))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    env = {"PYTHONPATH": f"{tmp_path}:{tmp_path / 'runtime'}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path), str(tmp_path / "m")], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "--fake-knob K" in out["help"] and "a knob only this test declares (default: 7)" in out["help"]
    assert (out["engine_default"], out["server"], out["engine_kwarg"]) == (7, 8, 8)
    assert out["9"][out["9"].index("--fake-knob") + 1] == "9"
    assert "`serve.fake_knob` must be between 2 and 9, got 10" in out["10"]


def test_the_readme_lists_every_profile_setting_with_its_flag_and_default():
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `")}
    for s in settings.PROFILE_SETTINGS:
        flag, default = rows[f"`{s.name}`"][:2]
        assert flag.startswith(f"`{s.flag}`"), s.name
        if s.type in (int, float) and s.default is not None:
            assert default == f"{s.default:g}", s.name


def test_without_block_size_the_drafters_is_taken_everywhere(tmp_path):
    """The runtime's default for the block size is the drafter's; ddops neither passes nor expects another."""
    from ddops.facts import Tree
    from ddops.gates.health import serving_shape
    from ddops.preflight import check_models

    profile = profile_from(tmp_path, BASE, {"serve": {"mode": "ddtree"}})
    assert profile.serve.block_size is None and "--block-size" not in exec_argv(profile)
    assert serving_shape(profile) == {"mode": "ddtree"}
    target = Tree(exists=True, config={"model_type": "qwen3", "num_hidden_layers": 4})
    draft = Tree(exists=True, config={"block_size": 8, "num_target_layers": 4, "num_hidden_layers": 2,
                                      "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2]}})
    assert check_models(profile, {"target": target, "draft": draft}) == []
    sixteen = profile_from(tmp_path, BASE)
    assert serving_shape(sixteen) == {"block_size": 16, "mode": "ddtree"}
    assert any("smaller than the profile's 16" in p for p in check_models(sixteen, {"target": target, "draft": draft}))

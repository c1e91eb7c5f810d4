"""The profile's chat-API settings (issue 18): serve.tool_call_parser, serve.reasoning_parser and
serve.chat_template_kwargs reach ddtree-serve's command line, checked, and escaped for systemd."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_render_safety import BASE, PAYLOADS, baseline, check_unit, profile_from

from ddops.errors import ConfigError
from ddops.profile import load_profile, resolve_profile
from ddops.steps.unit import exec_argv

REPO = Path(__file__).resolve().parents[2]


def test_zlab_serves_the_sglang_services_parsers_with_thinking_off():
    profile = load_profile(resolve_profile("zlab-ddtree16", REPO / "playbooks"), repo_root=REPO)
    argv = exec_argv(profile)
    flags = dict(zip(argv[::1], argv[1::1]))
    assert flags["--tool-call-parser"] == "qwen3_coder" and flags["--reasoning-parser"] == "qwen3"
    assert json.loads(flags["--chat-template-kwargs"]) == {"enable_thinking": False}


def test_unset_settings_leave_the_runtimes_defaults(tmp_path):
    argv = exec_argv(profile_from(tmp_path, BASE))
    assert not {"--tool-call-parser", "--reasoning-parser", "--chat-template-kwargs"} & set(argv)


@pytest.mark.parametrize("changes, message", [
    ({"serve.tool_call_parser": "mistral"}, "tool_call_parser"),
    ({"serve.reasoning_parser": "deepseek_r1"}, "reasoning_parser"),
    ({"serve.chat_template_kwargs": {"enable_thinking": [1]}}, "must be a string, number or bool"),
    ({"serve.chat_template_kwargs": {"bad-name": True}}, "invalid chat template variable name"),
    ({"serve.chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
])
def test_bad_settings_are_refused_at_load(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        profile_from(tmp_path, BASE, changes)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_template_values_are_escaped_and_round_trip(tmp_path, payload):
    profile = profile_from(tmp_path, BASE, {"serve.chat_template_kwargs": {"system_hint": payload}})
    check_unit(profile, baseline(tmp_path, BASE))
    value = exec_argv(profile)[exec_argv(profile).index("--chat-template-kwargs") + 1]
    assert json.loads(value) == {"system_hint": payload}

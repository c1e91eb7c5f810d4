"""No profile value can add a line to the rendered unit or env file (issue 12, item 7).

Every field that reaches templates/*.j2 or the EnvironmentFile is either refused at load (one line,
`file:line`) or escaped for its file. The rendered files are read back the way systemd reads them:
lines end at \\n, \\r or NUL, a trailing backslash continues a line; ExecStart= words are unquoted and
C-unescaped, then `%%` and `$$` undone; env-file values follow systemd's quoting. A payload passes
when the unit has exactly the directives of a plain render and every value comes back byte-exact.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ddops.errors import ConfigError
from ddops.profile import load_profile
from ddops.steps.unit import env_lines, exec_argv, render

REPO = Path(__file__).resolve().parents[2]

BASE = {
    "name": "safe", "host": "ct200", "unit": "ddtree.service", "port": 8200, "device": "cpu",
    "models": {"target": {"path": "/root/models/t"}, "draft": {"path": "/root/models/d"}},
    "runtime": {"venv": "/opt/ddtree/venv"},
    "serve": {"mode": "ddtree", "block_size": 16, "tree_budget": 16},
    "smoke": {"prompts": [{"prompt": "hi", "expect": "."}]},
}
SGLANG = {**BASE, "name": "sg", "engine": "sglang", "unit": "sglang-dflash.service", "smoke":
          {"prompts": [{"prompt": "hi", "expect": "."}], "lossless_check": False},
          "sglang": {"python": "/opt/sglang/venv/bin/python", "num_draft_tokens": 8}}
# Each would add a directive, split a word or expand to something else if written raw.
PAYLOADS = [
    "x\nExecStartPre=/bin/touch /tmp/pwned",
    "x\rExecStartPre=/bin/touch /tmp/pwned",
    "trailing newline\n",
    "word\n",
    "ends in a backslash\\",
    'quotes " and \' and \\" mixed',
    "specifiers %n %% %h %",
    "variables $HOME ${HOME} $$ $",
    ";",
    "tab\there, DEL\x7f, bell\x07, line separator\u2028, NEL\x85",
    "; touch /tmp/pwned; `touch /tmp/pwned` $(touch /tmp/pwned)",
]
# One-line payloads: what a path or env value may hold (control characters are refused there).
ONE_LINE = [p for p in PAYLOADS if not re.search("[\x00-\x1f\x7f\x85\u2028\u2029]", p)]


def profile_from(tmp_path: Path, doc: dict, changes: dict | None = None):
    doc = yaml.safe_load(yaml.safe_dump(doc))  # a deep copy
    for dotted, value in (changes or {}).items():
        *parents, last = dotted.split(".")
        node = doc
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=False))
    return load_profile(path, repo_root=REPO)


def systemd_lines(text: str) -> list[str]:
    """The unit's logical lines as systemd's parser sees them (continuations joined, comments dropped)."""
    out, pending = [], ""
    for raw in re.split(r"\r\n|[\n\r\0]", text):
        if not pending and raw.lstrip().startswith(("#", ";")):
            continue
        if raw.endswith("\\"):
            pending += raw[:-1] + " "
            continue
        line, pending = (pending + raw).strip(), ""
        if line:
            out.append(line)
    assert not pending, "the file ends inside a continued line"
    return out


def directives(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of every directive; any other line fails the test."""
    section, out = None, []
    for line in systemd_lines(text):
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key.strip()) and section, f"not a directive: {line!r}"
        out.append((section, key.strip(), value.strip()))
    return out


_UNESCAPE = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "'": "'", "a": "\a", "b": "\b",
             "f": "\f", "v": "\v", "s": " "}


def exec_words(value: str) -> list[str]:
    """ExecStart= value -> argv: systemd's word splitting, quotes, C escapes, then specifiers and `$$`."""
    words, i = [], 0
    while i < len(value):
        if value[i] == " ":
            i += 1
            continue
        word, quote = "", None
        while i < len(value) and (quote or value[i] != " "):
            c = value[i]
            if c == "\\":
                nxt = value[i + 1]
                if nxt in "xu":
                    digits = 2 if nxt == "x" else 4
                    word, i = word + chr(int(value[i + 2:i + 2 + digits], 16)), i + 2 + digits
                    continue
                word, i = word + _UNESCAPE[nxt], i + 2
                continue
            if quote and c == quote:
                quote = None
            elif not quote and c in "\"'":
                quote = c
            else:
                word += c
            i += 1
        assert quote is None, f"unbalanced quoting in {value!r}"
        assert not re.search(r"%[^%]", word.replace("%%", "")), f"a specifier would expand in {word!r}"
        assert not re.search(r"\$[^$]|\$$", word.replace("$$", "")), f"a variable would expand in {word!r}"
        words.append(word.replace("%%", "%").replace("$$", "$"))
    return words


def env_file(text: str) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reader takes them: double quotes (backslash escapes
    only `"\\`$`, a line break inside belongs to the value), single quotes, trailing blanks trimmed."""
    out, i = {}, 0
    while i < len(text):
        if text[i] in "\n\r":
            i += 1
            continue
        if text[i] in "#;":
            while i < len(text) and text[i] not in "\n\r":
                i += 1
            continue
        eq = text.index("=", i)
        key, i, value, kept = text[i:eq].strip(), eq + 1, "", 0  # kept: what quotes protect from trimming
        while i < len(text) and text[i] not in "\n\r":
            c = text[i]
            if c == '"':
                i += 1
                while text[i] != '"':
                    if text[i] == "\\" and text[i + 1] in '"\\`$':
                        i += 1
                    elif text[i] == "\\" and text[i + 1] == "\n":
                        i += 2
                        continue
                    value += text[i]
                    i += 1
                kept = len(value)
            elif c == "'":
                end = text.index("'", i + 1)
                value, i = value + text[i + 1:end], end
                kept = len(value)
            elif c == "\\":
                i += 1
                value += text[i]
            else:
                value += c
            i += 1
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"not a variable name: {key!r}"
        out[key] = value[:kept] + value[kept:].rstrip()
    return out


def baseline(tmp_path: Path, doc: dict) -> list[tuple[str, str]]:
    return [(s, k) for s, k, _ in directives(render(profile_from(tmp_path, doc), {}).unit_text)]


def check_unit(profile, plain: list[tuple[str, str]]) -> None:
    found = directives(render(profile, {"DDTREE_API_KEY": "k"}).unit_text)
    assert [(s, k) for s, k, _ in found] == plain
    exec_start = next(v for s, k, v in found if k == "ExecStart")
    assert exec_words(exec_start) == exec_argv(profile)


EXEC_FIELDS = [  # (document, dotted key, how the payload is put there)
    (BASE, "serve.served_model_name", lambda p: p),
    (BASE, "serve.extra_args", lambda p: ["--x", p, "--y"]),
    (SGLANG, "serve.served_model_name", lambda p: p),
    (SGLANG, "sglang.extra_args", lambda p: [p]),
]


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("doc,key,put", EXEC_FIELDS, ids=[f"{d['name']}:{k}" for d, k, _ in EXEC_FIELDS])
def test_exec_arguments_are_escaped_and_round_trip(tmp_path, doc, key, put, payload):
    check_unit(profile_from(tmp_path, doc, {key: put(payload)}), baseline(tmp_path, doc))


PATH_FIELDS = [(BASE, "models.target.path"), (BASE, "models.draft.path"), (SGLANG, "models.target.path"),
               (SGLANG, "models.draft.path")]


@pytest.mark.parametrize("payload", ONE_LINE)
@pytest.mark.parametrize("doc,key", PATH_FIELDS, ids=[f"{d['name']}:{k}" for d, k in PATH_FIELDS])
def test_model_paths_are_escaped_and_round_trip(tmp_path, doc, key, payload):
    check_unit(profile_from(tmp_path, doc, {key: f"/root/models/{payload}"}), baseline(tmp_path, doc))


@pytest.mark.parametrize("payload", [p for p in ONE_LINE if not re.search("[$\"'\\\\]", p)])
@pytest.mark.parametrize("doc,key", [(BASE, "runtime.venv"), (SGLANG, "sglang.python")])
def test_executable_paths_round_trip(tmp_path, doc, key, payload):
    check_unit(profile_from(tmp_path, doc, {key: f"/opt/{payload}/x"}), baseline(tmp_path, doc))


def test_every_other_unit_value_is_plain(tmp_path):
    """bind, port, device, dtype, mode, block size, budget, gpus, unit (-> env file path), name."""
    profile = profile_from(tmp_path, BASE, {"bind": "::1", "device": "cuda:1", "dtype": "float16",
                                            "serve.mode": "dflash", "gpus": [0, 3], "name": "a.b+c@d-e_f",
                                            "unit": "ddtree@a:b.service", "conflicts": ["x@y.service"]})
    check_unit(profile, baseline(tmp_path, BASE))
    assert ("Unit", "Description", "DDTree speculative-decoding runtime (a.b+c@d-e_f)") in directives(
        render(profile, {}).unit_text)


@pytest.mark.parametrize("payload", ONE_LINE)
def test_env_values_round_trip(tmp_path, payload):
    profile = profile_from(tmp_path, BASE, {"env": {"A": payload, "B": 3, "C": "plain"}})
    values = env_file(env_lines(profile, {}, masked=False))
    assert values["A"] == payload and values["B"] == "3" and values["C"] == "plain"
    assert list(values) == ["PYTHONUNBUFFERED", "HF_HUB_OFFLINE", "HF_HOME", "TRITON_CACHE_DIR",
                            "TRITON_CACHE_AUTOTUNING", "TORCHINDUCTOR_CACHE_DIR", "A", "B", "C"]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_secret_values_from_the_environment_cannot_add_a_line(tmp_path, payload):
    """Secrets come from the control machine's environment at pivot time: any byte but NUL."""
    profile = profile_from(tmp_path, BASE, {"bind": "0.0.0.0", "secrets": {"DDTREE_API_KEY": {"env": "K"}}})
    text = env_lines(profile, {"DDTREE_API_KEY": payload}, masked=False)
    assert env_file(text) == {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": "/var/cache/ddtree/hf",
                              "TRITON_CACHE_DIR": "/var/cache/ddtree/triton", "TRITON_CACHE_AUTOTUNING": "1",
                              "TORCHINDUCTOR_CACHE_DIR": "/var/cache/ddtree/inductor", "DDTREE_API_KEY": payload}
    assert env_lines(profile, {"DDTREE_API_KEY": payload}, masked=True).endswith("DDTREE_API_KEY=***\n")


REFUSED = [  # (dotted key, value, message): values that cannot be made safe are refused at load
    ("name", "x\nExecStartPre=/bin/touch /tmp/pwned", "profile name"),
    ("name", "x\r[Service]", "profile name"),
    ("name", "100%n", "profile name"),
    ("name", "two words", "profile name"),
    ("description", "x\nExecStartPre=/bin/true", "line break or control character"),
    ("unit", "ddtree.service\n", "invalid systemd service name"),
    ("unit", "x.service\nExecStartPre=/bin/true\ny.service", "invalid systemd service name"),
    ("conflicts", ["sglang.service\n"], "invalid systemd service name"),
    ("bind", "127.0.0.1\nExecStartPre=/bin/true", "IP address or a host name"),
    ("bind", "0.0.0.0 --insecure-no-auth", "IP address or a host name"),
    ("device", "cpu\n", "cpu, cuda or cuda:N"),
    ("dtype", "float32\n", "must be one of"),
    ("serve.mode", "ar\n", "must be one of"),
    ("env", {"X\n": "1"}, "invalid environment variable name"),
    ("env", {"X": "a\rB=2"}, "contains a newline or control character"),
    ("env", {"X": "tab\there"}, "contains a newline or control character"),
    ("env", {"X": "nul\0"}, "contains a newline or control character"),
    ("secrets", {"K\n": {"env": "K"}}, "invalid environment variable name"),
    ("secrets", {"K": {"env": "K\n"}}, "invalid environment variable name"),
    ("runtime.venv", "/opt/venv\nExecStartPre=/bin/true", "newline or control character"),
    ("runtime.venv", "/opt/$HOME/venv", "systemd cannot take"),
    ("runtime.venv", '/opt/"v"/venv', "systemd cannot take"),
    ("models.target.path", "/root/models/t\rExecStartPre=/bin/true", "newline or control character"),
    ("models.draft.path", "/root/models/d\0", "NUL byte"),
    ("serve.served_model_name", "tiny\0", "NUL byte"),
    ("serve.extra_args", ["--x", "a\0b"], "NUL byte"),
    ("health.path", "/health\r\nHost: evil", "must be a URL path"),
]


@pytest.mark.parametrize("key,value,message", REFUSED, ids=[f"{k}:{v!r}"[:40] for k, v, _ in REFUSED])
def test_unsafe_values_are_refused_at_load(tmp_path, key, value, message):
    with pytest.raises(ConfigError) as err:
        profile_from(tmp_path, BASE, {key: value})
    line = err.value.line()
    assert message in line and f"{tmp_path / 'p.yaml'}:" in line and not re.search("[\n\r\0]", line), line


def test_sglang_python_refused_when_systemd_cannot_run_it(tmp_path):
    with pytest.raises(ConfigError, match="systemd cannot take"):
        profile_from(tmp_path, SGLANG, {"sglang.python": "/opt/$x/python"})


def test_a_template_field_with_a_line_break_is_refused_at_render(tmp_path, monkeypatch):
    """Templates are data: a field added to one later cannot inject either."""
    (tmp_path / "ddtree.service.j2").write_text("[Service]\nExecStart={{ exec_start }}\n"
                                                "# {{ profile.smoke.prompts[0].prompt }}\n")
    monkeypatch.setenv("DDOPS_TEMPLATES", str(tmp_path))
    profile = profile_from(tmp_path, BASE, {"smoke.prompts": [{"prompt": "hi\nExecStartPre=/bin/true",
                                                                "expect": "."}]})
    with pytest.raises(ConfigError, match="would write a line break"):
        render(profile, {})


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
@pytest.mark.parametrize("doc", [BASE, SGLANG], ids=["ddtree", "sglang"])
def test_systemd_itself_reads_the_hostile_unit_cleanly(tmp_path, doc):
    """systemd's own parser: no unknown key, no bad quoting, nothing ignored; the one complaint is that
    the executable does not exist here, and it names that path exactly as ddops meant it."""
    executable = "/opt/a b %n %% %h % ; x"
    profile = profile_from(tmp_path, doc, {"serve.served_model_name": "".join(PAYLOADS),
                                           "models.target.path": "/root/models/" + "".join(ONE_LINE),
                                           "unit": "safe-test.service", "runtime.venv": executable,
                                           **({"sglang.python": executable} if "sglang" in doc else {})})
    unit = tmp_path / "safe-test.service"
    unit.write_text(render(profile, {}).unit_text)
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True,
                          timeout=60)
    problems = [line for line in (done.stdout + done.stderr).splitlines()
                if line.strip() and "is not executable" not in line and "has a bad unit file setting" not in line
                and "fatal error" not in line]
    assert problems == [], done.stderr
    assert f"Command {exec_argv(profile)[0]} is not executable" in done.stdout + done.stderr, done.stderr

"""Inventory validation: every malformed inventory is one located line; good ones load as written."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ddops.errors import ConfigError, UsageError
from ddops.inventory import load_inventory

REPO = Path(__file__).resolve().parents[2]

GOOD = """\
defaults:
  user: root
  connect_timeout: 5
hosts:
  node:
    address: 10.0.0.1
  ct:
    via: node
    pct: 200
    roles: [training]
    expect: {hostname: ct200, gpu_model: RTX PRO 6000, gpu_count: 8}
    training: {pattern: train.py, log: /root/train.log}
  box:
    address: box.example
    port: 2222
    via: node
    services: [sglang-qwen.service, {unit: ddtree.service, port: 8000}]
groups:
  gpu: [ct, box]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inv.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_good_inventory_loads_with_defaults_and_groups(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, GOOD))
    assert list(inv.hosts) == ["node", "ct", "box"]
    ct = inv.hosts["ct"]
    assert (ct.user, ct.pct, ct.via, ct.connect_timeout) == ("root", 200, "node", 5.0)
    assert ct.expect.gpu_count == 8 and ct.training.pattern == "train.py"
    box = inv.hosts["box"]
    assert [s.unit for s in box.services] == ["sglang-qwen.service", "ddtree.service"]
    assert box.services[1].health == "/health" and box.services[0].port is None
    assert [h.name for h in inv.select("gpu,node")] == ["ct", "box", "node"]
    assert [h.name for h in inv.select("training")] == ["ct"]  # role groups come for free
    assert [h.name for h in inv.chain(box)] == ["node"]


def test_shipped_inventories_load() -> None:
    for name in ("lab.yaml", "fleet.yaml"):
        inv = load_inventory(REPO / "inventories" / name)
        assert "ct200" in inv.hosts and inv.hosts["ct200"].pct == 200


def test_unknown_limit_is_a_usage_error(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, GOOD))
    with pytest.raises(UsageError, match="no host or group named 'nope'"):
        inv.select("ct,nope")


# (inventory text, substring of the message, line number it must name)
BAD = [
    ("hosts: [a, b\n", "invalid YAML", 2),
    ("hosts:\n  a:\n    address: x\n   port: 2\n", "invalid YAML", 4),
    ("- a\n- b\n", "must be a YAML mapping", 1),
    ("", "must be a YAML mapping", 1),
    ("defaults: {}\n", "missing required key `hosts`", 1),
    ("hosts: {}\n", "defines no hosts", 1),
    ("hostz:\n  a: {address: x}\n", "did you mean `hosts`", 1),
    ("hosts:\n  a:\n    adress: x\n", "did you mean `address`", 3),
    ("hosts:\n  a:\n    address: x\n    expect: {gpu_modle: A6000}\n", "did you mean `gpu_model`", 4),
    ("hosts:\n  a:\n    roles: [eval]\n", "has no `address`", 2),
    ("hosts:\n  a:\n    address: x\n  a:\n    address: y\n", "duplicate key 'a'", 4),
    ("hosts:\n  a:\n    address: x\n    port: 70000\n", "between 1 and 65535", 4),
    ("hosts:\n  a:\n    address: x\n    port: '22'\n", "must be an integer", 4),
    ("hosts:\n  a:\n    address: x\n    port: true\n", "must be an integer", 4),
    ("hosts:\n  a:\n    address: [x]\n", "must be a string", 3),
    ("hosts:\n  a:\n    address: x\n    via: b\n", "unknown host 'b'", 4),
    ("hosts:\n  a: {address: x, via: b}\n  b: {address: y, via: a}\n", "`via` loop", 2),
    ("hosts:\n  a: {address: x, via: a}\n", "`via` loop: a -> a", 2),
    ("hosts:\n  a:\n    pct: 200\n", "has `pct: 200` but no `via`", 3),
    ("hosts:\n  a:\n    address: x\n    pct: 5\n    via: a\n", "between 100 and", 4),
    ("hosts:\n  a:\n    address: x\n    roles: [trainer]\n", "unknown role 'trainer'", 4),
    ("hosts:\n  a:\n    address: x\n    roles: training\n", "must be a list", 4),
    ("hosts:\n  a:\n    address: x\n    connect_timeout: -1\n", "between 0.1 and 3600", 4),
    ("hosts:\n  a:\n    address: x\n    command_timeout: 1e9\n", "must be", 4),
    ("hosts:\n  a:\n    address: x\n    key: id_rsa\n", "must be an absolute path", 4),
    ("hosts:\n  a:\n    address: x\n    python: venv/bin/python\n", "must be an absolute path", 4),
    ("hosts:\n  a:\n    address: x\n    training: {log: /x}\n", "needs a `pattern` or a `unit`", 4),
    ("hosts:\n  a:\n    address: x\n    training: {pattern: t, log: rel.log}\n", "absolute path", 4),
    ("hosts:\n  a:\n    address: x\n    services: [bad unit]\n", "invalid systemd unit name", 4),
    ("hosts:\n  a:\n    address: x\n    services: [{unit: a.service, port: 0}]\n", "between 1 and 65535", 4),
    ("hosts:\n  a:\n    address: x\n    services: [{unit: a.service, health: health}]\n", "URL path", 4),
    ("hosts:\n  a:\n    address: x\n    services: [{unit: a.service, prot: 1}]\n", "did you mean `port`", 4),
    ("hosts:\n  a:\n    address: x\n    expect: {gpu_count: many}\n", "must be an integer", 4),
    ("hosts:\n  a:\n    address: x\n    host_key_policy: yolo\n", "must be one of strict, accept-new", 4),
    ("hosts:\n  a:\n    address: '-oProxyCommand=x'\n", "invalid address", 3),
    ("hosts:\n  a:\n    address: ''\n", "must not be empty", 3),
    ("hosts:\n  'a b':\n    address: x\n", "invalid host name", 2),
    ("hosts:\n  a: {address: x}\ngroups:\n  g: [a, z]\n", "unknown host 'z'", 4),
    ("hosts:\n  a: {address: x}\ngroups:\n  a: [a]\n", "same name as a host", 4),
    ("defaults:\n  usr: root\nhosts:\n  a: {address: x}\n", "did you mean `user`", 2),
    ("hosts:\n  a: x\n", "must be a mapping", 2),
    ("hosts:\n  a:\n    address: x\x07y\n", "control character '\\x07'", 3),   # BEL: YAML's reader refuses it
    ("hosts:\n  a:\n    address: x\n    user: r\x00\n", "control character '\\x00'", 4),
]


@pytest.mark.parametrize("text,message,line", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_inventory_is_one_located_error(tmp_path: Path, text: str, message: str, line: int) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_inventory(path)
    rendered = err.value.line()
    assert message in rendered
    assert rendered.startswith(f"{path}:{line}:"), rendered
    assert "\n" not in rendered


@pytest.mark.parametrize("text,message,line", BAD[:6] + BAD[15:17] + BAD[-2:], ids=lambda v: str(v)[:20])
def test_cli_reports_bad_inventory_in_one_line_exit_2(tmp_path: Path, text: str, message: str, line: int) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(text)
    done = subprocess.run([sys.executable, "-m", "ddops", "-i", str(path), "status"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = [l for l in done.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and message in lines[0], done.stderr

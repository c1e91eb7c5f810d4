"""Remote command building: argv is quoted once for SSH and once more for `pct exec`; nasty values stay literal."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ddops.executor import remote_command
from ddops.inventory import Host

NASTY = ["; rm -rf /tmp/x", "$(touch /tmp/pwned)", "`id`", "it's \"quoted\"", "new\nline", "*", "$HOME", "-n"]


def test_direct_host_command_is_shlex_joined() -> None:
    host = Host(name="a", address="10.0.0.1")
    assert remote_command(host, ["systemctl", "show", "x y.service"]) == "systemctl show 'x y.service'"


def test_pct_host_is_wrapped_in_pct_exec() -> None:
    host = Host(name="ct", address=None, via="pve", pct=200)
    assert remote_command(host, ["hostname"]) == "pct exec 200 -- bash -lc hostname"
    assert remote_command(host, ["echo", "a b"]).startswith("pct exec 200 -- bash -lc ")


@pytest.mark.parametrize("pct", [None, 200])
def test_nasty_arguments_arrive_literally(tmp_path: Path, pct: int | None) -> None:
    """Run the built command through a real shell (as sshd does), with a stand-in `pct` that execs."""
    fake_pct = tmp_path / "pct"
    fake_pct.write_text('#!/bin/bash\n[ "$1" = exec ] && [ "$3" = -- ] || exit 99\nshift 3\nexec "$@"\n')
    fake_pct.chmod(0o755)
    host = Host(name="h", address=None if pct else "x", via="n" if pct else None, pct=pct)
    argv = ["python3", "-c", "import json,sys; print(json.dumps(sys.argv[1:]))", *NASTY]
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", remote_command(host, argv)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=30)
    assert done.returncode == 0, done.stderr
    import json

    assert json.loads(done.stdout) == NASTY
    assert not Path("/tmp/pwned").exists()

"""The README's set-up on a stock Debian/Ubuntu machine: the distribution's own python3 first on PATH.

That python3 is externally managed (PEP 668): pip into it is refused, so `scripts/setup.sh` must install
into the project's .venv. The test machines have a pyenv python3 first on PATH, which would hide this,
so the script runs here with PATH cut down to the system's directories, in a fresh clone of this
checkout (its uncommitted changes applied: the script under test is the one here). Lab-class: it needs
root (apt) and takes about a minute and a half, most of it pip installing torch's CPU wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = Path("/usr/bin/python3")
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"

pytestmark = [pytest.mark.lab, pytest.mark.slow]


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "the set-up installs with apt: needs root"
    if not SYSTEM_PYTHON.is_file() or shutil.which("apt-get") is None:
        return "needs a Debian/Ubuntu machine (/usr/bin/python3, apt-get)"
    return None


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 60,
        **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This checkout at HEAD, plus its uncommitted changes to tracked files; removed after (its venv is ~2 GB)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("setup") / "ddops"
    assert run(["git", "clone", "-q", str(REPO), str(out)], cwd=REPO).returncode == 0
    changes = run(["git", "diff", "--binary", "HEAD"], cwd=REPO).stdout
    if changes:
        applied = run(["git", "apply", "--whitespace=nowarn"], cwd=out, input=changes)
        assert applied.returncode == 0, applied.stderr
    yield out
    shutil.rmtree(out, ignore_errors=True)


def system_env() -> dict[str, str]:
    """This environment with the distribution's directories alone on PATH, no venv and no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME") and not k.startswith("PYENV")}
    env["PATH"] = SYSTEM_PATH
    return env


def test_setup_with_the_system_python3_installs_into_the_project_venv(clone: Path) -> None:
    env = system_env()
    assert run(["python3", "-c", "import sys; print(sys.executable)"], clone, env).stdout.strip() == str(SYSTEM_PYTHON)
    # What a first try on a machine without python3-venv leaves behind: a venv without pip.
    assert run(["python3", "-m", "venv", "--without-pip", ".venv"], clone, env).returncode == 0

    first = run(["bash", "scripts/setup.sh"], clone, env, timeout=1200)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]

    venv = clone / ".venv" / "bin"
    version = run([str(venv / "ddops"), "--version"], clone, env)
    assert version.returncode == 0 and version.stdout.startswith("ddops, version "), version.stderr
    serve = run([str(venv / "ddtree-serve"), "--help"], clone, env)
    assert serve.returncode == 0 and "--target" in serve.stdout, serve.stderr
    where = run([str(venv / "python"), "-c", "import sys, ddops, ddtree_runtime; "
                 "print(sys.base_prefix, ddops.__file__, ddtree_runtime.__file__)"], clone, env)
    base_prefix, ddops_file, runtime_file = where.stdout.split()
    assert base_prefix == "/usr"  # the system interpreter's venv...
    assert Path(ddops_file).is_relative_to(clone) and Path(runtime_file).is_relative_to(clone)  # ...editable
    assert run(["python3", "-I", "-c", "import ddops"], clone, env).returncode != 0  # the system python untouched

    again = run(["bash", "scripts/setup.sh"], clone, env, timeout=120)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [
        f"--> ready: .venv is up to date ({version.stdout.strip()}); put it on PATH with: . .venv/bin/activate"]
    assert again.stderr == ""

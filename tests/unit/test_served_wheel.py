"""The wheel ddops ships to serving hosts holds the runtime and nothing test-only (issue 14): no tiny
model builder, no subprocess harness, no fault switch, and the release id ignores the devtools."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from ddops.release import source_digest

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"


def test_the_served_wheel_has_no_development_tools(tmp_path):
    # build from a copy: an in-tree build would leave build/ and egg-info behind
    src = tmp_path / "runtime"
    shutil.copytree(RUNTIME, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "devtools"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "out"), str(src)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    [wheel] = (tmp_path / "out").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    modules = [n for n in names if n.endswith(".py")]
    assert "ddtree_runtime/server/app.py" in modules and "ddtree_runtime/engine/engine.py" in modules
    assert not [n for n in names if "tiny" in n or "testing" in n or "devtools" in n], names
    text = b"".join(zipfile.ZipFile(wheel).read(n) for n in modules)
    for test_only in (b"/_test/fault", b"DDTREE_TEST_", b"kill_worker"):
        assert test_only not in text, test_only
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "ddtree-tiny" not in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_release_id_ignores_devtools(tmp_path):
    src = tmp_path / "runtime"
    shutil.copytree(RUNTIME, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    before = source_digest(str(src))
    (src / "devtools" / "ddtree_devtools" / "faults.py").write_text("# changed\n")
    assert source_digest(str(src)) == before
    (src / "ddtree_runtime" / "server" / "worker.py").write_text("# changed\n")
    assert source_digest(str(src)) != before


def test_a_cached_wheel_cut_short_is_built_again(tmp_path, monkeypatch):
    """A `pip wheel` killed while it wrote leaves part of a wheel in the cache: shipping it would fail on
    every host, so the cache keeps only wheels that read back whole."""
    from ddops.release import build_wheel, release_id, whole

    monkeypatch.setenv("DDOPS_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "runtime"
    shutil.copytree(RUNTIME, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "devtools"))
    release = release_id(str(src))
    wheel = build_wheel(str(src), release)
    good = wheel.read_bytes()
    wheel.write_bytes(good[: len(good) // 2])
    assert not whole(wheel)
    again = build_wheel(str(src), release)
    assert whole(again) and again.read_bytes()[:4] == b"PK\x03\x04" and len(again.read_bytes()) == len(good)

"""The runtime's release: an id from its version and a hash of its sources, and its wheel, built here
once per release (cached under the control machine's cache)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from .errors import StepFailed
from .paths import cache_root


def source_digest(package_dir: str) -> str:
    root = Path(package_dir)
    h = hashlib.sha256()
    # What goes into the wheel: the package's modules and the build metadata (not bench output or devtools).
    files = sorted([p for p in root.rglob("*.py") if "__pycache__" not in p.parts and "egg-info" not in str(p)
                    and not p.relative_to(root).parts[0] in ("bench", "tests", "build", "devtools")]
                   + [root / "pyproject.toml"])
    for p in files:
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def release_id(package_dir: str) -> str:
    text = (Path(package_dir) / "pyproject.toml").read_text()
    version = next((line.split("=", 1)[1].strip().strip('"') for line in text.splitlines()
                    if line.strip().startswith("version")), "0")
    return f"{version}+{source_digest(package_dir)[:12]}"


def build_wheel(package_dir: str, release: str) -> Path:
    out = cache_root() / "releases" / release
    wheels = list(out.glob("*.whl")) if out.is_dir() else []
    if wheels and whole(wheels[0]):
        return wheels[0]
    for stale in wheels:    # a build killed while it wrote: built again
        stale.unlink()
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), package_dir], capture_output=True, text=True, timeout=600)
    wheels = list(out.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise StepFailed(f"building the runtime wheel failed: {done.stderr.strip()[-300:]}")
    return wheels[0]


def whole(wheel: Path) -> bool:
    """Whether a cached wheel reads back whole (every member's CRC)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.testzip() is None
    except (zipfile.BadZipFile, OSError):
        return False

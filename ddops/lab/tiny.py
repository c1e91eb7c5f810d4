"""The tiny model pairs the lab serves and the tests load, shipped as versioned fixtures.

Training them takes minutes of CPU, and a fresh build differs a little whenever the recipe or torch
changes (a smoke prompt once broke that way). So a build is committed under `fixtures/` with a
MANIFEST.json (version, recipe digest, sha256 of every file), and every user copies that exact pair
into `$DDOPS_CACHE/NAME`, where the lab profiles look for it. `scripts/build_tiny_fixtures.py`
regenerates the fixtures.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from ..paths import cache_root
from .errors import LabError

QWEN3, HYBRID = "tiny-models-seed0", "tiny-hybrid-seed0"
MANIFEST = "MANIFEST.json"
# the lab's eval host holds the Qwen3 drafter where lab-ddtree16 syncs it from
DRAFT_HOST, DRAFT_DIR = "eval-a6000", "tiny-draft"


def fixtures_dir() -> Path:
    """DDOPS_FIXTURES, else `fixtures/` of the checkout ddops runs from."""
    return Path(os.environ.get("DDOPS_FIXTURES") or Path(__file__).resolve().parents[2] / "fixtures")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files_under(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under root but the manifest itself."""
    return {str(p.relative_to(root)): sha256(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def read_manifest(root: Path) -> dict | None:
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def matches(root: Path, manifest: dict) -> bool:
    """True when root holds exactly the manifest's files, byte for byte."""
    return read_manifest(root) == manifest and files_under(root) == manifest["files"]


def install(name: str, progress: Callable[[str], None] = lambda line: None) -> Path:
    """`$DDOPS_CACHE/name`, made an exact copy of the committed fixture (a few MB, well under a second)."""
    source, out = fixtures_dir() / name, cache_root() / name
    manifest = read_manifest(source)
    if manifest is None:
        raise LabError(f"the tiny model fixture {source} is missing (no {MANIFEST})",
                       fix="run ddops from its git checkout, or set DDOPS_FIXTURES to its fixtures/ dir")
    if files_under(source) != manifest["files"]:
        raise LabError(f"the tiny model fixture {source} does not match its {MANIFEST}",
                       fix="restore it with `git checkout -- fixtures`, or rebuild with scripts/build_tiny_fixtures.py")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent test session may be installing the same pair
        if matches(out, manifest):
            return out
        progress(f"installing the tiny models {name} (fixture v{manifest['version']}) into {out}")
        staging = out.with_name(out.name + ".installing")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(source, staging)
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    return out


def provide_lab_models(seed_root: Path, progress: Callable[[str], None] = lambda line: None) -> Path:
    """What the lab profiles read: both pairs in $DDOPS_CACHE, and the Qwen3 drafter in the eval host's
    seed dir (copied into its /root/models at boot), where lab-ddtree16 syncs it from."""
    install(HYBRID, progress)
    draft = install(QWEN3, progress) / "draft"
    dest = seed_root / DRAFT_HOST / DRAFT_DIR
    if dest.is_dir() and files_under(dest) == files_under(draft):
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(draft, dest)
    return dest


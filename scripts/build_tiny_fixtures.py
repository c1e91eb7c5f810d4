#!/usr/bin/env python3
"""Regenerate fixtures/tiny-*-seed0: the tiny model pairs every lab pivot and runtime test uses.

    python3 scripts/build_tiny_fixtures.py [--from DIR ...]   # or `make fixtures`

Builds each pair with ddtree-tiny (seed 0; a few minutes of CPU each), or takes an already built
`--from` dir, and writes its MANIFEST.json: the fixture version (one more than before), the digest
of the recipe (ddtree_devtools/tiny.py + tiny_corpus.py), the torch version, and the sha256 of every
file, which ddops checks before it installs the pair. Commit the result; the smoke prompts of the lab
profiles must still pass on it (`make test`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ddops.lab.tiny import HYBRID, MANIFEST, QWEN3, files_under, read_manifest  # noqa: E402

PAIRS = {QWEN3: "qwen3", HYBRID: "qwen3_5"}
SEED = 0


def recipe_digest() -> str:
    """Which recipe made the pair (recorded, so a later rebuild can tell whether it should differ)."""
    from ddtree_devtools import tiny, tiny_corpus

    h = hashlib.sha256()
    for module in (tiny, tiny_corpus):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()[:16]


def build(name: str, built: Path | None) -> None:
    import torch

    dest = REPO / "fixtures" / name
    previous = read_manifest(dest) or {"version": 0}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / name
        if built is None:
            from ddtree_devtools.tiny import build as build_pair

            build_pair(out, SEED, arch=PAIRS[name])
        else:
            shutil.copytree(built, out)
        if not (out / ".complete").is_file():
            raise SystemExit(f"{built or out} is not a complete ddtree-tiny build (no .complete)")
        for path in out.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        (out / MANIFEST).unlink(missing_ok=True)
        manifest = {"version": previous["version"] + 1, "name": name, "arch": PAIRS[name], "seed": SEED,
                    "recipe_sha256": recipe_digest(), "torch": torch.__version__.split("+")[0],
                    "files": files_under(out)}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(out, dest)
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"{dest}: version {manifest['version']}, {len(manifest['files'])} files, {size / 2**20:.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="built", type=Path, nargs="*", default=[],
                    help="already built dirs named like the fixtures (e.g. ~/.cache/ddops/tiny-models-seed0)")
    args = ap.parse_args()
    given = {p.name: p for p in args.built}
    unknown = sorted(set(given) - set(PAIRS))
    if unknown:
        raise SystemExit(f"--from takes dirs named {' or '.join(PAIRS)}, not {', '.join(unknown)}")
    for name in (given or PAIRS):
        build(name, given.get(name))


if __name__ == "__main__":
    main()

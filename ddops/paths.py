"""Every path ddops uses, in one place: where it keeps state on a host, and its cache here.

Steps, rollback, history and bench all read these; none of them owns a path of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

# -- on the hosts --------------------------------------------------------------------------------
STATE_DIR = "/var/lib/ddops"
LOCK_PATH = f"{STATE_DIR}/pivot.lock"
JOURNAL_PATH = f"{STATE_DIR}/pivot.journal.json"   # an unfinished pivot's intent: what it changes, how to undo it
HISTORY_PATH = f"{STATE_DIR}/history.jsonl"
BACKUP_ROOT = f"{STATE_DIR}/backups"
UNIT_DIR = "/etc/systemd/system"
ENV_DIR = "/etc/ddops"
WHEELHOUSE = "/var/cache/ddops/wheelhouse"   # wheels ddops pushes for an offline pip install
RELEASES = "/var/cache/ddops/releases"       # runtime wheels ddops ships
RELEASE_FILE = "ddtree-release.json"         # next to the venv: which runtime release it holds


def unit_path(unit: str) -> str:
    return f"{UNIT_DIR}/{unit}"


def env_path(unit: str) -> str:
    """The unit's EnvironmentFile (mode 0600: it may hold secrets)."""
    return f"{ENV_DIR}/{unit.removesuffix('.service')}.env"


def backup_root(unit: str) -> str:
    return f"{BACKUP_ROOT}/{unit}"


def release_path(venv: str) -> str:
    return f"{venv}/{RELEASE_FILE}"


def unit_cache(engine: str) -> str:
    """The unit's CacheDirectory= (/var/cache/ENGINE): kept across restarts and pivots."""
    return f"/var/cache/{engine}"


def triton_cache(engine: str) -> str:
    """Where the unit's env points Triton (TRITON_CACHE_DIR), unless the profile's `env` says otherwise."""
    return f"{unit_cache(engine)}/triton"


REPLICAS_DIR = f"{STATE_DIR}/replicas"      # one manifest per template unit: its replicas and balancer


def replicas_manifest(template: str) -> str:
    """What a replicated deployment is (ports, GPUs, balancer): status and rollback read it on the host."""
    return f"{REPLICAS_DIR}/{template.removesuffix('.service')}.json"


# -- on the control machine ----------------------------------------------------------------------

def cache_root() -> Path:
    """$DDOPS_CACHE, else ~/.cache/ddops: tiny models, host-to-host sync staging, built wheels, kernel store."""
    return Path(os.environ.get("DDOPS_CACHE") or os.path.expanduser("~/.cache/ddops"))


def kernel_store_root() -> Path:
    """Triton caches harvested from deployed hosts, one folder per GPU model (ddops.kernels)."""
    return cache_root() / "kernels"

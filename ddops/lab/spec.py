"""What the lab must run: one LabHost per inventory host (plus `--extra` eval hosts)."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from ..inventory import load_inventory
from .errors import LabError

FIXTURES = ("training", "sglang", "models")
EXTRA_PORT_BASE = 2210
EXTRA_GPUS = {"model": "NVIDIA RTX A6000", "count": 2, "memory_mib": 49140}
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


DRIVER, CUDA = "570.133.20", "12.8"   # the lab's GPUs' driver unless a host's `lab.gpus` says otherwise


@dataclass(frozen=True)
class Gpus:
    model: str = "none"
    count: int = 0
    memory_mib: int = 0
    driver_version: str = DRIVER
    cuda_version: str = CUDA


@dataclass(frozen=True)
class LabHost:
    """One container: its name (= hostname), its sshd port and what to put in it."""

    name: str
    port: int
    gpus: Gpus = field(default_factory=Gpus)
    fixtures: tuple[str, ...] = ()
    pct: int | None = None        # this host is container `pct` ...
    via: str | None = None        # ... on this node
    containers: tuple[tuple[int, str, int], ...] = ()  # (vmid, name, port) a node hosts
    extra: bool = False

    def fingerprint(self) -> str:
        """Changes whenever the host must be rebuilt to match its spec."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def gpu_config(self) -> dict:
        """/etc/ddops-lab/gpus.json: stable UUIDs and bus ids derived from the host name."""
        g = self.gpus
        return {
            "hostname": self.name, "model": g.model, "count": g.count, "memory_mib": g.memory_mib,
            "uuids": [f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{self.name}.gpu{i}.ddops-lab')}"
                      for i in range(g.count)],
            "bus_ids": [f"00000000:{0x18 + 0x10 * i:02X}:00.0" for i in range(g.count)],
            "power_limit_w": 600 if g.memory_mib > 60000 else 300,
            "driver_version": g.driver_version, "cuda_version": g.cuda_version, "idle_used_mib": 1,
        }


def _where(path: Path, host: str) -> str:
    return f"{path}: hosts.{host}"


def _lab_host(path: Path, name: str, port: int | None, hostname: str | None, lab: dict | None,
              pct: int | None = None, via: str | None = None) -> LabHost:
    """A LabHost from one inventory host: its `lab:` block, port and expected hostname."""
    if not _NAME.match(name):
        raise LabError(f"host name {name!r} cannot be a lab hostname", where=str(path),
                       fix="use lower-case letters, digits and '-'")
    lab = lab or {}
    if (hostname or name) != name:
        raise LabError(f"expect.hostname {hostname!r} differs from the host name",
                       where=_where(path, name), fix="the lab names each container after its host")
    port = lab.get("port", port)
    if not isinstance(port, int):
        raise LabError("no sshd port for the lab host", where=_where(path, name),
                       fix="set `port:` or `lab: {port: N}`")
    gpus = lab.get("gpus") or {}
    fixtures = tuple(lab.get("fixtures") or ())
    unknown = [f for f in fixtures if f not in FIXTURES]
    if unknown:
        raise LabError(f"unknown lab fixture {unknown[0]!r}", where=_where(path, name),
                       fix=f"choose from {', '.join(FIXTURES)}")
    return LabHost(name=name, port=port,
                   gpus=Gpus(str(gpus.get("model", "none")), int(gpus.get("count", 0)),
                             int(gpus.get("memory_mib", 0)), str(gpus.get("driver_version", DRIVER)),
                             str(gpus.get("cuda_version", CUDA))),
                   fixtures=fixtures, pct=pct, via=via)


def extra_hosts(count: int, taken: set[int]) -> dict[str, dict]:
    """Inventory entries for `--extra N`: eval-01.. with 2x RTX A6000 on ports 2210+."""
    hosts: dict[str, dict] = {}
    port = EXTRA_PORT_BASE
    for i in range(1, count + 1):
        while port in taken:
            port += 1
        name = f"eval-{i:02d}"
        hosts[name] = {"address": "127.0.0.1", "port": port, "roles": ["eval"],
                       "expect": {"hostname": name, "gpu_model": "RTX A6000", "gpu_count": 2},
                       "lab": {"gpus": dict(EXTRA_GPUS)}}
        taken.add(port)
    return hosts


def read_inventory(path: Path, extra: int = 0) -> tuple[dict, list[LabHost]]:
    """The inventory as a dict (with the extra hosts added) and the lab hosts it describes."""
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as err:
        raise LabError(f"cannot read the inventory: {err.strerror}", where=str(path)) from err
    except yaml.YAMLError as err:
        raise LabError(f"the inventory is not valid YAML: {err}", where=str(path)) from err
    if not isinstance(doc, dict) or not isinstance(doc.get("hosts"), dict):
        raise LabError("the inventory has no `hosts:` mapping", where=str(path))
    if extra < 0:
        raise LabError(f"--extra must be 0 or more, not {extra}")
    doc = copy.deepcopy(doc)
    inventory = load_inventory(path)  # validates, and names file:line on any mistake
    hosts = [_lab_host(path, h.name, h.port, h.expect.hostname, h.lab, h.pct, h.via)
             for h in inventory.hosts.values()]
    more = extra_hosts(extra, {h.port for h in hosts})
    clash = set(more) & set(doc["hosts"])
    if clash:
        raise LabError(f"extra host {sorted(clash)[0]} is already in the inventory", where=str(path))
    doc["hosts"].update(more)
    hosts += [_lab_host(path, name, body["port"], name, body["lab"]) for name, body in more.items()]
    hosts = [replace(h, extra=h.name in more) for h in hosts]
    if more:
        groups = doc.setdefault("groups", {}) or {}
        doc["groups"] = groups
        groups["extra"] = list(more)
        if "gpu" in groups:
            groups["gpu"] = list(groups["gpu"]) + list(more)
    return doc, _link_containers(path, hosts)


def _link_containers(path: Path, hosts: list[LabHost]) -> list[LabHost]:
    by_name = {h.name: h for h in hosts}
    ports: dict[int, str] = {}
    for h in hosts:
        if h.port in ports:
            raise LabError(f"port {h.port} is used by both {ports[h.port]} and {h.name}",
                           where=str(path))
        ports[h.port] = h.name
    linked = []
    for h in hosts:
        if h.pct is not None and h.via not in by_name:
            raise LabError(f"`via: {h.via}` names no host in the inventory", where=_where(path, h.name))
        guests = tuple(sorted((g.pct, g.name, g.port) for g in hosts
                              if g.via == h.name and g.pct is not None))
        linked.append(replace(h, containers=guests))
    return linked


def write_inventory(doc: dict, path: Path) -> None:
    """LAB_DIR/inventory.yaml: the lab inventory plus the extra hosts, for benchmarks."""
    head = ("# Written by `ddops lab up`: the lab inventory plus its --extra hosts.\n"
            "# Edit the source inventory instead; this file is rewritten on every `up`.\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=100))
    tmp.replace(path)


def ssh_files(doc: dict, lab: Path) -> tuple[Path, Path]:
    """The key and known_hosts files ddops will use: the inventory's defaults, else LAB_DIR/ssh."""
    defaults = doc.get("defaults") or {}
    key = Path(defaults.get("key") or lab / "ssh" / "id_ed25519").expanduser()
    known = Path(defaults.get("known_hosts") or lab / "ssh" / "known_hosts").expanduser()
    return key, known

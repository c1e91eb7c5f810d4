"""The host inventory: who the hosts are, how to reach them, and who they must prove to be."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UsageError
from .yamlsrc import Section, load_yaml

ROLES = ("training", "serving", "eval", "node", "monitor")   # monitor: runs `ddops monitor`'s Prometheus
HOST_KEY_POLICIES = ("strict", "accept-new")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_UNIT = re.compile(r"^[A-Za-z0-9@._:-]+\.(service|target|timer|socket)$")
_CONNECTION_KEYS = ("user", "port", "key", "known_hosts", "host_key_policy", "connect_timeout",
                    "command_timeout", "python")
_HOST_KEYS = ("address", "via", "pct", "roles", "expect", "training", "services", "lab",
              *_CONNECTION_KEYS)
_TIMEOUT_MAX = 3600


@dataclass(frozen=True)
class Expect:
    """Identity a host must show before ddops changes anything on it."""

    hostname: str | None = None
    gpu_model: str | None = None
    gpu_count: int | None = None


@dataclass(frozen=True)
class Training:
    """How to recognise the training job on a host."""

    pattern: str | None = None
    unit: str | None = None
    log: str | None = None
    checkpoints: str | None = None


@dataclass(frozen=True)
class Service:
    """A systemd unit of interest, and where its HTTP health answers on the host's loopback."""

    unit: str
    port: int | None = None
    health: str | None = None


@dataclass(frozen=True)
class Host:
    name: str
    address: str | None
    port: int = 22
    user: str | None = None
    key: str | None = None
    known_hosts: str | None = None
    host_key_policy: str = "strict"
    connect_timeout: float = 10.0
    command_timeout: float = 120.0
    via: str | None = None
    pct: int | None = None
    roles: tuple[str, ...] = ()
    expect: Expect = field(default_factory=Expect)
    python: str | None = None
    training: Training | None = None
    services: tuple[Service, ...] = ()
    lab: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def label(self) -> str:
        """How the host is reached, for messages: `root@10.0.0.5:22` or `pct 200 on pve`."""
        if self.pct is not None:
            return f"pct {self.pct} on {self.via}"
        user = f"{self.user}@" if self.user else ""
        return f"{user}{self.address}:{self.port}" + (f" via {self.via}" if self.via else "")


@dataclass
class Inventory:
    path: Path
    hosts: dict[str, Host]
    groups: dict[str, list[str]]

    def select(self, limit: str | None) -> list[Host]:
        """Hosts named by a comma list of hosts and groups (all hosts when limit is empty)."""
        if not limit:
            return list(self.hosts.values())
        names: list[str] = []
        for word in (w.strip() for w in limit.split(",")):
            if not word:
                continue
            if word in self.hosts:
                members = [word]
            elif word in self.groups:
                members = self.groups[word]
            else:
                known = ", ".join([*self.hosts, *self.groups])
                raise UsageError(f"--limit: no host or group named {word!r} in {self.path}",
                                 fix=f"known: {known}")
            names.extend(m for m in members if m not in names)
        return [self.hosts[n] for n in names]

    def host(self, name: str) -> Host:
        if name not in self.hosts:
            raise UsageError(f"no host named {name!r} in {self.path}",
                             fix=f"known hosts: {', '.join(self.hosts)}")
        return self.hosts[name]

    def chain(self, host: Host) -> list[Host]:
        """The jump hosts to pass through to reach `host`, outermost first."""
        hops: list[Host] = []
        current = host
        while current.via is not None:
            current = self.hosts[current.via]
            hops.insert(0, current)
        return hops


def default_inventory_path() -> Path:
    return Path(os.environ.get("DDOPS_INVENTORY") or "inventories/lab.yaml")


def load_inventory(path: Path | str) -> Inventory:
    """Read and validate an inventory file; any problem is a ConfigError naming file:line."""
    path = Path(path)
    top = load_yaml(path, "inventory")
    top.reject_unknown(("defaults", "hosts", "groups"))
    defaults = top.section("defaults")
    if defaults is not None:
        defaults.reject_unknown(_CONNECTION_KEYS)
        base = _connection(defaults, {})
    else:
        base = {}
    hosts_section = top.section("hosts", required=True)
    hosts: dict[str, Host] = {}
    for name in hosts_section.keys():
        if not isinstance(name, str) or not _NAME.match(name):
            raise hosts_section.fail(name, f"invalid host name {name!r}",
                                     "use letters, digits, '.', '_' and '-'")
        entry = hosts_section.section(name, required=True)
        hosts[name] = _host(name, entry, base)
    if not hosts:
        raise hosts_section.fail(None, "the inventory defines no hosts", "add at least one under `hosts:`")
    _check_vias(hosts, hosts_section)
    groups = _groups(top, hosts)
    return Inventory(path=path, hosts=hosts, groups=groups)


def _connection(section: Section, base: dict) -> dict:
    """Connection settings of a host or of `defaults`, layered over `base`."""
    out = dict(base)
    for key, value in (
        ("user", section.str("user")),
        ("port", section.int("port", min=1, max=65535)),
        ("key", section.abspath("key", home_ok=True)),
        ("known_hosts", section.abspath("known_hosts", home_ok=True)),
        ("host_key_policy", section.str("host_key_policy", choices=HOST_KEY_POLICIES)),
        ("connect_timeout", section.number("connect_timeout", min=0.1, max=_TIMEOUT_MAX)),
        ("command_timeout", section.number("command_timeout", min=0.1, max=_TIMEOUT_MAX)),
        ("python", section.abspath("python")),
    ):
        if value is not None:
            out[key] = value
    return out


def _host(name: str, entry: Section, base: dict) -> Host:
    entry.reject_unknown(_HOST_KEYS)
    settings = _connection(entry, base)
    pct = entry.int("pct", min=100, max=999_999_999)
    via = entry.str("via")
    address = entry.str("address")
    if pct is not None and via is None:
        raise entry.fail("pct", f"host {name!r} has `pct: {pct}` but no `via`",
                         "name the Proxmox node that runs the container with `via: NODE`")
    if pct is None and address is None:
        raise entry.fail(None, f"host {name!r} has no `address`",
                         "add `address: HOSTNAME_OR_IP` (or `via` + `pct` for a Proxmox container)")
    if address is not None and (address.startswith("-") or any(c.isspace() for c in address)):
        raise entry.fail("address", f"invalid address {address!r} for host {name!r}")
    roles = entry.str_list("roles")
    for role in roles:
        if role not in ROLES:
            raise entry.fail("roles", f"unknown role {role!r} for host {name!r}",
                             f"roles are {', '.join(ROLES)}")
    lab = entry.section("lab")
    return Host(
        name=name, address=address, via=via, pct=pct, roles=tuple(roles),
        expect=_expect(entry), training=_training(entry), services=_services(entry),
        lab=dict(lab.data) if lab is not None else {}, **settings,
    )


def _expect(entry: Section) -> Expect:
    section = entry.section("expect")
    if section is None:
        return Expect()
    section.reject_unknown(("hostname", "gpu_model", "gpu_count"))
    return Expect(hostname=section.str("hostname"), gpu_model=section.str("gpu_model"),
                  gpu_count=section.int("gpu_count", min=0, max=64))


def _training(entry: Section) -> Training | None:
    section = entry.section("training")
    if section is None:
        return None
    section.reject_unknown(("pattern", "unit", "log", "checkpoints"))
    training = Training(pattern=section.str("pattern"), unit=_unit(section, "unit"),
                        log=section.abspath("log"), checkpoints=section.abspath("checkpoints"))
    if training.pattern is None and training.unit is None:
        raise section.fail(None, "`training` needs a `pattern` or a `unit` to find the job")
    return training


def _unit(section: Section, key: str, required: bool = False) -> str | None:
    unit = section.str(key, required=required)
    if unit is not None and not _UNIT.match(unit):
        raise section.fail(key, f"invalid systemd unit name {unit!r}", "e.g. `sglang-qwen.service`")
    return unit


def _services(entry: Section) -> tuple[Service, ...]:
    services = []
    for index, item in enumerate(entry.list("services")):
        if isinstance(item, str):
            item_section = None
            unit = item
        else:
            item_section = entry.item_section("services", index, item)
            item_section.reject_unknown(("unit", "port", "health"))
            unit = _unit(item_section, "unit", required=True)
        if not _UNIT.match(unit):
            raise entry.fail("services", f"invalid systemd unit name {unit!r}", "e.g. `sglang-qwen.service`")
        port = item_section.int("port", min=1, max=65535) if item_section else None
        health = item_section.str("health") if item_section else None
        if health is not None and not health.startswith("/"):
            raise item_section.fail("health", f"`health` must be a URL path like /health, got {health!r}")
        services.append(Service(unit=unit, port=port, health=health or ("/health" if port else None)))
    return tuple(services)


def _check_vias(hosts: dict[str, Host], section: Section) -> None:
    for host in hosts.values():
        seen = [host.name]
        current = host
        while current.via is not None:
            if current.via not in hosts:
                raise section.section(current.name).fail(
                    "via", f"host {current.name!r} goes via unknown host {current.via!r}",
                    f"known hosts: {', '.join(hosts)}")
            if current.via in seen:
                loop = " -> ".join([*seen, current.via])
                raise section.section(host.name).fail("via", f"`via` loop: {loop}",
                                                      "a jump chain must end at a host with an address")
            seen.append(current.via)
            current = hosts[current.via]


def _groups(top: Section, hosts: dict[str, Host]) -> dict[str, list[str]]:
    section = top.section("groups")
    groups: dict[str, list[str]] = {}
    if section is None:
        return groups
    for name in section.keys():
        if name in hosts:
            raise section.fail(name, f"group {name!r} has the same name as a host", "rename one of them")
        members = section.str_list(name, required=True)
        for member in members:
            if member not in hosts:
                raise section.fail(name, f"group {name!r} names unknown host {member!r}",
                                   f"known hosts: {', '.join(hosts)}")
        groups[name] = members
    for role in ROLES:
        role_hosts = [h.name for h in hosts.values() if role in h.roles]
        if role_hosts and role not in groups and role not in hosts:
            groups[role] = role_hosts
    return groups

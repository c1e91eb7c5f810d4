"""`ddops monitor --host H`: Debian's Prometheus on an inventory host, scraping every runtime replica and
SGLang server the fleet runs now.

The flow is a small pivot of its own: facts from every host (which units and replicas are there, one
round trip each) -> the rendered configuration (templates/prometheus.yml.j2, one file-based service
discovery file per job, a bearer-token file per API key) -> `apt-get install prometheus` where it is
missing -> `promtool check config` on the rendered files in a scratch folder of the host -> one backup
and install of all of them (the `unitfile` action, as a unit's) -> restart and wait for /-/ready ->
on failure, the backup restored and Prometheus restarted on it.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass
from typing import Any, Callable

from .errors import StepFailed
from .executor import Executor
from .facts import gather
from .inventory import Host, Inventory
from .paths import backup_root
from .preflight import holder_words
from .remote import check, run_probe, write_file
from .steps.deps import APT_ENV
from .steps.unit import new_backup_id, render_template
from .top import targets

UNIT = "prometheus.service"
DROPIN = "/etc/systemd/system/prometheus.service.d/ddops.conf"
ENV_FILE = "/etc/default/prometheus"           # Debian's unit reads ARGS from it
CONFIG = "/etc/prometheus/prometheus.yml"
SD_DIR = "/etc/prometheus/ddops"               # the discovery files and the bearer-token files
PORT = 9090
LISTEN = f"127.0.0.1:{PORT}"
SCRAPE_INTERVAL_S = 5
RETENTION = "15d"
READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ScrapeTarget:
    host: str
    unit: str
    address: str
    port: int
    api_key: str | None


@dataclass(frozen=True)
class Rendered:
    dropin: str
    env: str
    files: list[dict[str, Any]]    # {"path", "text", "mode"}, the unitfile action's `files`
    secret_paths: list[str]        # bearer-token files, readable by the prometheus group only
    jobs: list[dict[str, Any]]


def address_of(inventory: Inventory, host: Host) -> str:
    """Where Prometheus reaches a host's ports: its address, or its node's for a `pct` container."""
    if host.address:
        return host.address
    return inventory.hosts[host.via].address if host.via else host.name


def discover(executor: Executor, inventory: Inventory, hosts: list[Host],
             api_keys: dict[str, dict[int, str]]) -> tuple[list[ScrapeTarget], dict[str, str]]:
    """Every serving unit and replica installed on `hosts` now (the facts probe, in parallel), and the
    hosts that did not answer (their targets are left out: a later run adds them)."""
    outcomes = executor.fan_out(hosts, lambda h: gather(executor, h))
    found, missing = [], {}
    for h in hosts:
        outcome = outcomes[h.name]
        if outcome.value is None:
            missing[h.name] = outcome.error.line() if outcome.error else "no answer"
            continue
        for t in targets(outcome.value):
            if t.active is None:
                continue
            found.append(ScrapeTarget(h.name, t.unit, address_of(inventory, h), t.port,
                                      api_keys.get(h.name, {}).get(t.port)))
    return found, missing


def render(host: str, found: list[ScrapeTarget], root: str = SD_DIR, config_path: str = CONFIG) -> Rendered:
    """The configuration, its discovery files and token files; `root` moves them (promtool's scratch check)."""
    keys = sorted({t.api_key for t in found if t.api_key})
    jobs: list[dict[str, Any]] = []
    files: list[dict[str, Any]] = []
    secret_paths = []
    for index, key in enumerate([None, *keys]):
        members = [t for t in found if t.api_key == key]
        if key is not None and not members:
            continue
        name = "ddops-serving" if key is None else f"ddops-serving-key{index}"
        targets_file = f"{root}/{name}.json"
        groups = [{"targets": [f"{t.address}:{t.port}"], "labels": {"ddops_host": t.host, "unit": t.unit}}
                  for t in members]
        files.append({"path": targets_file, "text": json.dumps(groups, indent=1) + "\n", "mode": 0o644})
        job = {"name": name, "targets_file": targets_file, "credentials_file": None,
               "targets": [f"{t.address}:{t.port}" for t in members]}
        if key is not None:
            job["credentials_file"] = f"{root}/{name}.token"
            files.append({"path": job["credentials_file"], "text": key, "mode": 0o640})
            secret_paths.append(job["credentials_file"])
        jobs.append(job)
    config = render_template("prometheus.yml.j2", _plain, host=host, jobs=jobs, listen=LISTEN,
                             scrape_interval_s=SCRAPE_INTERVAL_S)
    files.insert(0, {"path": config_path, "text": config, "mode": 0o644})
    return Rendered(dropin=render_template("prometheus-dropin.conf.j2", _plain, host=host),
                    env=render_template("prometheus.env.j2", _plain, host=host, listen=LISTEN, retention=RETENTION),
                    files=files, secret_paths=secret_paths, jobs=jobs)


def _plain(value: Any, template: str) -> Any:
    return value


def check_port(executor: Executor, host: Host) -> None:
    """Prometheus's port must be free or its own: anything else there and it would never become ready
    (and the rollback's restart would fail the same way). Refused before anything changes."""
    holder = run_probe(executor, host, "inspect", {"port": PORT}, timeout=60).get("port")
    if holder is not None and holder.get("unit") != UNIT:
        raise StepFailed(f"port {PORT} on {host.name} is held by {holder_words(holder)}: Prometheus listens there "
                         "and would never start", fix="stop what holds it, then run `ddops monitor` again; nothing "
                                                      "was changed")


def install_prometheus(executor: Executor, host: Host, progress: Callable[[str], None]) -> bool:
    """Debian's prometheus package, when the host has no `promtool`; whether it was installed now."""
    if executor.run(host, ["sh", "-c", "command -v promtool"], timeout=30).ok:
        return False
    for argv in (APT_ENV + ["apt-get", "update", "-q"],
                 APT_ENV + ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"]):
        progress(" ".join(argv[2:]))
        check(executor.run(host, argv, timeout=900), " ".join(argv[2:]))
    return True


def check_config(executor: Executor, host: Host, found: list[ScrapeTarget]) -> None:
    """`promtool check config` on the rendered files, written to a scratch folder first (the files in
    place are not touched by a configuration Prometheus would refuse)."""
    made = executor.run(host, ["mktemp", "-d", "/tmp/ddops-prometheus.XXXXXX"], timeout=30)
    check(made, "mktemp -d (a scratch folder for promtool)")
    folder = made.stdout.strip()
    try:
        trial = render(host.name, found, root=folder, config_path=f"{folder}/prometheus.yml")
        for f in trial.files:
            check(write_file(executor, host, f["path"], f["text"], timeout=30), f"writing {f['path']}")
        result = executor.run(host, ["promtool", "check", "config", f"{folder}/prometheus.yml"], timeout=60)
        check(result, "promtool check config (the rendered Prometheus configuration)")
    finally:
        executor.run(host, ["rm", "-rf", folder], timeout=30)


def install_spec(rendered: Rendered, backup_id: str, host: str) -> dict[str, Any]:
    return {"action": "install", "unit": UNIT, "unit_path": DROPIN, "env_path": ENV_FILE,
            "unit_text": rendered.dropin, "env_text": rendered.env, "backup_root": backup_root(UNIT),
            "backup_id": backup_id, "meta": {"reason": "monitor", "host": host}, "files": rendered.files}


def restart_and_wait(executor: Executor, host: Host, timeout: float = READY_TIMEOUT_S) -> None:
    check(executor.run(host, ["systemctl", "restart", UNIT], timeout=120), f"systemctl restart {UNIT}")
    probe = ("import sys, urllib.request\n"
             f"sys.exit(0 if urllib.request.urlopen('http://{LISTEN}/-/ready', timeout=3).status == 200 else 1)")
    deadline = time.monotonic() + timeout
    while not executor.run(host, ["python3", "-c", probe], timeout=30).ok:
        if time.monotonic() > deadline:
            raise StepFailed(f"Prometheus on {host.name} was not ready within {timeout:.0f}s after the restart",
                             fix=f"ddops logs --host {host.name} --unit {UNIT}")
        time.sleep(1)


def refresh_targets(executor: Executor, inventory: Inventory, host: Host,
                    api_keys: dict[str, dict[int, str]]) -> dict[str, Any]:
    """After a pivot or rollback: rewrite the discovery files of the Prometheus on `host` (a host with
    role `monitor`) from what the serving hosts run now; Prometheus rereads them by itself, no restart.
    A change of API keys needs the configuration too: that is `ddops monitor` again."""
    serving = [h for h in inventory.hosts.values() if h.services or "serving" in h.roles]
    found, missing = discover(executor, inventory, serving, api_keys)
    rendered = render(host.name, found)
    config = next(f["text"] for f in rendered.files if f["path"] == CONFIG)
    installed = executor.run(host, ["cat", CONFIG], timeout=30)
    if not installed.ok:
        return {"host": host.name, "skipped": f"no {CONFIG}: run `ddops monitor --host {host.name}` first"}
    if installed.stdout != config:
        return {"host": host.name, "skipped": "its jobs changed (an API key came or went): run "
                                               f"`ddops monitor --host {host.name}`"}
    written = []
    for job in rendered.jobs:
        text = next(f["text"] for f in rendered.files if f["path"] == job["targets_file"])
        check(write_file(executor, host, job["targets_file"], text, timeout=30),
              f"writing {job['targets_file']}")
        written.append(job["targets_file"])
    return {"host": host.name, "files": written, "targets": [f"{t.address}:{t.port}" for t in found],
            "unanswered": missing}


def monitor(executor: Executor, inventory: Inventory, host: Host, watched: list[Host],
            api_keys: dict[str, dict[int, str]], progress: Callable[[str], None]) -> dict[str, Any]:
    """Install or update Prometheus on `host`; the report (targets, jobs, backup, whether rolled back)."""
    progress(f"checking port {PORT} on {host.name}")
    check_port(executor, host)
    progress(f"gathering the serving units of {len(watched)} host(s)")
    found, missing = discover(executor, inventory, watched, api_keys)
    rendered = render(host.name, found)
    installed = install_prometheus(executor, host, progress)
    progress("promtool check config")
    check_config(executor, host, found)
    backup_id = new_backup_id()
    progress(f"installing {CONFIG} and {len(rendered.files) - 1} discovery file(s); backup {backup_id}")
    out = run_probe(executor, host, "unitfile", stdin=install_spec(rendered, backup_id, host.name))
    if rendered.secret_paths:
        check(executor.run(host, ["sh", "-c", f"chgrp prometheus {shlex.join(rendered.secret_paths)}"], timeout=30),
              "giving the prometheus group the token files")
    report = {"host": host.name, "installed_package": installed, "backup_id": backup_id, "listen": LISTEN,
              "targets": [vars(t) | {"api_key": "***" if t.api_key else None} for t in found],
              "jobs": [{k: v for k, v in j.items() if k != "credentials_file"} for j in rendered.jobs],
              "unanswered": missing, "rolled_back": False, "daemon_reload": out["daemon_reload"]["rc"]}
    try:
        progress(f"restarting {UNIT}, waiting for /-/ready")
        restart_and_wait(executor, host)
    except StepFailed as failure:
        progress(f"rolling back to the backup {backup_id}")
        run_probe(executor, host, "unitfile", stdin={"action": "restore", "unit": UNIT, "unit_path": DROPIN,
                                                     "env_path": ENV_FILE, "backup_root": backup_root(UNIT),
                                                     "backup_id": backup_id})
        try:
            restart_and_wait(executor, host)
        except StepFailed as again:
            raise StepFailed(f"{failure.what}; the previous configuration is back in place (backup {backup_id}), "
                             f"but Prometheus did not come up on it either: {again.what}", fix=again.fix) from None
        raise StepFailed(f"{failure.what}; the previous configuration is back and running (backup {backup_id})",
                         fix=failure.fix) from None
    return report

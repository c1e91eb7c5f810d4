"""The ddops command line: thin click commands over the library, and the one error boundary."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import click
from rich.console import Console

from . import __version__
from .errors import EXIT_ALARM, EXIT_FAILED, EXIT_INTERNAL, DdopsError, UsageError
from .executor import Executor
from .inventory import Inventory, default_inventory_path, load_inventory
from .progress import Activity
from .views import as_dict, lab_table, stdout_console

err_console = Console(stderr=True, highlight=False)


@dataclass
class Context:
    inventory_path: Path
    limit: str | None
    verbose: int
    accept_new_host_keys: bool

    def inventory(self) -> Inventory:
        return load_inventory(self.inventory_path)

    def executor(self, inventory: Inventory) -> Executor:
        return Executor(inventory, accept_new_host_keys=self.accept_new_host_keys)


# The global options: (declarations, the Context field they set, click settings). The group takes them
# before the command; every command takes them after it too (`ddops status --limit ct200`), as Ansible's
# and Kamal's do.
GLOBAL_OPTIONS = (
    (("-i", "--inventory", "inventory_path"), "inventory_path",
     {"type": click.Path(path_type=Path), "default": None,
      "help": "Inventory file [default: $DDOPS_INVENTORY, then inventories/lab.yaml]."}),
    (("--limit",), "limit", {"metavar": "HOSTS", "help": "Comma list of hosts or groups to act on."}),
    (("--accept-new-host-keys",), "accept_new_host_keys",
     {"is_flag": True, "help": "Trust and record a host key seen for the first time (like accept-new). "
                               "A changed key is always refused."}),
    (("-v", "--verbose"), "verbose", {"count": True, "help": "More output; -vv shows tracebacks."}),
)


def _global_options(f):
    for decls, _, settings in reversed(GLOBAL_OPTIONS):
        f = click.option(*decls, **settings)(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@_global_options
@click.version_option(__version__, prog_name="ddops")
@click.pass_context
def cli(ctx: click.Context, inventory_path: Path | None, limit: str | None,
        accept_new_host_keys: bool, verbose: int) -> None:
    """Fleet ops for GPU hosts that train and serve speculative-decoding LLMs.

    The global options (-i, --limit, --accept-new-host-keys, -v) go before or after the command.

    Exit codes: 0 ok, 1 an alarm (`top --fail-on`), 2 user/config error or a failed step, 3 an internal
    error (a bug: the crash log it names goes with the report), 4 a host unreachable, 130 interrupted
    (Ctrl-C or SIGTERM; a pivot first rolls back what it changed).
    """
    ctx.obj = Context(inventory_path=inventory_path or default_inventory_path(), limit=limit,
                      verbose=verbose, accept_new_host_keys=accept_new_host_keys)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per host.")
@click.pass_obj
def status(obj: Context, as_json: bool) -> None:
    """Every host at a glance: identity, GPUs, training job, services, runtime health."""
    from .status import collect, exit_code, render

    inventory = obj.inventory()
    hosts = inventory.select(obj.limit)
    with obj.executor(inventory) as executor:
        if as_json:
            records = collect(executor, hosts)
            click.echo(json.dumps(records, indent=2))
        else:
            with Activity(err_console, f"gathering facts from {len(hosts)} host(s)"):
                records = collect(executor, hosts)
            render(records, stdout_console())
    sys.exit(exit_code(records))


@cli.command()
@click.option("--profile", "profile_names", multiple=True, metavar="PROFILE",
              help="A deploy profile whose hosts are watched against it: its smoke.min_acceptance is the "
                   "acceptance alarm's floor, its API key reads /metrics. Repeatable.")
@click.option("--interval", type=click.FloatRange(0.2, 3600), default=2.0, show_default=True,
              help="Seconds between refreshes (one probe per host each).")
@click.option("--once", is_flag=True, help="Print one snapshot (its windows span one refresh) and exit.")
@click.option("--count", type=click.IntRange(1, 10**9), default=None, help="Stop after N refreshes.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object a line, one per refresh.")
@click.option("--fail-on", "fail_on", default=None, metavar="KINDS",
              help="With --once or --count: exit 1 when one of these alarms is up at the end (comma list, or "
                   "`all`): acceptance, 5xx, queue, restart, gpu-memory, gpu, balancer, down, unreachable.")
@click.pass_obj
def top(obj: Context, profile_names: tuple[str, ...], interval: float, once: bool, count: int | None,
        as_json: bool, fail_on: str | None) -> None:
    """The fleet live: per host GPUs and training, per serving unit or replica health, load, tokens/s,
    acceptance, TTFT and round time (p50/p95 over the refresh), errors, the balancer; and alarms."""
    from .alarms import KINDS, top_frame
    from .profile import check_against_inventory, load_profile, resolve_profile
    from .top import HISTORY, Poller, settings_from_profiles
    from .topview import render_frame, run_live, run_stream

    kinds = _alarm_kinds(fail_on, KINDS)
    if kinds and not (once or count):
        raise UsageError("--fail-on needs an end: add --once (or --count N)",
                         fix="e.g. ddops top --once --fail-on all")
    inventory = obj.inventory()
    hosts = inventory.select(obj.limit)
    profiles = [load_profile(resolve_profile(name)) for name in profile_names]
    for profile in profiles:
        check_against_inventory(profile, inventory)
    thresholds, api_keys = settings_from_profiles(profiles, inventory)
    # --once: a window needs two readings; a growing queue needs one more than its refreshes
    samples = (1 + thresholds.queue_growth_refreshes if "queue" in kinds else 2) if once else None
    with obj.executor(inventory) as executor:
        poller = Poller(executor, hosts, interval=interval, api_keys=api_keys).start()
        try:
            if samples:
                deadline = time.monotonic() + samples * interval + poller.timeout + 5
                while not poller.samples_at_least(min(samples, HISTORY)) and time.monotonic() < deadline:
                    time.sleep(0.05)
                frame = top_frame(poller, thresholds)
                if as_json:
                    click.echo(json.dumps(frame, default=str))
                else:
                    stdout_console().print(render_frame(frame))
            elif sys.stdout.isatty() and sys.stdin.isatty() and not as_json:
                _wait_first_answers(poller)
                frame = run_live(lambda: top_frame(poller, thresholds), interval, stdout_console(), count=count)
            else:
                _wait_first_answers(poller)
                frame = run_stream(lambda: top_frame(poller, thresholds), interval, stdout_console(), as_json=as_json,
                                   count=count)
        finally:
            poller.stop()
    raised = sorted({a["kind"] for a in frame["alarms"]} & kinds)
    if raised:
        err_console.print(f"[bold red]alarm:[/] {', '.join(raised)}", soft_wrap=True)
        sys.exit(EXIT_ALARM)


@cli.command()
@click.option("--host", "host_name", required=True, help="The inventory host Prometheus runs on.")
@click.option("--profile", "profile_names", multiple=True, metavar="PROFILE",
              help="A deploy profile whose API key Prometheus sends to its replicas (bearer token). Repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_obj
def monitor(obj: Context, host_name: str, profile_names: tuple[str, ...], as_json: bool) -> None:
    """Install Debian's Prometheus on a host, scraping every runtime replica and SGLang server of the
    selected hosts (checked with promtool first, backed up, rolled back if it does not come up)."""
    from .monitor import monitor as install_monitor
    from .profile import check_against_inventory, load_profile, resolve_profile
    from .top import settings_from_profiles

    inventory = obj.inventory()
    host = inventory.host(host_name)
    profiles = [load_profile(resolve_profile(name)) for name in profile_names]
    for profile in profiles:
        check_against_inventory(profile, inventory)
    _, api_keys = settings_from_profiles(profiles, inventory)
    with obj.executor(inventory) as executor:
        report = install_monitor(executor, inventory, host, inventory.select(obj.limit), api_keys, _progress)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for t in report["targets"]:
        click.echo(f"  scraping {t['host']} {t['unit']} at {t['address']}:{t['port']}"
                   + (" (bearer token)" if t["api_key"] else ""))
    for name, why in report["unanswered"].items():
        err_console.print(f"[yellow]{name}: not scraped ({why})[/]", soft_wrap=True)
    _progress(f"Prometheus on {host.name} answers at {report['listen']} (backup {report['backup_id']})")


def _refresh_monitors(inventory: Inventory, executor: Executor, profiles: list) -> None:
    """Hosts with role `monitor`: their Prometheus's discovery files follow what a pivot or rollback
    changed (replicas added or removed). A failure here is a warning: the pivot's outcome stands."""
    from .monitor import refresh_targets
    from .top import settings_from_profiles

    monitors = [h for h in inventory.hosts.values() if "monitor" in h.roles]
    if not monitors:
        return
    _, api_keys = settings_from_profiles(profiles, inventory)
    for host in monitors:
        try:
            out = refresh_targets(executor, inventory, host, api_keys)
        except DdopsError as exc:
            err_console.print(f"[yellow]monitor {host.name}: targets not refreshed ({exc.line()})[/]", soft_wrap=True)
            continue
        if "skipped" in out:
            err_console.print(f"[yellow]monitor {host.name}: targets not refreshed ({out['skipped']})[/]",
                              soft_wrap=True)
        else:
            _progress(f"monitor {host.name}: Prometheus discovers {len(out['targets'])} target(s)")


def _alarm_kinds(fail_on: str | None, known: dict[str, str]) -> set[str]:
    if not fail_on:
        return set()
    kinds = {k.strip() for k in fail_on.split(",") if k.strip()}
    if "all" in kinds:
        return set(known)
    unknown = sorted(kinds - set(known))
    if unknown:
        raise UsageError(f"--fail-on: unknown alarm {', '.join(unknown)}", fix=f"use {', '.join(known)} or all")
    return kinds


def _wait_first_answers(poller, timeout: float = 15.0) -> None:
    """The first frame after every host answered once (or a short wait), so it is not all `waiting`."""
    deadline = time.monotonic() + timeout
    while not poller.samples_at_least(1) and time.monotonic() < deadline:
        time.sleep(0.05)


class LostSteps(click.ParamType):
    """`--accept-lost-steps`: a number of steps (0 or more), or `all` (read as infinity)."""

    name = "N|all"

    def convert(self, value, param, ctx) -> float:
        if isinstance(value, float):
            return value
        if str(value).strip().lower() == "all":
            return float("inf")
        try:
            steps = int(value)
        except ValueError:
            steps = -1
        if steps < 0:
            self.fail(f"{value!r} is not a number of steps (0 or more) or `all`", param, ctx)
        return float(steps)


LOST_STEPS = LostSteps()


@cli.command()
@click.option("--deploy", "profile_name", required=True, metavar="PROFILE",
              help="Deploy profile: a name in playbooks/ (e.g. zlab-ddtree16) or a path to a .yaml file.")
@click.option("--kill-training", is_flag=True,
              help="Stop the training job on the serving host: first the profile's checkpoint request, if it names "
                   "one (training.checkpoint_signal or checkpoint_command, then up to checkpoint_wait_s for a newer "
                   "checkpoint), then SIGTERM (through its unit when it has one), training.grace_s to exit, and "
                   "SIGKILL for what is left. A stop that would lose more steps than allowed is refused.")
@click.option("--dry-run", is_flag=True, help="Run preflight, print the plan and the unit diff; change nothing.")
@click.option("-y", "--yes", is_flag=True, help="Apply the plan without asking.")
@click.option("--no-rollback", is_flag=True, help="Leave a failed pivot as it is instead of rolling back.")
@click.option("--break-lock", is_flag=True, help="Clear the host's pivot lock first, only if its holder is provably "
                                               "dead (same control machine: its pid and start time; another: "
                                               "its lease expired); else refuse, naming it.")
@click.option("--accept-lost-steps", "accept_lost_steps", type=LOST_STEPS, default=None, metavar="N|all",
              help="Stop training even if that loses up to N steps since its newest checkpoint (`all`: any "
                   "number); replaces the profile's training.max_lost_steps for this run. --yes never does.")
@click.option("--accept-gpu-faults", is_flag=True,
              help="Pivot onto GPUs with uncorrectable ECC errors, pending remaps or a fatal Xid since boot "
                   "(preflight refuses them otherwise); the history records it.")
@click.option("--batch", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Replicas replaced at once when a pivot changes replicas already serving (a rolling "
                   "restart: drain, restart, gate, readmit, batch by batch; halts at the first failure).")
@click.option("--no-kernel-seed", "no_kernel_seed", is_flag=True,
              help="Leave an empty Triton cache on the host empty for this run: its first start compiles (and "
                   "autotunes) its own kernels instead of loading those of the kernel store for its GPU model "
                   "(harvested from another host after a deploy that passed its gates, in $DDOPS_CACHE/kernels), "
                   "or the compile record of another GPU model's store when its own has none. A deploy that "
                   "passes still replaces that store with this host's cache.")
@click.option("--json", "as_json", is_flag=True, help="Print the final report as JSON on stdout.")
@click.pass_obj
def pivot(obj: Context, profile_name: str, kill_training: bool, dry_run: bool, yes: bool, no_rollback: bool,
          break_lock: bool, accept_lost_steps: float | None, accept_gpu_faults: bool, batch: int,
          no_kernel_seed: bool, as_json: bool) -> None:
    """Pivot a host from training to serving, gated on health and a real smoke test.

    A profile whose `host` is an inventory group is pivoted host by host, halting at the first failure.
    """
    from .credentials import read_secrets
    from .pivot import PivotOptions
    from .profile import check_against_inventory, load_profile, resolve_profile
    from .rollout import rollout
    from .views import render_summary

    inventory = obj.inventory()
    profile = load_profile(resolve_profile(profile_name))
    check_against_inventory(profile, inventory)
    console = err_console if as_json else stdout_console()
    interactive = sys.stdin.isatty() and not as_json
    if not yes and not dry_run and not interactive:
        raise UsageError("pivot needs --yes when not run from a terminal", fix="add --yes (or -y), or --dry-run")
    options = PivotOptions(kill_training=kill_training, dry_run=dry_run, yes=yes, no_rollback=no_rollback,
                           break_lock=break_lock, accept_lost_steps=accept_lost_steps,
                           accept_gpu_faults=accept_gpu_faults, batch=batch, kernel_seed=not no_kernel_seed)
    with obj.executor(inventory) as executor:
        report = rollout(profile, inventory, executor, console, secrets=read_secrets(profile), options=options,
                         confirm=lambda q: click.confirm(q, default=False, err=True))
        if not dry_run:
            _refresh_monitors(inventory, executor, [profile])
    render_summary(report, console)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    sys.exit(report["exit_code"])


@cli.command()
@click.option("--host", "host_name", required=True, help="The host to roll back.")
@click.option("--unit", default=None, help="The unit [default: the host's first service]; for replicas, "
                                          "the template (e.g. ddtree@.service): all its replicas are restored.")
@click.option("--list", "list_only", is_flag=True, help="List the unit's backups and exit.")
@click.option("--to", "backup_id", default=None, metavar="BACKUP_ID", help="Restore this backup [default: newest].")
@click.option("--skip-smoke", is_flag=True, help="Check only the restored units' health, not their smoke test "
                                                 "(the health check always runs).")
@click.option("--break-lock", is_flag=True, help="Clear the host's pivot lock first, only if its holder is provably "
                                               "dead (as pivot's --break-lock).")
@click.option("-y", "--yes", is_flag=True, help="Roll back without asking (it asks only on a terminal).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_obj
def rollback(obj: Context, host_name: str, unit: str | None, list_only: bool, backup_id: str | None,
             skip_smoke: bool, break_lock: bool, yes: bool, as_json: bool) -> None:
    """Restore a unit's backup (or remove a unit that did not exist before), restart, then gate it: health,
    and the smoke test of the profile that installed what is restored. An unfinished pivot on the host
    (crashed, killed) is rolled back to the state from before it. Holds the host's pivot lock."""
    from .backups import list_backups
    from .rollback import rollback_command
    from .views import backups_table, rollback_line

    inventory = obj.inventory()
    host = inventory.host(host_name)
    unit = unit or _default_unit(host)
    console = err_console if as_json else stdout_console()
    if not (yes or list_only or as_json) and sys.stdin.isatty():
        target = f"backup {backup_id}" if backup_id else "its newest backup"
        if not click.confirm(f"Roll {unit} on {host.name} back to {target}?", default=False, err=True):
            err_console.print("not confirmed: nothing was changed")
            return
    with obj.executor(inventory) as executor:
        if list_only:
            backups = list_backups(executor, host, unit)
            if as_json:
                click.echo(json.dumps(backups, indent=2))
            else:
                stdout_console().print(backups_table(backups, unit, host.name))
            return
        with Activity(console, f"rolling back {unit} on {host.name}") as activity:
            report = rollback_command(executor, inventory, host, unit, backup_id, progress=activity.update,
                                      skip_smoke=skip_smoke, break_lock=break_lock)
        _refresh_monitors(inventory, executor, [])
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        console.print(rollback_line(report, unit, host.name), soft_wrap=True)


@cli.command("history")
@click.option("--host", "host_name", default=None, help="One host [default: every selected host].")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def history_cmd(obj: Context, host_name: str | None, as_json: bool) -> None:
    """Pivots and rollbacks recorded on the hosts."""
    from . import history
    from .paths import HISTORY_PATH
    from .views import history_table

    inventory = obj.inventory()
    hosts = [inventory.host(host_name)] if host_name else inventory.select(obj.limit)
    with obj.executor(inventory) as executor:
        outcomes = executor.fan_out(hosts, lambda h: history.read(executor, h))
    records = []
    for h in hosts:
        o = outcomes[h.name]
        if o.error is not None:
            err_console.print(f"[yellow]{h.name}:[/] {o.error.line()}")
            continue
        records += [{"host": h.name, **r} for r in o.value]
    records.sort(key=lambda r: r.get("time", 0))
    if as_json:
        click.echo(json.dumps(records, indent=2, default=str))
        return
    if not records:
        where = ", ".join(h.name for h in hosts)
        err_console.print(f"no pivots or rollbacks recorded on {where} yet (each host keeps its own in "
                          f"{HISTORY_PATH})", soft_wrap=True)
        return
    stdout_console().print(history_table(records))


@cli.command("kernels")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def kernels_cmd(as_json: bool) -> None:
    """The kernel store on this control machine: a Triton cache per GPU model, harvested after deploys
    that passed their gates, seeded into the empty cache of the next host of that model (a host of a
    model with none gets the newest compile record)."""
    from .kernels import list_stores
    from .paths import kernel_store_root
    from .views import kernels_table

    stores = list_stores()
    if as_json:
        click.echo(json.dumps([s.as_json() for s in stores], indent=2))
        return
    if not stores:
        err_console.print(f"no kernel store in {kernel_store_root()} yet: a DDTree deploy that passes its gates "
                          "harvests its host's Triton cache there", soft_wrap=True)
        return
    stdout_console().print(kernels_table(stores))


@cli.command()
@click.option("--host", "host_name", required=True, help="The host.")
@click.option("--unit", default=None, help="The unit [default: the host's first service].")
@click.option("-n", "lines", type=click.IntRange(1, 100000), default=50, show_default=True, help="Lines.")
@click.pass_obj
def logs(obj: Context, host_name: str, unit: str | None, lines: int) -> None:
    """The journal tail of a unit on a host."""
    from .remote import journal_argv, unit_installed

    inventory = obj.inventory()
    host = inventory.host(host_name)
    unit = unit or _default_unit(host)
    with obj.executor(inventory) as executor:
        installed = unit_installed(executor, host, unit)
        result = executor.run(host, journal_argv(unit, lines), timeout=60)
    if not result.ok:
        raise DdopsError(f"journalctl failed on {host.name}: {result.stderr.strip()[-200:]}")
    empty = result.stdout.strip() in ("", "-- No entries --")
    if not installed and empty:
        known = [s.unit for s in host.services]
        fix = ("a pivot installs it, e.g. `ddops pivot --deploy PROFILE`" if unit in known
               else f"check the name; the inventory lists {', '.join(known) or 'no units'} for {host.name}")
        raise UsageError(f"{unit} is not installed on {host.name} and has no journal entries", fix=fix)
    _progress(f"journal of {unit} on {host.name}, last {lines} lines"
              + ("" if installed else f" ({unit} is not installed now: deployed once, then removed)"))
    click.echo(result.stdout.rstrip())


@cli.command()
@click.option("--host", "host_name", required=True, help="The host serving the runtime.")
@click.option("--profile", "profile_name", default=None, metavar="PROFILE",
              help="Take port, model name and API key from this deploy profile.")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="The runtime's port [default: the profile's, else the host's first service with a port].")
@click.option("--api-key-env", default=None, metavar="VAR",
              help="Control-machine env var holding the API key [default: the profile's secret, if any].")
@click.option("--prompts", "prompts_path", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              default=None, help="JSON lines with `prompt` [default: the bundled 10-prompt coding set].")
@click.option("--modes", default="ar,dflash,ddtree:16,ddtree:64", show_default=True,
              help="Comma list: ar, dflash, ddtree or ddtree:BUDGET.")
@click.option("--max-tokens", type=click.IntRange(1, 32768), default=256, show_default=True)
@click.option("--timeout", type=click.FloatRange(1, 3600), default=300, show_default=True,
              help="Seconds per request.")
@click.option("--concurrency", type=click.IntRange(1, 1024), default=1, show_default=True,
              help="Clients at once: above 1, a load run (aggregate tokens/s, p50/p99 latency and first token).")
@click.option("--requests", "requests", type=click.IntRange(1, 100000), default=None,
              help="Requests per mode in a load run [default: two per client, at least each prompt once].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_obj
def bench(obj: Context, host_name: str, profile_name: str | None, port: int | None, api_key_env: str | None,
          prompts_path: Path | None, modes: str, max_tokens: int, timeout: float, concurrency: int,
          requests: int | None, as_json: bool) -> None:
    """Tokens/s and mean acceptance length per speculative mode, per prompt and overall; with
    --concurrency N, aggregate tokens/s and latency under N concurrent clients."""
    from .bench import bench_spec, load_prompts, parse_modes, render, resolve_target, run_bench

    mode_list, prompts = parse_modes(modes), load_prompts(prompts_path)
    inventory = obj.inventory()
    host = inventory.host(host_name)
    port, model, api_key = resolve_target(host, profile_name, port, api_key_env)
    spec = bench_spec(port=port, api_key=api_key, model=model, max_tokens=max_tokens, timeout=timeout,
                      prompts=prompts, modes=mode_list, concurrency=concurrency, requests=requests)
    if not as_json:
        _progress(f"{spec['requests']} requests per mode from {concurrency} clients at once, "
                  f"{len(mode_list)} mode(s) on {host.name}:{port}" if concurrency > 1 else
                  f"{len(prompts)} prompt(s) x {len(mode_list)} mode(s) on {host.name}:{port}")
    with obj.executor(inventory) as executor:
        report = run_bench(executor, host, spec, _progress)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        render(report, stdout_console())
    if report["errors"]:
        sys.exit(EXIT_FAILED)


@cli.command()
@click.option("--keep", is_flag=True, help="Leave the lab running at the end (else a lab the demo booted is "
                                           "shut down again).")
@click.pass_obj
def demo(obj: Context, keep: bool) -> None:
    """The whole story on the local lab: up, status, a dry run, the pivot, a re-run, logs, rollback, history."""
    from .demo import run_demo

    sys.exit(run_demo(obj.inventory_path, keep=keep, progress=_progress))


def _default_unit(host) -> str:
    if not host.services:
        raise UsageError(f"{host.name} lists no services in the inventory", fix="pass --unit UNIT")
    return host.services[0].unit


@cli.group()
def lab() -> None:
    """A local rehearsal fleet of Debian hosts booted with systemd-nspawn (needs root)."""


@lab.command("up")
@click.option("--extra", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Add N more eval-style hosts (for scale tests).")
@click.pass_obj
def lab_up(obj: Context, extra: int) -> None:
    """Build (once) and boot the lab hosts; safe to re-run."""
    from .lab import lab_up as up

    states = up(obj.inventory_path, extra=extra, progress=_progress)
    stdout_console().print(lab_table(states))


@lab.command("down")
def lab_down() -> None:
    """Power the lab hosts off cleanly."""
    from .lab import lab_down as down

    stdout_console().print(lab_table(down(progress=_progress)))


@lab.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def lab_status(as_json: bool) -> None:
    """List the lab hosts and whether they run."""
    from .lab import lab_status as list_hosts

    states = list_hosts()
    if as_json:
        click.echo(json.dumps([as_dict(s) for s in states], indent=2, default=str))
    else:
        stdout_console().print(lab_table(states))


def _late_global_option(field: str):
    """A global option given after the command: it overrides (or, for -v, adds to) the one before it."""
    def store(ctx: click.Context, param: click.Parameter, value) -> None:
        if value in (None, False, 0):
            return
        obj = ctx.find_object(Context)
        if field == "verbose":
            value += obj.verbose
        setattr(obj, field, value)
    return store


def _accept_global_options_after(group: click.Group) -> None:
    """Give every command below `group` the global options too."""
    for command in group.commands.values():
        command.params += [click.Option(list(decls), expose_value=False, callback=_late_global_option(field),
                                        **settings) for decls, field, settings in GLOBAL_OPTIONS]
        if isinstance(command, click.Group):
            _accept_global_options_after(command)


_accept_global_options_after(cli)


def _progress(message: str) -> None:
    err_console.print(f"[bold blue]-->[/] {message}", soft_wrap=True)  # one line in a log, never wrapped at 80


def main() -> None:
    """Entry point: known errors become one red line and their exit code, never a traceback."""
    verbose = sum(a.count("v") for a in sys.argv[1:] if a.startswith("-") and set(a[1:]) == {"v"})
    verbose += sys.argv.count("--verbose")
    # paramiko logs each failed handshake with a traceback; ddops reports it as one line instead.
    logging.basicConfig(level=logging.DEBUG if verbose >= 2 else logging.WARNING, format="%(name)s: %(message)s")
    if verbose < 2:
        logging.getLogger("paramiko").setLevel(logging.CRITICAL + 1)
    try:
        cli.main(standalone_mode=False, prog_name="ddops")
    except click.exceptions.Abort:
        err_console.print("[red]aborted[/]")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except DdopsError as exc:
        if verbose >= 2:
            traceback.print_exc()
        err_console.print(f"[bold red]error:[/] {exc.line()}", soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/]")
        sys.exit(130)
    except Exception:  # noqa: BLE001 - the boundary: a bug gets a log file, not a wall of text
        if verbose >= 2:
            traceback.print_exc()
        fd, log = tempfile.mkstemp(prefix="ddops-crash-", suffix=".log")
        with os.fdopen(fd, "w") as fh:
            traceback.print_exc(file=fh)
        err_console.print(f"[bold red]internal error:[/] {sys.exc_info()[1]!r} — details in {log}; "
                          "please report it with that file")
        sys.exit(EXIT_INTERNAL)

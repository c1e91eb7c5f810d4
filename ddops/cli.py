"""The ddops command line: thin click commands over the library, and the one error boundary."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import click
from rich.console import Console

from . import __version__
from .errors import EXIT_FAILED, DdopsError
from .executor import Executor
from .inventory import Inventory, default_inventory_path, load_inventory

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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-i", "--inventory", "inventory_path", type=click.Path(path_type=Path),
              default=None, help="Inventory file [default: $DDOPS_INVENTORY, then inventories/lab.yaml].")
@click.option("--limit", metavar="HOSTS", help="Comma list of hosts or groups to act on.")
@click.option("--accept-new-host-keys", is_flag=True,
              help="Trust and record a host key seen for the first time (like accept-new). "
                   "A changed key is always refused.")
@click.option("-v", "--verbose", count=True, help="More output; -vv shows tracebacks.")
@click.version_option(__version__, prog_name="ddops")
@click.pass_context
def cli(ctx: click.Context, inventory_path: Path | None, limit: str | None,
        accept_new_host_keys: bool, verbose: int) -> None:
    """Fleet ops for GPU hosts that train and serve speculative-decoding LLMs.

    Exit codes: 0 ok, 2 user/config error or a failed step, 4 a host unreachable.
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
            with err_console.status(f"Gathering facts from {len(hosts)} host(s)..."):
                records = collect(executor, hosts)
            render(records, Console(highlight=False))
    sys.exit(exit_code(records))


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
    _print_lab(states)


@lab.command("down")
def lab_down() -> None:
    """Power the lab hosts off cleanly."""
    from .lab import lab_down as down

    _print_lab(down(progress=_progress))


@lab.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def lab_status(as_json: bool) -> None:
    """List the lab hosts and whether they run."""
    from .lab import lab_status as list_hosts

    states = list_hosts()
    if as_json:
        click.echo(json.dumps([_as_dict(s) for s in states], indent=2, default=str))
    else:
        _print_lab(states)


def _as_dict(state: object) -> dict:
    from dataclasses import asdict, is_dataclass

    return asdict(state) if is_dataclass(state) else dict(vars(state))


def _print_lab(states: list) -> None:
    from rich.table import Table

    table = Table(title="ddops lab")
    for column in ("host", "ssh port", "pid", "running", "sshd"):
        table.add_column(column)
    for s in states:
        d = _as_dict(s)
        table.add_row(str(d.get("name")), str(d.get("port")), str(d.get("pid") or "-"),
                      "yes" if d.get("running") else "no", "answers" if d.get("sshd_ok") else "-")
    Console(highlight=False).print(table)


def _progress(message: str) -> None:
    err_console.print(f"[bold blue]-->[/] {message}")


def main() -> None:
    """Entry point: known errors become one red line and their exit code, never a traceback."""
    verbose = sum(a.count("v") for a in sys.argv[1:] if a.startswith("-") and set(a[1:]) == {"v"})
    verbose += sys.argv.count("--verbose")
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
        sys.exit(EXIT_FAILED + 1)

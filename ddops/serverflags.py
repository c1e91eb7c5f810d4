"""The flags a unit passes, checked against the server that will run it: its own `--help`.

Which server: the runtime this checkout ships (`runtime.ship`) when the profile ships one, since that is
the release the unit will run whatever the host has now (a pivot may install it only after preflight,
and preflight must refuse before anything changes), read by running its `--help` here; otherwise the
host's installed server (`VENV/bin/ddtree-serve`, or SGLang's `python -m sglang.launch_server`), run
with `--help` on the host. argparse's help lists every option at the start of a line.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

from .executor import Executor
from .facts import ServerFlags
from .inventory import Host
from .profile import Profile

HELP_TIMEOUT_S = 180.0   # SGLang imports torch before it prints its help
# An option line in argparse's help: up to 8 spaces, then the option strings (`-h, --help`, `--port PORT`).
_OPTION_LINE = re.compile(r"^ {0,8}(-{1,2}[A-Za-z0-9].*)$")
_LONG_FLAG = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_-]*")


def parse_help(text: str) -> frozenset[str]:
    """The long flags an argparse `--help` text lists (aliases and `--no-x` forms included)."""
    flags = set()
    for line in text.splitlines():
        match = _OPTION_LINE.match(line)
        if not match:
            continue
        invocation = re.split(r" {2,}", match.group(1).strip(), maxsplit=1)[0]  # help text starts after 2 spaces
        for part in invocation.split(", "):
            word = part.split(" ", 1)[0].split("=", 1)[0]
            if _LONG_FLAG.fullmatch(word):
                flags.add(word)
    return frozenset(flags)


def unit_flags(argv: list[str]) -> list[str]:
    """The long flags in a unit's command line, in order (`--x=v` as `--x`); the program is skipped."""
    return list(dict.fromkeys(a.split("=", 1)[0] for a in argv[1:] if _LONG_FLAG.match(a)))


def server_name(profile: Profile) -> str:
    return "SGLang's launch_server" if profile.engine == "sglang" else "ddtree-serve"


def help_argv(profile: Profile) -> list[str]:
    """The host's own server, asked for its help."""
    if profile.engine == "sglang":
        return [profile.sglang.python, "-m", "sglang.launch_server", "--help"]
    return [f"{profile.runtime.venv}/bin/ddtree-serve", "--help"]


def ships_server(profile: Profile) -> bool:
    return profile.engine == "ddtree" and profile.runtime.ship is not None


def host_flags(executor: Executor, host: Host, profile: Profile) -> ServerFlags:
    """The installed server's flags, from its `--help` run on the host."""
    argv = help_argv(profile)
    source = f"{server_name(profile)} installed on {host.name}"
    result = executor.run(host, argv, timeout=HELP_TIMEOUT_S)
    if result.exit_code != 0:
        detail = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1][:200]
        return ServerFlags(source=source, error=f"`{' '.join(argv)}` exit {result.exit_code}: {detail}",
                           missing=result.exit_code == 127 or "No such file" in detail)
    return _parsed(source, result.stdout)


@functools.lru_cache(maxsize=8)
def shipped_flags(ship: str, release: str | None) -> ServerFlags:
    """The shipped runtime's flags: its own `ddtree-serve --help`, run here from the sources the wheel is
    built from (cached per release: the same sources print the same help)."""
    source = f"ddtree-serve of the runtime shipped from {ship}" + (f" (release {release})" if release else "")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ship, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        done = subprocess.run([sys.executable, "-m", "ddtree_runtime.server", "--help"], capture_output=True,
                              text=True, timeout=HELP_TIMEOUT_S, cwd=ship, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ServerFlags(source=source, error=str(exc))
    if done.returncode != 0:
        detail = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1][:200]
        return ServerFlags(source=source, error=f"its --help exit {done.returncode} here: {detail}")
    return _parsed(source, done.stdout)


def _parsed(source: str, text: str) -> ServerFlags:
    flags = parse_help(text)
    if "--help" not in flags:
        return ServerFlags(source=source, error="its --help printed no argparse option list")
    return ServerFlags(source=source, flags=flags)


def check_flags(profile: Profile, argv: list[str], server: ServerFlags | None) -> list[str]:
    """Preflight's problems: a flag the unit passes that the server lacks, named; or a server that cannot
    be asked. A ddtree venv without the runtime yet, which the deps step installs, is not a problem."""
    if server is None:
        return []
    if server.error is not None:
        if server.missing and profile.engine == "ddtree" and "ddtree_runtime" in profile.runtime.packages:
            return []   # installed later by the deps step; the health gate sees a bad flag then
        return [f"cannot check the unit's flags against {server.source}: {server.error}"]
    lacking = [f for f in unit_flags(argv) if f not in server.flags]
    if not lacking:
        return []
    extra = set(profile.sglang.extra_args if profile.engine == "sglang" else profile.serve.extra_args)
    named = ", ".join(f + (" (from extra_args)" if f in extra else "") for f in lacking)
    return [f"{server.source} has no {'flag' if len(lacking) == 1 else 'flags'} {named}, which the unit passes; "
            f"remove {'it' if len(lacking) == 1 else 'them'} from the profile or install a server that has "
            f"{'it' if len(lacking) == 1 else 'them'}"]


def summary(server: ServerFlags | None, argv: list[str]) -> str:
    """For preflight's line: what the flags were checked against."""
    if server is None or server.error is not None:
        return "unit flags not checked (the server is installed later)" if server else ""
    return f"{len(unit_flags(argv))} unit flags checked against {server.source}"

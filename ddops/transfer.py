"""Moving files with rsync over SSH, between the control machine and one host, as the executor reaches
it (same key, port and known_hosts; `pct` hosts through their node). Used by the sync and deps steps
and the demo; below the steps."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tempfile
from typing import Sequence

from .errors import StepFailed
from .inventory import Host, Inventory


def ssh_argv(host: Host) -> list[str]:
    """OpenSSH options that reach `host` as the executor does (same key, port, known_hosts)."""
    argv = ["ssh", "-p", str(host.port), "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={max(1, int(host.connect_timeout))}",
            # A host that stops answering mid-transfer drops the connection instead of hanging it.
            "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]
    if host.key:
        argv += ["-i", os.path.expanduser(host.key)]
    if host.known_hosts:
        argv += ["-o", f"UserKnownHostsFile={os.path.expanduser(host.known_hosts)}"]
    argv += ["-o", "StrictHostKeyChecking=" + ("accept-new" if host.host_key_policy == "accept-new" else "yes")]
    return argv


def remote(inventory: Inventory, host: Host) -> tuple[list[str], str, str | None]:
    """(rsync -e argv, user@address, --rsync-path) to reach host; `pct` hosts go through their node."""
    carrier = inventory.hosts[host.via] if host.pct is not None else host
    argv = ssh_argv(carrier)
    if carrier.via is not None:  # a jump host: ProxyCommand through it with its own options
        jump = inventory.hosts[carrier.via]
        argv += ["-o", "ProxyCommand=" + shlex.join(ssh_argv(jump) + ["-W", "%h:%p", _login(jump)])]
    rsync_path = shlex.join(["pct", "exec", str(host.pct), "--", "rsync"]) if host.pct is not None else None
    return argv, _login(carrier), rsync_path


def _login(host: Host) -> str:
    return f"{host.user}@{host.address}" if host.user else str(host.address)


def rsync_argv(inventory: Inventory, src: str, dst: str, *, src_host: Host | None = None,
               dst_host: Host | None = None, checksum_dry_run: bool = False, mirror: bool = True,
               options: Sequence[str] = ()) -> list[str]:
    """rsync from src to dst (each on the control machine when its host is None); one side remote.
    `mirror`: files dst has and src lacks are deleted; `options`: more of rsync's (ownership, --link-dest)."""
    if src_host is not None and dst_host is not None:
        raise ValueError("rsync copies between the control machine and one host")
    side = src_host or dst_host
    # No --partial: an interrupted transfer must never put a truncated file where a good one was.
    # --delay-updates and --delete-after keep the previous files in place until every new one has
    # arrived, so a sync that fails part-way (disk full, host gone) leaves the old model dir as it was.
    argv = ["rsync", "-a"] + (["--delete-after"] if mirror else []) + ["--delay-updates", *options]
    if side is not None:  # an I/O timeout: a remote side that stops answering fails the sync
        argv.append(f"--timeout={max(5, int(side.command_timeout))}")
    argv += ["--checksum", "--dry-run", "--itemize-changes"] if checksum_dry_run else ["--info=progress2",
                                                                                      "--no-inc-recursive"]
    if side is not None:
        ssh, login, rsync_path = remote(inventory, side)
        argv += ["-e", shlex.join(ssh)]
        if rsync_path:
            argv += ["--rsync-path", rsync_path]
    src_spec = f"{login}:{src.rstrip('/')}/" if src_host else f"{src.rstrip('/')}/"
    dst_spec = f"{login}:{dst.rstrip('/')}/" if dst_host else f"{dst.rstrip('/')}/"
    return argv + ["--", src_spec, dst_spec]


_PCT = re.compile(r"(\d+)%")
# What rsync's exit status means (its man page): the remote side's own message may be lost when
# rsync tears its ssh down, so the status alone must say enough.
RSYNC_EXIT = {1: "syntax or usage error", 5: "error starting the client-server protocol",
              10: "error in socket I/O", 11: "file I/O error (destination disk full or read-only?)",
              12: "protocol data stream broke (connection lost?)", 20: "interrupted",
              23: "partial transfer (some files could not be read or written)", 24: "source files vanished",
              30: "timeout: the other side stopped answering", 35: "timeout waiting for the connection",
              255: "ssh failed (host unreachable, or its key refused)"}


def rsync_failure(code: int, stderr: str) -> str:
    meaning = RSYNC_EXIT.get(code, "failed")
    detail = " | ".join(line.strip() for line in stderr.strip().splitlines()[-3:] if line.strip())
    return f"rsync exit {code}: {meaning}" + (f": {detail[-300:]}" if detail else "")


def rsync(argv: list[str], progress, what: str, timeout: float = 6 * 3600) -> str:
    """Run rsync locally, feeding its percentage to progress; returns stdout."""
    errfile = tempfile.TemporaryFile()  # a file, not a pipe: a chatty rsync can never block on it
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errfile, text=False)
    out = bytearray()
    reported = None  # rsync repeats a percentage many times: say each one once
    try:
        while True:
            chunk = proc.stdout.read1(4096) if hasattr(proc.stdout, "read1") else proc.stdout.read(4096)
            if not chunk:
                break
            out += chunk
            found = _PCT.findall(chunk.decode(errors="replace"))
            if found and found[-1] != reported:
                reported = found[-1]
                progress(f"{what}: {reported}%")
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    errfile.seek(0)
    err = errfile.read().decode(errors="replace")
    errfile.close()
    if proc.returncode != 0:
        raise StepFailed(f"{what}: {rsync_failure(proc.returncode, err)}",
                         fix="the destination's previous files are intact; fix the cause and re-run")
    return out.decode(errors="replace")


def verify(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=6 * 3600)
    if done.returncode != 0:
        raise StepFailed(f"verifying {what}: {rsync_failure(done.returncode, done.stderr)}")
    pending = [line for line in done.stdout.splitlines() if line.strip() and not line.startswith(".d")]
    if pending:
        raise StepFailed(f"verifying {what}: {len(pending)} file(s) still differ after the sync: "
                         f"{'; '.join(pending[:3])}")

"""Run commands on inventory hosts over SSH: one code path for direct, jump-host and `pct` hosts.

Every remote command is an argv list quoted with `shlex.join`; every connect, command and
join has a timeout; fan-out returns a per-host outcome so one dead host never hides the others.
"""

from __future__ import annotations

import math
import os
import select
import shlex
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, Iterable, TypeVar

import paramiko
from fabric import Connection

from .errors import DdopsError, HostUnreachable
from .inventory import Host, Inventory

T = TypeVar("T")
EOF_GRACE_S = 2.0   # how long output may trail a command's exit status
CLOSE_TIMEOUT_S = 5.0   # how long close() waits for all connections together (a frozen host never answers)
Argv = list[str]


class CommandTimeout(DdopsError):
    """A remote command ran past its timeout; the channel was closed."""


class HostKeyError(HostUnreachable):
    """The host's key is unknown or changed: refusing to talk to it."""


@dataclass(frozen=True)
class CommandResult:
    host: str
    command: str
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def check(self, what: str) -> "CommandResult":
        """Raise a DdopsError naming the host and the last lines of output when the command failed."""
        if not self.ok:
            detail = (self.stderr.strip() or self.stdout.strip()).splitlines()[-3:]
            raise DdopsError(f"{what} failed on {self.host} (exit {self.exit_code}): {' | '.join(detail)}")
        return self


@dataclass
class Outcome(Generic[T]):
    """What happened on one host: a value, or the error that stopped it."""

    host: str
    value: T | None = None
    error: DdopsError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def unreachable(self) -> bool:
        return isinstance(self.error, HostUnreachable)


def remote_command(host: Host, argv: Argv) -> str:
    """The command line to send over SSH; `pct` hosts are wrapped to run inside their container."""
    if not argv:
        raise ValueError("empty argv")
    inner = shlex.join(argv)
    if host.pct is None:
        return inner
    return shlex.join(["pct", "exec", str(host.pct), "--", "bash", "-lc", inner])


class _AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """Like OpenSSH's StrictHostKeyChecking=accept-new: trust and record a key seen for the first time."""

    _lock = threading.Lock()

    def __init__(self, known_hosts: Path) -> None:
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key) -> None:
        with self._lock:
            self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
            with self.known_hosts.open("a") as fh:
                fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


class Executor:
    """Connections for one ddops run: opened lazily, shared by the hosts that jump through them."""

    def __init__(self, inventory: Inventory, *, accept_new_host_keys: bool = False,
                 max_parallel: int = 16) -> None:
        self.inventory = inventory
        self.accept_new_host_keys = accept_new_host_keys
        self.max_parallel = max_parallel
        self._connections: dict[str, Connection] = {}
        self._locks: dict[str, threading.Lock] = {name: threading.Lock() for name in inventory.hosts}
        # Guards _connections and _closed: a fan-out worker past its deadline may still connect or
        # drop a connection while close() runs.
        self._registry = threading.Lock()
        self._closed = False

    # -- connections ---------------------------------------------------------------------------

    def _known_hosts(self, host: Host) -> Path:
        return Path(os.path.expanduser(host.known_hosts or "~/.ssh/known_hosts"))

    def connection(self, host: Host) -> Connection:
        """An open connection to `host` itself (for a `pct` host use `_carrier`)."""
        with self._locks[host.name]:
            with self._registry:
                conn = self._connections.get(host.name)
            if conn is None or not conn.is_connected:
                conn = self._open(host)
                with self._registry:
                    closed = self._closed
                    if not closed:
                        self._connections[host.name] = conn
                if closed:  # a worker that outlived its fan-out: the run is over, leave nothing open
                    _close_quietly(conn)
                    raise HostUnreachable(f"{host.name} answered after this run had stopped waiting for it")
            return conn

    def _open(self, host: Host) -> Connection:
        gateway = self.connection(self.inventory.hosts[host.via]) if host.via else None
        connect_kwargs = {
            "banner_timeout": host.connect_timeout,
            "auth_timeout": host.connect_timeout,
            "channel_timeout": host.connect_timeout,
        }
        if host.key:
            connect_kwargs["key_filename"] = [os.path.expanduser(host.key)]
        conn = Connection(host.address, user=host.user, port=host.port, gateway=gateway,
                          connect_timeout=max(1, math.ceil(host.connect_timeout)),
                          connect_kwargs=connect_kwargs)
        known_hosts = self._known_hosts(host)
        client = conn.client
        client.load_system_host_keys()
        if known_hosts.exists():
            client.load_system_host_keys(str(known_hosts))
        policy = (_AcceptNewPolicy(known_hosts)
                  if self.accept_new_host_keys or host.host_key_policy == "accept-new"
                  else paramiko.RejectPolicy())
        client.set_missing_host_key_policy(policy)
        try:
            conn.open()
        except Exception as exc:  # noqa: BLE001 - every failure becomes one plain sentence
            raise _connect_error(host, exc, known_hosts) from None
        return conn

    def _carrier(self, host: Host) -> Connection:
        """The connection a host's commands travel on: its node's for `pct`, its own otherwise."""
        if host.pct is not None:
            return self.connection(self.inventory.hosts[host.via])
        return self.connection(host)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Close every connection, waiting at most `timeout` in all: a frozen host's transport may never
        finish closing, and workers still running may connect or drop connections meanwhile."""
        with self._registry:
            self._closed = True
            connections = list(self._connections.values())
            self._connections.clear()
        if not connections:
            return
        closers = [threading.Thread(target=_close_quietly, args=(conn,), daemon=True, name="ddops-close")
                   for conn in connections]
        for closer in closers:
            closer.start()
        deadline = time.monotonic() + timeout
        for closer in closers:
            closer.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- commands ------------------------------------------------------------------------------

    def run(self, host: Host, argv: Argv, *, timeout: float | None = None,
            stdin: bytes | str | None = None,
            on_output: Callable[[str], None] | None = None) -> CommandResult:
        """Run argv on host; returns its result whatever the exit code; raises on timeout/unreachable."""
        command = remote_command(host, argv)
        timeout = timeout if timeout is not None else host.command_timeout
        conn = self._carrier(host)
        start = time.monotonic()
        try:
            channel = conn.client.get_transport().open_session(timeout=host.connect_timeout)
        except Exception as exc:  # noqa: BLE001
            self._drop(host)
            raise HostUnreachable(f"lost the SSH connection to {host.name} ({host.label}): {_reason(exc)}",
                                  fix="check the host is up, then retry") from None
        try:
            channel.exec_command(command)
            if stdin is not None:
                channel.sendall(stdin.encode() if isinstance(stdin, str) else stdin)
            channel.shutdown_write()
            stdout, stderr = _drain(channel, start + timeout, on_output, host, argv)
            exit_code = channel.recv_exit_status()
        except CommandTimeout:
            self._drop(host)  # the connection may be wedged (a frozen host): the next command reconnects
            raise
        except (socket.error, paramiko.SSHException, EOFError) as exc:
            self._drop(host)
            raise HostUnreachable(f"SSH connection to {host.name} broke during `{_short(argv)}`: "
                                  f"{_reason(exc)}", fix="check the host is up, then retry") from None
        finally:
            channel.close()
        return CommandResult(host=host.name, command=command, exit_code=exit_code,
                             stdout=stdout, stderr=stderr, duration_s=time.monotonic() - start)

    def _drop(self, host: Host) -> None:
        carrier = self.inventory.hosts[host.via] if host.pct is not None else host
        with self._registry:
            conn = self._connections.pop(carrier.name, None)
        if conn is not None:
            _close_quietly(conn)

    # -- fan-out -------------------------------------------------------------------------------

    def fan_out(self, hosts: Iterable[Host], work: Callable[[Host], T], *,
                deadline_s: float | None = None) -> dict[str, Outcome[T]]:
        """Run work(host) on each host in parallel (bounded); every host gets an Outcome, in order."""
        hosts = list(hosts)
        outcomes: dict[str, Outcome[T]] = {h.name: Outcome(h.name) for h in hosts}
        if not hosts:
            return outcomes

        def one(host: Host) -> None:
            try:
                outcomes[host.name].value = work(host)
            except DdopsError as exc:
                outcomes[host.name].error = exc
            except Exception as exc:  # noqa: BLE001 - a bug on one host must not sink the others
                outcomes[host.name].error = DdopsError(f"{host.name}: unexpected {exc.__class__.__name__}: {exc}")

        if deadline_s is None:
            deadline_s = max(h.connect_timeout * (1 + len(self.inventory.chain(h))) + h.command_timeout
                             for h in hosts) + 5
        pool = ThreadPoolExecutor(max_workers=min(self.max_parallel, len(hosts)), thread_name_prefix="ddops")
        futures = {pool.submit(one, h): h for h in hosts}
        _, pending = wait(futures, timeout=deadline_s)
        for future in pending:
            host = futures[future]
            outcomes[host.name].error = HostUnreachable(
                f"{host.name} did not answer within {deadline_s:.0f}s", fix="check the host and the network")
        pool.shutdown(wait=False, cancel_futures=True)
        return outcomes


def _close_quietly(conn: Connection) -> None:
    """Close a connection; closing a dead one must not mask the error that killed it."""
    try:
        conn.close()
    except Exception:  # noqa: BLE001
        pass


def _drain(channel: paramiko.Channel, deadline: float, on_output: Callable[[str], None] | None,
           host: Host, argv: Argv) -> tuple[str, str]:
    """Read stdout and stderr until the command exits or the deadline passes."""
    out, err = bytearray(), bytearray()
    exited_at: float | None = None
    while True:
        progressed = False
        while channel.recv_ready():
            chunk = channel.recv(65536)
            out += chunk
            progressed = True
            if on_output:
                on_output(chunk.decode(errors="replace"))
        while channel.recv_stderr_ready():
            err += channel.recv_stderr(65536)
            progressed = True
        # The exit status can arrive while output is still in flight (a relayed command: `pct exec`,
        # a jump host): stop at the remote's EOF, not at the exit status, or the output is cut short.
        # A command that left a child holding stdout gets EOF_GRACE_S after its exit, not the timeout.
        if channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready():
            exited_at = exited_at or time.monotonic()
            if channel.eof_received or time.monotonic() - exited_at > EOF_GRACE_S:
                break
        if channel.closed and not progressed:
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CommandTimeout(f"`{_short(argv)}` on {host.name} ran past its timeout",
                                 fix="raise command_timeout in the inventory if the host is just slow")
        if not progressed:
            select.select([channel], [], [], min(remaining, 0.5))
    return out.decode(errors="replace"), err.decode(errors="replace")


def _short(argv: Argv, limit: int = 60) -> str:
    text = shlex.join(argv)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or exc.__class__.__name__
    return text.splitlines()[0]


def _connect_error(host: Host, exc: BaseException, known_hosts: Path) -> DdopsError:
    """Turn a paramiko/socket failure into one sentence with the fix."""
    if isinstance(exc, DdopsError):
        return exc
    target = f"[{host.address}]:{host.port}" if host.port != 22 else str(host.address)
    if isinstance(exc, paramiko.BadHostKeyException):
        return HostKeyError(
            f"host key for {host.name} ({target}) has CHANGED: refusing to connect",
            fix=f"if you trust the new key: ssh-keygen -f {known_hosts} -R '{target}'")
    if isinstance(exc, paramiko.SSHException) and "not found in known_hosts" in str(exc):
        return HostKeyError(
            f"host key for {host.name} ({target}) is unknown (not in {known_hosts})",
            fix="verify it and add it with ssh-keyscan, or rerun with --accept-new-host-keys")
    if isinstance(exc, paramiko.AuthenticationException):
        return HostUnreachable(f"authentication failed for {host.name} ({host.label})",
                               fix="check `user` and `key` in the inventory, or your ssh-agent")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return HostUnreachable(f"cannot reach {host.name} ({host.label}): timed out after "
                               f"{host.connect_timeout:g}s", fix="is the host up and the address right?")
    return HostUnreachable(f"cannot reach {host.name} ({host.label}): {_reason(exc)}",
                           fix="is the host up and sshd running on that port?")

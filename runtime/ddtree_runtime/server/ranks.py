"""The processes of a tensor-parallel server: one tree under one systemd unit. Rank 0 is the server: it
starts a follower per other rank (the same command line, the rank in the environment), serves HTTP and
steps its engine as the `Leader` (engine/distributed.py); the followers only follow its calls.

All ranks live and die together, so systemd's restart and the health gate see one server: a watchdog
thread in rank 0 stops the server (exit 1, one log line) as soon as a follower exits, or when an engine
call has waited on the other ranks past --rank-timeout (a follower stopped or hung blocks the collectives
without failing them: the line names a follower that is stopped), and kills the others; a follower exits
when rank 0 is gone (its parent changed). A follower ignores SIGTERM and SIGINT
(systemd and a terminal send them to the whole tree): rank 0 drains, then ends them."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from ddtree_runtime.server.config import ServerConfig

if TYPE_CHECKING:
    from ddtree_runtime.engine.distributed import Leader

log = logging.getLogger("ddtree_runtime.server")

WATCH_S = 0.2        # how often rank 0 looks at its followers, and a follower at its parent
LOST_WAIT_S = 2.0    # a collective failed: how long rank 0 waits to see which follower exited
STOP_WAIT_S = 10.0   # at a clean stop, how long rank 0 waits for a killed follower to be reaped
# How rank 0 tells a process it starts its place: its rank, the rendezvous port, rank 0's pid.
RANK_ENV, PORT_ENV, LEADER_ENV = "DDTREE_TP_RANK", "DDTREE_TP_PORT", "DDTREE_TP_LEADER_PID"
# Every process of the tree: NVLink multicast off (the GPU hosts' documentation requires it).
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0"}


def rank() -> int:
    """This process's rank: 0 unless rank 0 started it."""
    return int(os.environ.get(RANK_ENV, "0"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_words(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


class Followers:
    """Rank 0's followers: started, watched, and ended with the server."""

    def __init__(self, argv: list[str], world: int, call_timeout_s: float) -> None:
        self.argv, self.world, self.call_timeout_s = argv, world, call_timeout_s
        self.leader: Leader | None = None  # rank 0's engine once loaded: its calls are watched too
        self.procs: dict[int, subprocess.Popen] = {}
        self._stopping = False
        self._ending = threading.Lock()  # held by the one fatal() that speaks

    def start(self) -> None:
        """Start ranks 1..world-1 and the watchdog; this process (rank 0) joins the same rendezvous."""
        os.environ.update(CHILD_ENV, **{PORT_ENV: str(_free_port()), RANK_ENV: "0", LEADER_ENV: str(os.getpid())})
        for r in range(1, self.world):
            env = {**os.environ, RANK_ENV: str(r)}
            self.procs[r] = subprocess.Popen([sys.executable, "-m", "ddtree_runtime.server", *self.argv], env=env)
        log.info("tensor parallel: rank 0 (pid %d) and followers %s", os.getpid(),
                 ", ".join(f"rank {r} (pid {p.pid})" for r, p in self.procs.items()))
        threading.Thread(target=self._watch, name="ddtree-ranks", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping:
            gone = self._exited() or self._stalled()
            if gone and not self._stopping:
                self.fatal(gone)
            time.sleep(WATCH_S)

    def _exited(self) -> str | None:
        for r, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return f"tensor-parallel rank {r} (pid {proc.pid}) exited with {_exit_words(code)}"
        return None

    def _stalled(self) -> str | None:
        """Why the ranks are stalled: the Leader's call has waited past the timeout (naming the followers
        that are stopped, if any are); None otherwise."""
        call = self.leader.in_call if self.leader is not None else None
        if call is None or time.monotonic() - call[1] < self.call_timeout_s:
            return None
        stopped = [f"tensor-parallel rank {r} (pid {p.pid}) is stopped" for r, p in self.procs.items()
                   if _process_state(p.pid) in ("T", "t")]
        return (f"{', '.join(stopped) or 'a tensor-parallel rank is stuck'}: a {call[0]} waited on the ranks "
                f"for more than {self.call_timeout_s:g} s (--rank-timeout)")

    def lost(self, why: str) -> NoReturn:
        """The Leader cannot reach the other ranks (or they disagree): name the follower that died, if one
        did (it is the cause; the collective's error is only its echo), else the first line of `why`."""
        deadline = time.monotonic() + LOST_WAIT_S
        while time.monotonic() < deadline:
            gone = self._exited()
            if gone:
                self.fatal(gone)
            time.sleep(WATCH_S / 4)
        self.fatal(why.strip().splitlines()[0])

    def fatal(self, why: str) -> NoReturn:
        """A rank is lost: the whole server stops now, non-zero (never serving with part of its ranks).
        The first caller (the watchdog or the Leader) says why; a second waits for the exit."""
        self._ending.acquire()
        self._stopping = True
        log.error("%s: stopping the server (its %d ranks serve together or not at all)", why, self.world)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)

    def stop(self) -> None:
        """The server stopped cleanly: end the followers."""
        self._stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel follower pid %d did not end", proc.pid)


def end_process(code: int) -> NoReturn:
    """End a rank's process now, with `code`, its output flushed. A process that joined the ranks does
    not return through the interpreter's exit: torch.distributed's threads are then destroyed still
    joinable, which aborts it ("terminate called without an active exception", SIGABRT), and systemd
    would see a clean stop as a failure."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_followers: Followers | None = None  # this process's, when it is rank 0 of a tensor-parallel server


def _process_state(pid: int) -> str:
    """The process's state letter from /proc (R, S, D, T when stopped...); "" if it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def start_followers(argv: list[str], world: int, call_timeout_s: float) -> Followers:
    global _followers
    _followers = Followers(argv, world, call_timeout_s)
    _followers.start()
    return _followers


def lead(config: ServerConfig) -> Leader:
    """Rank 0's engine (the worker's factory): join the followers, load this rank's shard, and wrap the
    engine so that every call reaches them. If that fails the followers are ended and the worker reports
    the error (/health), as a one-device server does."""
    from ddtree_runtime.engine import Engine, EngineConfig
    from ddtree_runtime.engine.distributed import Leader, join

    if _followers is None:
        raise RuntimeError("tensor parallel: rank 0's followers were not started (server/cli.py starts them)")
    try:
        tp, engine_config = join(EngineConfig(**config.engine_kwargs()), 0, int(os.environ[PORT_ENV]))
        leader = Leader(Engine(engine_config), tp, _followers.lost)
        _followers.leader = leader
        return leader
    except Exception:  # /health reports it, as when one device serves; the followers would wait forever
        _followers.stop()
        raise


def follow(config: ServerConfig) -> int:
    """A follower's main: join, load this rank's shard, follow rank 0 until it goes (exit 1: a follower
    only ends when rank 0 ended it or is gone)."""
    from ddtree_runtime.engine import Engine, EngineConfig
    from ddtree_runtime.engine.distributed import follow as follow_calls, join

    me = rank()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    try:
        watch_leader(me)
        tp, engine_config = join(EngineConfig(**config.engine_kwargs()), me, int(os.environ[PORT_ENV]))
        engine = Engine(engine_config)
        log.info("rank %d ready", me)
        follow_calls(engine, tp)
        return 0
    except Exception as exc:  # noqa: BLE001 - one line; rank 0's watchdog stops the server
        log.error("tensor-parallel rank %d stops: %s: %s", me, type(exc).__name__, exc)
        return 1


def watch_leader(me: int) -> None:
    """A follower exits (1, one line) once rank 0, its parent, is gone: a thread watching its parent pid
    against rank 0's (from the environment, so a rank 0 that died before this ran is seen too)."""
    leader = int(os.environ[LEADER_ENV])
    threading.Thread(target=_watch_parent, args=(leader, me), name="ddtree-leader", daemon=True).start()


def _watch_parent(leader: int, me: int) -> None:
    while os.getppid() == leader:
        time.sleep(WATCH_S)
    log.error("tensor-parallel rank %d: rank 0 (pid %d) is gone: exiting", me, leader)
    os._exit(1)

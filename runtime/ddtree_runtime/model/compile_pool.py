"""A warm-up's Triton compiles made at once, in worker processes, not one after another.

On a host's first start (an empty Triton cache) most of the warm-up is Triton compiling: 64-72 s of the
27B's 85-94 s on an H200, 59 of its 89 compiles fla-core's autotuning candidates (docs/performance.md).
Triton's compiler holds the GIL through its MLIR passes, so threads would not overlap them; processes do.
Inside `parallel_compiles()`:
- when an autotuner is about to time its candidates, each candidate's compile inputs are taken through
  Triton's own launch path (the kernel run with warmup=True, its compile intercepted before anything is
  built), compiled by the pool into the shared cache directory (compile_worker.py), and the autotuner
  then finds every one of them there;
- every compile the warm-up makes is recorded (RECORD, in the cache directory), and a later start over a
  cache that lacks some of them (a Triton upgrade, a changed kernel, a record from a host of another GPU
  model) has the pool compile those at once before its warm-up runs;
- a cache with no record of its own takes the record shipped with the runtime for its model's shape
  (SHIPPED: made by a warm-up on an H200), so even the fleet's first start of a known shape compiles at
  once. A shipped compile the model does not need only costs a worker's time.
The workers take 14-17 s to start on the H200's host (their interpreter, torch and fla-core: measured
with `compile_pool_bench.py`), so `start_early()`, called as the engine is built, starts them and the
record's compiles while the weights load, and the warm-up takes that pool over.
What a worker refuses or fails the server compiles itself, as before. The workers are plain
subprocesses, not multiprocessing's: those import the parent's main script again, and a script that
builds an engine at its top level would load the model in each."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from queue import Empty, SimpleQueue
from types import ModuleType

from .. import compile_worker
from .config import Qwen35Config, Qwen3Config

log = logging.getLogger(__name__)

WORKERS_ENV = "DDTREE_COMPILE_WORKERS"   # how many processes compile (0: none, the server compiles alone)
RECORD = "ddtree-compiles.pkl"           # in Triton's cache directory: what the last warm-up compiled
# the launch options a kernel's caller sets; the rest of a compile's options Triton derives from the GPU
LAUNCH_OPTIONS = ("num_warps", "num_ctas", "num_stages", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
                  "launch_pdl", "debug", "sanitize_overflow")
TIMING = {"warmup": 5, "rep": 25}        # ms an autotuner's candidate is timed for in a warm-up (Triton: 25, 100)
SHIPPED = os.path.join(os.path.dirname(__file__), "compile_records")   # shipped records, by record_name()
MAX_WORKERS = 8
BATCH_TIMEOUT_S = 300.0                  # one autotuner's candidates: seconds of compiles, never minutes
_PENDING = "_ddtree_candidates"          # an autotuner's pruned configs, kept until its first timing run
_SIMPLE = (bool, int, float, str, type(None))


def default_workers() -> int:
    """DDTREE_COMPILE_WORKERS, else a worker per spare core up to MAX_WORKERS (two cores kept for the
    server and the system)."""
    chosen = os.environ.get(WORKERS_ENV)
    if chosen is not None:
        return max(0, int(chosen))
    return max(0, min(MAX_WORKERS, (os.cpu_count() or 1) - 2))


def cpu_shares(workers: int) -> list[list[int]]:
    """Each worker's own cores, the server's split evenly (a share is reused once there are more workers
    than cores). Triton's compiler sizes its thread pools by the cores a process may use, so workers
    sharing every core would each run as many threads as there are cores."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    each = max(1, len(cores) // max(1, workers))
    return [cores[(i * each) % len(cores):(i * each) % len(cores) + each] for i in range(workers)]


def record_name(arch: str, hidden_size: int, layers: int, dtype: str, quantization: str, world: int = 1) -> str:
    """A shipped record's name: what sets most of a model's compiles (its layer kinds and sizes, the
    weights' dtype, FP8's own kernels, the heads a rank keeps)."""
    return f"{arch}-{hidden_size}x{layers}-{dtype}-{quantization}" + (f"-tp{world}" if world > 1 else "")


def shipped_record(name: str) -> str | None:
    """The path of the record shipped for `name` (record_name()), None where none is."""
    path = os.path.join(SHIPPED, f"{name}.pkl")
    return path if os.path.isfile(path) else None


def record_for(cfg: Qwen3Config, dtype: str, quantization: str, world: int = 1) -> str | None:
    """The record shipped for a target of this config (the checkpoint's, before any split), if any."""
    arch = "qwen3_5" if isinstance(cfg, Qwen35Config) else "qwen3"
    return shipped_record(record_name(arch, cfg.hidden_size, cfg.num_hidden_layers, dtype, quantization, world))


def _previous(shipped: str | None) -> tuple[list[dict], str]:
    """The cache's own record, else the one shipped for the model (a host's first start), and whose."""
    from triton import knobs

    own = recorded(os.path.join(knobs.cache.dir, RECORD))
    if own or shipped is None:
        return own, "the cache's own" if own else ""
    return recorded(shipped), f"shipped {os.path.basename(shipped)}"


class _Intercepted(Exception):
    """Raised in place of Triton's compile: it carries the compile's inputs out of the launch path."""


class CompilePool:
    """Worker processes (`python -m ddtree_runtime.compile_worker`) compiling Triton kernels into the
    cache the server reads. start() lets them import what they need while the server works on; the
    first batch starts them otherwise. Nothing here may stop a start: a pool whose worker dies or stalls
    is given up, and the server compiles what is left itself."""

    def __init__(self, workers: int, timeout_s: float = BATCH_TIMEOUT_S, preload: tuple[str, ...] = ()) -> None:
        self.size, self.timeout_s, self.preload = workers, timeout_s, preload
        self.workers: list[subprocess.Popen] = []
        self.replayed = 0      # recorded compiles the cache lacked, sent at once
        self.record = ""       # whose record they came from: the cache's own, or the one shipped
        self.started_s = 0.0   # the slowest worker's start: its interpreter and imports, until READY
        self._ready: set[int] = set()   # the workers (pids) whose READY has been read
        self.outcomes: Counter[str] = Counter()
        self.broken: str | None = None   # why the pool was given up, once it was
        self.batches: list[tuple[int, float]] = []   # (jobs sent, seconds waited) per compile()
        self.busy_s = 0.0                            # the workers' seconds inside their compiles, summed
        self.job_seconds: dict[bytes, float] = {}    # each compile's seconds in its worker, by _identity
        self._replaying: threading.Thread | None = None  # the record's compiles, sent while the weights load

    def replay(self, jobs: list[dict]) -> None:
        """The recorded compiles (`jobs`) that Triton's cache lacks, the longest first."""
        from triton.runtime.driver import driver

        jobs = sorted(jobs, key=lambda job: -job.get("seconds", 0.0))
        if not jobs:
            return
        target = driver.active.get_current_target()
        missing = [still_to_compile(job, target) for job in jobs]
        self.compile(missing)
        self.replayed = sum(job is not None for job in missing)

    def replay_meanwhile(self, jobs: list[dict]) -> None:
        """replay() on a thread of its own; `settle()` waits for it. The recorded kernels' modules are
        imported here first: the thread importing a package (fla) while this one's model imports it too
        raced in importlib (KeyError: 'fla.ops', an H200 profile's first prefill)."""
        for module in sorted({job["module"] for job in jobs}):
            try:
                importlib.import_module(module)
            except ImportError:  # a record from another version of the code: still_to_compile skips it
                pass

        def run() -> None:
            try:
                self.replay(jobs)
            except Exception as error:  # noqa: BLE001 -- the warm-up then compiles as it goes
                log.warning("compile record not replayed (%s: %s)", type(error).__name__, error)
        self._replaying = threading.Thread(target=run, name="compile-record", daemon=True)
        self._replaying.start()

    def settle(self) -> None:
        """Wait for a replay started by replay_meanwhile() (a pool's work is bounded by its timeout)."""
        if self._replaying is not None:
            self._replaying.join()
            self._replaying = None

    def compile(self, jobs: list[dict | None]) -> None:
        """Compile `jobs` at once; returns when every one has been compiled or refused, or after
        `timeout_s`. None (nothing left to compile) and jobs with a `refused` reason (left to the server)
        are only counted."""
        sent = [job for job in jobs if job is not None and "refused" not in job]
        self.outcomes.update(job["refused"] for job in jobs if job is not None and "refused" in job)
        if not sent:
            return
        if self.broken is None and not self.workers:
            self.start()
        if self.broken is not None:
            self.outcomes[self.broken] += len(sent)
            return
        started = time.monotonic()
        queue = SimpleQueue()
        for job in sent:
            queue.put(job)
        answered: list[tuple[str, float]] = []
        failed: list[str] = []
        threads = [threading.Thread(target=self._serve, args=(worker, queue, answered, failed), daemon=True)
                   for worker in self.workers[:len(sent)]]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + self.timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stalled = any(thread.is_alive() for thread in threads)
        self.outcomes.update(outcome for outcome, _ in answered)
        self.busy_s += sum(seconds for _, seconds in answered)
        self.batches.append((len(sent), time.monotonic() - started))
        if stalled or failed:
            self._give_up("a worker stalled" if stalled else failed[0], len(sent) - len(answered))
            for thread in threads:
                thread.join(5.0)   # the workers are ended: their reads return
            self.close()

    def summary(self) -> dict:
        """What the workers did, for the warm-up's log line and the benchmarks' JSON."""
        return {"workers": self.size, "outcomes": dict(self.outcomes), "from_record": self.replayed,
                "record": self.record,
                "batches": len(self.batches), "waited_s": round(sum(s for _, s in self.batches), 2),
                "busy_s": round(self.busy_s, 2), "started_s": round(self.started_s, 2)}

    def start(self) -> None:
        """Start the workers; they import `preload` meanwhile, and each says READY before its first job."""
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        try:
            for cpus in cpu_shares(self.size):
                worker = subprocess.Popen([sys.executable, "-m", "ddtree_runtime.compile_worker"],
                                          env={**env, compile_worker.CPUS_ENV: ",".join(map(str, cpus))},
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                self.workers.append(worker)
                compile_worker.send(worker.stdin, (sys.path, self.preload))
        except OSError as error:
            self._give_up(f"workers not started ({type(error).__name__})", 0)

    def _serve(self, worker: subprocess.Popen, queue: SimpleQueue, answered: list[tuple[str, float]],
               failed: list[str]) -> None:
        """One worker's share: jobs from the queue until it is empty (or the worker is gone). A worker
        not yet heard from is waited for first (its READY), while the ready ones take the jobs."""
        while not queue.empty():
            try:
                if worker.pid not in self._ready:
                    _, seconds = compile_worker.receive(worker.stdout)
                    self._ready.add(worker.pid)
                    self.started_s = max(self.started_s, seconds)
                try:
                    job = queue.get_nowait()
                except Empty:
                    return
                compile_worker.send(worker.stdin, job)
                outcome = compile_worker.receive(worker.stdout)
            except (EOFError, OSError, ValueError):   # gone, or ended by _give_up
                try:
                    code = worker.wait(5.0)
                except subprocess.TimeoutExpired:
                    code = None
                failed.append(f"a worker ended (exit {code})")
                return
            answered.append(outcome)
            self.job_seconds[_identity(job)] = outcome[1]
            if outcome[0] != compile_worker.COMPILED:
                log.debug("compile worker: %s", outcome[0])

    def _give_up(self, why: str, unanswered: int) -> None:
        self.broken = f"pool given up: {why}"
        self.outcomes[self.broken] += unanswered
        log.warning("compile workers given up (%s): the server compiles the rest itself", why)
        for worker in self.workers:
            if worker.poll() is None:
                worker.kill()

    def close(self) -> None:
        """End the workers (one still compiling is not waited for)."""
        for worker in self.workers:
            if worker.poll() is None:
                worker.kill()
            worker.wait()
            for stream in (worker.stdin, worker.stdout):
                stream.close()
        self.workers = []


def candidate_job(kernel, args: tuple, kwargs: dict) -> dict | None:
    """What a worker needs to compile `kernel` (a Triton kernel, possibly under heuristics) as launching
    it with `args` and `kwargs` would here (describe()); None where it is already built in this process."""
    from triton.runtime.driver import driver

    jit = compile_worker.jit_function(kernel)
    jit.device_caches[driver.active.get_current_device()]   # made first: making it resets jit.compile
    built = jit.compile

    def intercept(src, target=None, options=None, _env_vars=None):
        raise _Intercepted(src, target, options)

    jit.compile = intercept
    launch = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}  # an autotuner passes its own
    try:
        kernel.run(*args, grid=None, warmup=True, **launch)
        return None
    except _Intercepted as caught:
        src, target, options = caught.args
    finally:
        jit.compile = built
    return describe(src, target, options)


def describe(src, target, options: dict) -> dict:
    """A compile's inputs as compile_worker.compile_job takes them; {"refused": why} where a worker
    could not rebuild this kernel exactly.

    A kernel's constexpr globals (and those of the Triton functions it calls) are in its cache key, and
    modules set some at import from the GPU they find (fla-core: TF32 dot precision where the GPU has
    TF32), which a worker without one would set otherwise. So the job carries this process's plain
    values of every module the kernel can reach, and the worker takes them before it builds anything."""
    fn = src.fn
    reached = getattr(sys.modules.get(fn.module), fn.__name__, None)
    if reached is None or compile_worker.jit_function(reached) is not fn:
        return {"refused": "not reachable by its module and name"}
    state = {name: {k: v for k, v in vars(sys.modules[name]).items() if _plain(k, v)} for name in _reachable(fn)}
    job = {"module": fn.module, "name": fn.__name__, "cache_key": fn.cache_key, "modules": state,
           "signature": dict(src.signature), "constants": dict(src.constants), "attrs": dict(src.attrs),
           "target": target, "options": dict(options)}
    try:
        pickle.dumps(job)
    except Exception:
        return {"refused": "a compile input that cannot be sent to a process"}
    return job


def _plain(name: str, value) -> bool:
    """A module global a worker can be given: a scalar or string, or a constexpr of one."""
    from triton.language import constexpr

    if name.startswith("__"):
        return False
    value = value.value if isinstance(value, constexpr) else value
    return type(value) in _SIMPLE


def _reachable(fn, depth: int = 3) -> list[str]:
    """The kernel's module and those of the Triton functions its module's globals lead to (directly or
    as attributes of a module it imported), `depth` steps out; Triton's own modules left out."""
    from triton.runtime.jit import JITFunction

    found, frontier = {fn.module}, [fn.module]
    for _ in range(depth):
        nxt = []
        for name in frontier:
            for value in list(vars(sys.modules[name]).values()):
                targets = vars(value).values() if isinstance(value, ModuleType) else (value,)
                for target in targets:
                    module = getattr(target, "module", None) if isinstance(target, JITFunction) else None
                    if module and module not in found and not module.startswith("triton") and module in sys.modules:
                        found.add(module)
                        nxt.append(module)
        frontier = nxt
    return sorted(found)


def recorded(path: str) -> list[dict]:
    """The compiles a warm-up recorded at `path` (save_record()); none where it is missing or unreadable."""
    try:
        with open(path, "rb") as f:
            jobs = pickle.load(f)
    except FileNotFoundError:
        return []
    except Exception as error:  # a damaged record only costs the parallel compiles
        log.warning("compile record %s not read (%s): the warm-up compiles as it goes", path, type(error).__name__)
        return []
    if not isinstance(jobs, list):
        return []
    return [job for job in jobs if isinstance(job, dict) and "refused" not in job and _IDENTITY <= job.keys()]


def save_record(jobs: list[dict], path: str, known_seconds: dict[bytes, float] | None = None) -> None:
    """Write the record whole or not at all (a reader never sees half of one). Each compile keeps the
    longest it is known to take: here, or as `known_seconds` has it by _identity (in a worker, or in the
    record this one replaces, where a restart only loaded it from the cache), so that the next start
    sends the longest first."""
    known = known_seconds or {}
    kept = {_identity(job): job for job in jobs if "refused" not in job}
    for identity, job in kept.items():
        job["seconds"] = max(job.get("seconds", 0.0), known.get(identity, 0.0))
    if not kept:
        return
    part = f"{path}.{os.getpid()}.part"
    try:
        with open(part, "wb") as f:
            pickle.dump(list(kept.values()), f)
        os.replace(part, path)
    except OSError as error:
        log.warning("compile record %s not written (%s)", path, error)


def merged(made: list[dict], kept: list[dict]) -> list[dict]:
    """The compiles of a record a warm-up `made`, and those of the record `kept` it did not reach (a
    warm-up on a smaller card, whose shorter contexts leave some launches out): each compile once, at the
    longest either knows it to take (save_record's `seconds`)."""
    jobs: dict[bytes, dict] = {}
    for job in (*made, *kept):
        if "refused" in job or not _IDENTITY <= job.keys():
            continue
        seen = jobs.setdefault(_identity(job), dict(job))
        seen["seconds"] = max(seen.get("seconds", 0.0), job.get("seconds", 0.0))
    return list(jobs.values())


_IDENTITY = {"module", "name", "signature", "constants", "attrs", "options"}


def _identity(job: dict) -> bytes:
    """One compile whoever recorded it (an autotuner's candidate is met twice: taken, then timed)."""
    return pickle.dumps([job[k] for k in sorted(_IDENTITY)])


def still_to_compile(job: dict, target) -> dict | None:
    """A recorded compile as this process would make it for `target` (this GPU), or None where Triton's
    cache already holds it (or the kernel is gone). It is this process's kernel under that name (its
    source and globals may have changed since the record), with the launch's options parsed again for
    this GPU."""
    from triton.compiler import ASTSource, make_backend

    try:
        kernel = compile_worker.jit_function(getattr(importlib.import_module(job["module"]), job["name"]))
        # the launch's own options parsed again here: the rest are this GPU's and this install's (the
        # record may come from another GPU, or another host: libdevice's path is among them)
        options = make_backend(target).parse_options(
            {k: v for k, v in job["options"].items() if k in LAUNCH_OPTIONS}).__dict__
        src = ASTSource(kernel, job["signature"], job["constants"], job["attrs"])
        return None if in_cache(src, target, options) else describe(src, target, options)
    except Exception as error:  # noqa: BLE001 -- a record from another version of the code: only a miss
        log.debug("recorded compile of %s.%s not rebuilt: %s", job.get("module"), job.get("name"), error)
        return None


def in_cache(src, target, options: dict) -> bool:
    """Triton's cache holds this compile: its key and lookup as triton.compile makes them (so a warm
    restart sends its workers nothing)."""
    import hashlib

    from triton.compiler.compiler import get_cache_invalidating_env_vars, get_cache_key, make_backend
    from triton.runtime.cache import get_cache_manager

    backend = make_backend(target)
    parsed = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, parsed, env_vars=get_cache_invalidating_env_vars())
    name = f"{src.name[:150]}.json"
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name) or {}
    return name in group


@contextmanager
def compiles_recorded(into: list[dict]) -> Iterator[None]:
    """Every kernel this process compiles inside the block (Triton's JIT missing its in-process cache,
    whether the disk cache then hits or not) is appended to `into` as describe() makes it, with the
    seconds its compile took here ("seconds")."""
    from triton.runtime.jit import JITFunction

    do_compile = JITFunction._do_compile

    def recording(self, key, signature, device, constexprs, options, attrs, warmup):
        target = self.device_caches[device][2]
        job = None
        try:
            job = describe(self.ASTSource(self, signature, constexprs, attrs), target, dict(options.__dict__))
            into.append(job)
        except Exception as error:  # noqa: BLE001 -- the record is an aid; the compile must go on
            log.debug("compile of %s not recorded: %s", self, error)
        started = time.perf_counter()
        try:
            return do_compile(self, key, signature, device, constexprs, options, attrs, warmup)
        finally:
            if job is not None:
                job["seconds"] = time.perf_counter() - started

    JITFunction._do_compile = recording
    try:
        yield
    finally:
        JITFunction._do_compile = do_compile


def _cache_is_empty() -> bool:
    """Triton's cache directory holds nothing yet: a host's first start, which will compile."""
    from triton import knobs

    root = knobs.cache.dir
    return not os.path.isdir(root) or not any(os.scandir(root))


_early: tuple[CompilePool, list[dict]] | None = None   # start_early()'s pool and the record it read


def start_early(workers: int | None = None, preload: tuple[str, ...] = (),
                shipped: str | None = None) -> CompilePool | None:
    """Start the pool before the warm-up where it will have work: over an empty cache (a host's first
    start: the workers' imports overlap the weights' load) or when the record lists compiles the cache
    lacks (those are sent at once, on a thread, while the weights load); `shipped`: the record shipped
    for the model (shipped_record()), taken where the cache has none. The next parallel_compiles()
    takes this pool over (a process that never warms up keeps the idle workers until it exits: they
    end when their stdin closes). Once a process; None where nothing is started (a warm restart, no
    Triton, no workers)."""
    global _early
    if _early is not None:
        return _early[0]
    workers = default_workers() if workers is None else workers
    try:
        from triton.runtime.driver import driver
    except ImportError:
        return None
    if not workers:
        return None
    previous, whose = _previous(shipped)
    if not _cache_is_empty():
        if not previous:
            return None
        try:
            target = driver.active.get_current_target()
        except Exception:  # noqa: BLE001 -- no GPU to compile for: the warm-up's replay says why
            return None
        if not any(still_to_compile(job, target) is not None for job in previous):
            return None
    pool = CompilePool(workers, preload=preload)
    pool.record = whose
    pool.start()
    if previous:
        pool.replay_meanwhile(previous)
    _early = (pool, previous)
    return pool


@contextmanager
def parallel_compiles(workers: int | None = None, preload: tuple[str, ...] = (),
                      shipped: str | None = None) -> Iterator[CompilePool | None]:
    """Inside the block Triton's compiles go wide over a pool of `workers` processes (default_workers()
    by default; 0, or no Triton: nothing changes), which import `preload` (the autotuned kernels'
    modules) as they start:
    - on entry, what the last warm-up recorded in the cache directory (RECORD), else the `shipped`
      record, and the cache lacks is compiled at once (after an upgrade, a record seeded from a host of
      another GPU model, or a known model's first start);
    - an autotuner about to time its candidates first has them all compiled, then times each for
      TIMING's milliseconds;
    - on leaving, every kernel the block compiled is recorded for the next start.
    Over an empty cache the workers start at once, their imports overlapping the server's work before
    the first autotuner; otherwise at the first batch, if one comes. A pool start_early() started is
    taken over (its record's compiles waited for), whatever `workers` says. Yields the pool (its
    `outcomes` count what the workers did) or None."""
    global _early
    early, _early = _early, None
    workers = default_workers() if workers is None else workers
    try:
        from triton import knobs, testing
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        Autotuner = None
    if early is None and (not workers or Autotuner is None):
        yield None
        return
    record = os.path.join(knobs.cache.dir, RECORD)
    prune, bench = Autotuner.prune_configs, Autotuner._bench
    if early is not None:
        pool, previous = early
    else:
        pool = CompilePool(workers, preload=preload)
        previous, pool.record = _previous(shipped)

    def prune_configs(self, kwargs):
        configs = prune(self, kwargs)
        self.__dict__[_PENDING] = list(configs)
        return configs

    def capture(kernel, args: tuple, kwargs: dict) -> dict | None:
        try:
            return candidate_job(kernel, args, kwargs)
        except Exception as error:  # its timing run meets the same error, where the autotuner handles it
            return {"refused": f"its compile inputs not taken ({type(error).__name__})"}

    def _bench(self, *args, config, **meta):
        candidates = self.__dict__.pop(_PENDING, None)
        if candidates and len(candidates) > 1:
            pool.compile([capture(self.fn, args, dict(meta, **c.all_kwargs())) for c in candidates])
        if getattr(self, "_do_bench", None) is not None:   # the kernel's own way of timing
            return bench(self, *args, config=config, **meta)
        kept = self.__dict__.get("do_bench")
        self.__dict__["do_bench"] = functools.partial(testing.do_bench, **TIMING)
        try:
            return bench(self, *args, config=config, **meta)
        finally:
            if kept is None:
                del self.__dict__["do_bench"]
            else:
                self.__dict__["do_bench"] = kept

    compiled: list[dict] = []
    Autotuner.prune_configs, Autotuner._bench = prune_configs, _bench
    try:
        if early is not None:
            pool.settle()
        else:
            if _cache_is_empty():
                pool.start()
            try:
                pool.replay(previous)
            except Exception as error:  # noqa: BLE001 -- the warm-up then compiles as it goes, as without one
                log.warning("compile record %s not replayed (%s: %s)", record, type(error).__name__, error)
        with compiles_recorded(compiled):
            yield pool
        known = {_identity(job): job.get("seconds", 0.0) for job in previous}
        for identity, seconds in pool.job_seconds.items():
            known[identity] = max(known.get(identity, 0.0), seconds)
        save_record(compiled, record, known)
    finally:
        Autotuner.prune_configs, Autotuner._bench = prune, bench
        pool.close()

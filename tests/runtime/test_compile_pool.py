"""model/compile_pool.py: Triton kernels compiled by worker processes into the cache the server
reads. On the CPU the kernels are compiled for an H200 (sm_90: Triton's front end, LLVM and ptxas all
run here), and what a worker built must be what this process then finds in the cache: same key, no
compile of its own, and the code this process's globals make (a worker takes them from the job). A
worker refuses a kernel that is not the server's. The autotuner end to end (its candidates compiled
by the pool before it times them) needs a GPU to launch on."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

from ddtree_runtime import compile_worker  # noqa: E402
from ddtree_runtime.model import compile_pool  # noqa: E402
from ddtree_runtime.model.compile_pool import (RECORD, CompilePool, _identity, describe,  # noqa: E402
                                               merged, parallel_compiles, record_name, recorded, save_record,
                                               shipped_record, start_early, still_to_compile)
from tests.runtime import compile_pool_faults, compile_pool_helpers, compile_pool_kernels as kernels  # noqa: E402

pytestmark = pytest.mark.slow

H200 = GPUTarget("cuda", 90, 32)
REPO = Path(__file__).resolve().parents[2]
SIGNATURE = {"src": "*fp32", "dst": "*fp32", "n": "i32", "BLOCK": "constexpr"}


def source(kernel, block: int = 128) -> ASTSource:
    """A launch's compile input as Triton's JIT makes it: pointers 16-byte aligned, n a multiple of 16."""
    return ASTSource(kernel, SIGNATURE, {(3,): block}, {(0,): [["tt.divisibility", 16]],
                                                        (1,): [["tt.divisibility", 16]]})


def options(num_warps: int = 4) -> dict:
    return make_backend(H200).parse_options({"num_warps": num_warps}).__dict__


def cache_entries(root: Path) -> set[str]:
    return {p.name for p in root.iterdir()} if root.exists() else set()


def pool_outcomes(jobs: list, workers: int = 1) -> Counter:
    """What a pool of `workers` did with `jobs`, the pool closed after."""
    pool = CompilePool(workers)
    try:
        pool.compile(jobs)
    finally:
        pool.close()
    return pool.outcomes


def loaded_here(src: ASTSource, cache: Path, num_warps: int = 4):
    """`src` compiled in this process after a worker built it: a cache hit (no entry added), as the server
    would load it."""
    built = cache_entries(cache)
    assert built                                                 # the worker wrote the kernel there
    compiled = triton.compile(src, target=H200, options=options(num_warps))
    assert cache_entries(cache) == built
    return compiled


@contextmanager
def fresh_cache_keys(*kernels_changed):
    """The kernels' cache keys computed again from the globals as the test set them, and again after."""
    for fn in kernels_changed:
        fn.hash = None
    try:
        yield
    finally:
        for fn in kernels_changed:
            fn.hash = None


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty Triton cache for this test; the workers, started after, read the same variable."""
    root = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(root))
    return root


def test_what_a_worker_compiles_is_what_the_server_then_loads(cache):
    src = source(kernels.scaled_copy)
    job = describe(src, H200, options())
    assert job["module"] == "tests.runtime.compile_pool_kernels" and job["name"] == "scaled_copy"
    assert job["modules"]["tests.runtime.compile_pool_kernels"]["SCALE"] == kernels.SCALE
    helper_module = job["modules"]["tests.runtime.compile_pool_helpers"]               # reached via `helpers`
    assert list(helper_module) == ["ADD_ONE"] and helper_module["ADD_ONE"].value is False
    assert pool_outcomes([job, None], workers=2) == {compile_worker.COMPILED: 1}   # None: nothing to send
    started = time.perf_counter()
    compiled = loaded_here(src, cache)
    assert time.perf_counter() - started < 1.0
    assert compiled.metadata.num_warps == 4 and "scaled_copy" in compiled.asm["ptx"]


def test_a_worker_takes_the_servers_value_of_a_constexpr_global(cache, monkeypatch):
    monkeypatch.setattr(kernels, "SCALE", triton.language.constexpr(3.0))
    with fresh_cache_keys(kernels.scaled_copy):                  # as a process that started with 3.0
        src = source(kernels.scaled_copy, block=64)
        job = describe(src, H200, options())
        assert job["modules"]["tests.runtime.compile_pool_kernels"]["SCALE"] == kernels.SCALE
        assert pool_outcomes([job]) == {compile_worker.COMPILED: 1}
        assert "0f40400000" in loaded_here(src, cache).asm["ptx"]     # 3.0 as PTX writes a float


def test_a_callees_constexpr_global_is_the_servers_in_the_worker(cache, monkeypatch):
    """The helper's ADD_ONE is a constexpr global of another module, as fla-core's are set at import
    from the GPU found (which a worker has not): the worker takes this process's value (True) and builds
    this process's kernel, under its key."""
    monkeypatch.setattr(compile_pool_helpers, "ADD_ONE", triton.language.constexpr(True))
    with fresh_cache_keys(kernels.shifted_copy, compile_pool_helpers.shift):
        src = source(kernels.shifted_copy)
        job = describe(src, H200, options())
        assert job["modules"]["tests.runtime.compile_pool_helpers"]["ADD_ONE"].value is True
        assert pool_outcomes([job]) == {compile_worker.COMPILED: 1}
        assert "0f3F800000" in loaded_here(src, cache).asm["ptx"]     # the + 1.0


def test_a_kernel_that_is_not_the_servers_is_refused(cache):
    job = describe(source(kernels.scaled_copy), H200, options()) | {"cache_key": "0" * 64}
    assert pool_outcomes([job]) == {"not the server's kernel (its source or constexpr globals differ here)": 1}
    assert not cache_entries(cache)


def test_a_kernel_not_reachable_by_its_name_is_left_to_the_server():
    @triton.jit
    def local_copy(src, dst, n, BLOCK: triton.language.constexpr):
        offsets = tl_arange(BLOCK)  # noqa: F821 (never compiled: refused before)

    assert describe(source(local_copy), H200, options()) == {"refused": "not reachable by its module and name"}


@pytest.mark.parametrize("fault", ["exit", "hang"])
def test_a_worker_that_dies_or_stalls_never_stops_the_start(cache, monkeypatch, fault):
    """The pool is given up (its jobs counted so), later batches are not sent, and nothing raises: the
    server compiles those kernels itself, as it would without workers."""
    monkeypatch.setenv("DDTREE_TEST_COMPILE_FAULT", fault)
    job = describe(source(compile_pool_faults.plain_copy), H200, options())
    pool = CompilePool(1, timeout_s=3.0)
    started = time.perf_counter()
    try:
        pool.compile([job])
        pool.compile([job, job])
    finally:
        pool.close()
    given_up = {"exit": "pool given up: a worker ended (exit 3)", "hang": "pool given up: a worker stalled"}[fault]
    assert pool.outcomes == {given_up: 3} and time.perf_counter() - started < 20
    assert not cache_entries(cache)


def test_a_script_without_a_main_guard_runs_once(cache, tmp_path):
    """Workers are `python -m ddtree_runtime.compile_worker`, not multiprocessing's: those run the parent's
    main script again, and a script that built an engine at its top level would load it in each."""
    runs = tmp_path / "runs"
    script = tmp_path / "unguarded.py"
    script.write_text(f"""
import sys
sys.path[:0] = {[str(REPO), str(REPO / "runtime")]!r}
open({str(runs)!r}, "a").write("ran\\n")
from tests.runtime.test_compile_pool import H200, options, source
from tests.runtime import compile_pool_kernels as kernels
from ddtree_runtime.model.compile_pool import CompilePool, describe
pool = CompilePool(2)
pool.compile([describe(source(kernels.scaled_copy, block=b), H200, options()) for b in (16, 32, 64)])
pool.close()
print(dict(pool.outcomes))
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "{'compiled': 3}" and runs.read_text() == "ran\n"


def test_a_worker_whose_server_has_gone_exits_quietly():
    """A server that fails to start (a context that does not fit) closes its workers' pipes before they
    answer READY: each then exits at once, with nothing on stderr (it printed a BrokenPipeError traceback)."""
    worker = subprocess.Popen([sys.executable, "-m", "ddtree_runtime.compile_worker"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO / "runtime")
    worker.stdout.close()                      # the server's end of the replies, gone before READY
    message = pickle.dumps((sys.path, []))
    worker.stdin.write(compile_worker._LENGTH.pack(len(message)) + message)
    worker.stdin.close()
    assert worker.wait(timeout=120) == 0
    assert worker.stderr.read() == b""


def test_parallel_compiles_patch_the_autotuner_only_inside(monkeypatch):
    prune, bench = Autotuner.prune_configs, Autotuner._bench
    with parallel_compiles(0) as pool:
        assert pool is None and Autotuner._bench is bench        # 0 workers: nothing changes
    with parallel_compiles(1) as pool:
        assert isinstance(pool, CompilePool) and Autotuner._bench is not bench
    assert (Autotuner.prune_configs, Autotuner._bench) == (prune, bench)
    monkeypatch.setenv("DDTREE_COMPILE_WORKERS", "0")
    with parallel_compiles() as pool:
        assert pool is None


def test_a_record_is_read_back_once_per_compile_and_a_damaged_one_is_no_record(tmp_path):
    path = str(tmp_path / RECORD)
    assert recorded(path) == []                                    # none yet
    first, second = (describe(source(kernels.scaled_copy, block=b), H200, options()) for b in (64, 128))
    taken_then_timed = dict(first, seconds=0.01)                   # a candidate met twice: kept once
    save_record([first, second, taken_then_timed, {"refused": "not reachable by its module and name"}], path,
                known_seconds={_identity(first): 1.5})
    read = recorded(path)
    untimed = [{k: v for k, v in job.items() if k != "seconds"} for job in (*read, first, second)]
    assert untimed[:2] == untimed[2:]
    assert [job["seconds"] for job in read] == [1.5, 0.0]          # the longest it took, here or in a worker
    (tmp_path / RECORD).write_bytes(b"\x80\x04 half a pickle")
    assert recorded(path) == []
    (tmp_path / RECORD).write_bytes(pickle.dumps([{"module": first["module"], "name": "scaled_copy"}]))
    assert recorded(path) == []                                    # an entry that is not a whole compile
    assert [p.name for p in tmp_path.iterdir()] == [RECORD]       # no part file left behind


def test_a_record_made_on_a_smaller_card_keeps_the_shipped_compiles_it_did_not_reach():
    """merged(): the new warm-up's compiles and the shipped record's others, each once, at the longest
    either timed it; refused and partial entries dropped."""
    short, long, other = (describe(source(kernels.scaled_copy, block=b), H200, options()) for b in (64, 128, 256))
    made = [dict(short, seconds=2.0), dict(long, seconds=1.0), {"refused": "not reachable by its module and name"}]
    shipped = [dict(long, seconds=3.0), dict(other, seconds=0.5), {"module": short["module"], "name": "scaled_copy"}]
    jobs = merged(made, shipped)
    assert [(_identity(job), job["seconds"]) for job in jobs] == [
        (_identity(short), 2.0), (_identity(long), 3.0), (_identity(other), 0.5)]
    assert made[1]["seconds"] == 1.0                               # the inputs left as they were


def test_what_a_record_holds_is_compiled_once_then_found_in_the_cache(cache):
    """A recorded compile the cache lacks is a job for the workers; once they built it, it is in the
    cache (the restart after sends them nothing)."""
    job = describe(source(kernels.scaled_copy, block=32), H200, options(num_warps=2))
    wanted = still_to_compile(job, H200)
    assert wanted is not None and wanted["options"] == job["options"]
    pool = CompilePool(1)
    try:
        pool.compile([wanted])
    finally:
        pool.close()
    summary = pool.summary()
    assert summary["outcomes"] == {compile_worker.COMPILED: 1} and summary["batches"] == 1
    assert 0 < summary["started_s"] and 0 < summary["busy_s"] < summary["waited_s"]
    assert still_to_compile(job, H200) is None


def test_a_record_from_another_gpu_is_compiled_for_this_one(cache):
    """A record seeded from a host of another GPU model (an A6000's sm_86): the launch's options (its
    warps) are kept and the rest are Triton's for this GPU, and what the workers build for it is what
    this process then loads."""
    a6000 = GPUTarget("cuda", 86, 32)
    job = describe(source(kernels.scaled_copy, block=256), a6000,
                   make_backend(a6000).parse_options({"num_warps": 2}).__dict__)
    wanted = still_to_compile(job, H200)
    assert wanted["target"] == H200 and wanted["options"] == options(num_warps=2)
    assert pool_outcomes([wanted]) == {compile_worker.COMPILED: 1}
    assert loaded_here(source(kernels.scaled_copy, block=256), cache, num_warps=2).metadata.num_warps == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU's driver replays the record (the CUDA test below)")
def test_a_record_that_cannot_be_replayed_never_stops_the_warm_up(cache, caplog):
    """Here no GPU driver names the target: the replay is given up with one warning and the block runs."""
    cache.mkdir()
    save_record([describe(source(kernels.scaled_copy), H200, options())], str(cache / RECORD))
    with parallel_compiles(1) as pool:
        assert pool.replayed == 0 and not pool.workers
    assert "not replayed" in caplog.text


def test_a_records_modules_are_imported_before_its_replay_thread_starts(tmp_path, monkeypatch):
    """The thread must not import a package the model is importing at the same time (importlib raced:
    KeyError 'fla.ops' on an H200): the caller imports the record's modules first; a gone one is skipped."""
    (tmp_path / "recorded_elsewhere.py").write_text("import threading\nIMPORTED_ON = threading.current_thread().name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "recorded_elsewhere", raising=False)
    pool = CompilePool(0)
    monkeypatch.setattr(pool, "replay", lambda jobs: None)
    pool.replay_meanwhile([{"module": "recorded_elsewhere", "name": "k"}, {"module": "gone_since_then", "name": "k"}])
    pool.settle()
    assert sys.modules["recorded_elsewhere"].IMPORTED_ON == threading.current_thread().name
    monkeypatch.delitem(sys.modules, "recorded_elsewhere")


def test_a_first_start_has_its_workers_started_before_the_warm_up_which_takes_them_over(cache):
    """Over an empty cache the pool starts as the engine is built (its imports overlap the weights'
    load); the warm-up's block takes that pool over whatever it is asked for, and ends it."""
    early = start_early(2)
    try:
        assert early is not None and len(early.workers) == 2
        workers = list(early.workers)
        assert start_early(2) is early                               # once a process
        with parallel_compiles(0) as pool:
            assert pool is early
        assert not early.workers and all(w.poll() is not None for w in workers)   # ended with the block
    finally:
        early.close()
    with parallel_compiles(0) as pool:                               # taken: the next block is the workers' choice
        assert pool is None


def test_a_restart_over_a_warm_cache_starts_no_worker_early(cache):
    cache.mkdir()
    (cache / "some-kernel").mkdir()                                  # a cache without a record
    assert start_early(2) is None
    save_record([describe(source(kernels.scaled_copy), H200, options())], str(cache / RECORD))
    if not torch.cuda.is_available():                                # no GPU to compile the record for here
        assert start_early(2) is None


def test_a_known_model_has_a_shipped_record_that_the_runtime_can_read():
    """The 27B's record, made by a warm-up on an H200, is in the package; its compiles name kernels
    this runtime still has (a kernel renamed since would only be skipped: shipped records are made
    again when kernels change)."""
    path = shipped_record(record_name("qwen3_5", 5120, 64, "bfloat16", "none"))
    assert path is not None and shipped_record(record_name("qwen3_5", 5120, 64, "bfloat16", "fp8")) is None
    jobs = recorded(path)
    assert len(jobs) > 50 and {"_tree_delta_kernel", "_decode_attn_part_kernel"} <= {job["name"] for job in jobs}
    ours = [job for job in jobs if job["module"].startswith("ddtree_runtime.")]
    for job in ours:
        kernel = compile_worker.jit_function(getattr(__import__(job["module"], fromlist=["_"]), job["name"]))
        assert set(job["signature"]) <= set(kernel.arg_names), job["name"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU's driver replays the record (the CUDA test below)")
def test_a_cache_with_no_record_of_its_own_takes_the_shipped_one(cache, tmp_path, caplog):
    """Shipped and own records alike are replayed at the block's entry (here no GPU driver names the
    target, so each replay is given up with its warning); the cache's own record comes first."""
    shipped = tmp_path / "shipped.pkl"
    save_record([describe(source(kernels.scaled_copy), H200, options())], str(shipped))
    cache.mkdir()
    (cache / "some-kernel").mkdir()
    with parallel_compiles(1, shipped=str(shipped)):
        pass
    assert "not replayed" in caplog.text
    assert compile_pool._previous(str(shipped)) == (recorded(str(shipped)), "shipped shipped.pkl")
    save_record([describe(source(kernels.scaled_copy, block=64), H200, options())], str(cache / RECORD))
    assert compile_pool._previous(str(shipped)) == (recorded(str(cache / RECORD)), "the cache's own")


def test_a_recorded_kernel_that_is_gone_is_skipped(cache):
    job = describe(source(kernels.scaled_copy), H200, options()) | {"name": "renamed_since"}
    assert still_to_compile(job, H200) is None and not cache_entries(cache)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="an autotuner launches its candidates on a GPU")
def test_an_autotuners_candidates_are_compiled_by_the_pool(cache):
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    with parallel_compiles(4) as pool:
        kernels.tuned_copy[lambda meta: (triton.cdiv(1000, meta["BLOCK"]),)](x, y, 1000)
    torch.testing.assert_close(y, x * 2.0)
    assert pool.outcomes == {compile_worker.COMPILED: 4}         # every candidate, before its timing run


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's JIT launches on a GPU")
def test_a_warm_up_records_its_compiles_and_the_next_empty_cache_gets_them_at_once(cache, tmp_path, monkeypatch):
    """What the block compiled (the four candidates and a plain launch) is in the record it leaves; a
    cache holding only that record (a host seeded from another GPU model, or after Triton's upgrade)
    has them all compiled by the workers as the next block opens."""
    x = torch.arange(1024, device="cuda", dtype=torch.float32)    # n = 1024: a specialisation no test above launched
    y = torch.empty_like(x)
    with parallel_compiles(2):
        kernels.tuned_copy[lambda meta: (triton.cdiv(1024, meta["BLOCK"]),)](x, y, 1024)
        kernels.scaled_copy[(8,)](x, y, 1024, BLOCK=128)
    jobs = recorded(str(cache / RECORD))
    assert sorted((job["name"], job["constants"][(3,)]) for job in jobs) == [
        ("scaled_copy", 128), ("tuned_copy", 64), ("tuned_copy", 64), ("tuned_copy", 128), ("tuned_copy", 128)]
    seeded = tmp_path / "seeded"
    seeded.mkdir()
    (seeded / RECORD).write_bytes((cache / RECORD).read_bytes())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(seeded))
    with parallel_compiles(2) as pool:
        assert pool.replayed == 5 and pool.outcomes == {compile_worker.COMPILED: 5}
    with parallel_compiles(2) as pool:
        assert pool.replayed == 0 and not pool.workers           # all in the cache now: no worker started
    assert start_early(2) is None                                # nor early
    early = tmp_path / "early"
    early.mkdir()
    (early / RECORD).write_bytes((cache / RECORD).read_bytes())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(early))
    pool = start_early(2)                                        # the record replayed as the weights load
    with parallel_compiles(0) as taken:
        assert taken is pool and pool.replayed == 5 and pool.outcomes == {compile_worker.COMPILED: 5}
    shipped, first = tmp_path / "shipped.pkl", tmp_path / "first"  # a known model's first start: no record
    shipped.write_bytes((cache / RECORD).read_bytes())
    first.mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(first))
    with parallel_compiles(2, shipped=str(shipped)) as pool:
        assert pool.replayed == 5 and pool.outcomes == {compile_worker.COMPILED: 5}
        assert pool.summary()["record"] == "shipped shipped.pkl"

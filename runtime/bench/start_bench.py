"""Server start to healthy: how long `ddtree-serve` takes from launch until GET /health says ok.

    PYTHONPATH=runtime python runtime/bench/start_bench.py [--out bench/results/start.json]
    PYTHONPATH=runtime python runtime/bench/start_bench.py --small --device cpu --dtype float32   # seconds

Writes a randomly initialised Qwen3-8B-shaped target (hidden 4096, 36 layers, 32/8 heads, head_dim
128, intermediate 12288, vocab 151936) and a DFlash drafter of the same width (5 layers, block 16,
target layers 1, 9, 17, 25, 33) as HF-style checkpoint directories (config.json, sharded
*.safetensors, a minimal byte-level tokenizer) under a tmpfs or local-disk directory, then:

1. starts `python -m ddtree_runtime.server` (mode ddtree, budget 16) with an empty Triton cache and
   polls GET http://127.0.0.1:PORT/health until it answers ok ("cold": a first deploy on a host);
2. starts it again with that cache filled ("warm": a restart);
   each start is split into phases from the server's own log lines (stamped here as they arrive):
   launch -> "loading target" (interpreter, imports, app, listener) -> "loaded in" (tokenizer,
   weights, fuse, KV caches) -> "engine ready" (the warm-up generation: first CUDA graph captures
   and Triton kernels) -> /health ok (poll granularity); after healthy, one completion request
   is timed twice (what the first client sees);
3. in a fresh interpreter (again with an empty Triton cache), times load_target and load_drafter
   alone, the rest of the engine's construction, and the warm-up generation the server runs before
   it reports ready.

The checkpoint files are fresh in the page cache (or in tmpfs), so weight loading here excludes
reading from a cold disk: add the checkpoint's bytes over the disk's read rate for that.
Only 127.0.0.1 is contacted. Prints a table; writes JSON to --out."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

BLOCK_SIZE = 16
SHARD_BYTES = 4 * 1024 ** 3  # HF-style shards of about 4 GiB
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
CHAT_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# server log lines that mark the end of each start-up phase (worker.py, uvicorn)
MARKERS = {
    "listening": re.compile(r"Uvicorn running on"),
    "load_begin": re.compile(r"--> loading target"),
    "loaded": re.compile(r"--> loaded in ([0-9.]+)s"),
    "ready": re.compile(r"engine ready"),
}
POLL_S = 0.05


def log(msg: str) -> None:
    print(f"[start-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- checkpoint ------------------------------------------------------------------------------------

def write_tokenizer(out: Path) -> dict:
    """A byte-level BPE with no merges: 256 byte tokens plus the chat and mask specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|MASK|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    return {"size": len(fast), **ids}


def _random_tensor(shape: tuple[int, ...], dtype, gen_device: str):
    import torch

    if len(shape) == 1:  # norm weights: around 1, as trained ones are
        t = torch.empty(shape, device=gen_device, dtype=torch.float32).uniform_(0.9, 1.1)
    else:
        t = torch.empty(shape, device=gen_device, dtype=torch.float32).normal_(0.0, 0.02)
    return t.to(dtype).cpu()


def write_safetensors(module, out: Path, dtype, gen_device: str) -> dict:
    """Every entry of module.state_dict() (a meta-device model: names and shapes only) with random
    values, in shards of about SHARD_BYTES, plus model.safetensors.index.json."""
    import torch
    from safetensors.torch import save_file

    names = [(k, tuple(v.shape)) for k, v in module.state_dict().items()]
    elem = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in names:
        n = elem * math.prod(shape)
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    total = 0
    weight_map = {}
    t_gen = t_write = 0.0
    for i, shard in enumerate(shards):
        fname = ("model.safetensors" if len(shards) == 1 else
                 f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        t0 = time.perf_counter()
        state = {name: _random_tensor(shape, dtype, gen_device) for name, shape in shard}
        t1 = time.perf_counter()
        save_file(state, str(out / fname), metadata={"format": "pt"})
        t_write += time.perf_counter() - t1
        t_gen += t1 - t0
        total += sum(t.numel() * t.element_size() for t in state.values())
        weight_map.update({name: fname for name, _ in shard})
        del state
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return {"bytes": total, "files": len(shards), "tensors": len(names), "gen_s": t_gen, "write_s": t_write}


def write_checkpoints(shape: str, dtype_name: str, root: Path, gen_device: str) -> dict:
    import torch

    from ddtree_runtime.model import DFlashConfig, DFlashDrafter, Qwen3Config, Qwen3ForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    s = model_shape(shape)
    draft_layers, layer_ids = s.pop("draft_layers"), s.pop("target_layer_ids")
    tdir, ddir = root / "target", root / "draft"
    for d in (tdir, ddir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    t0 = time.perf_counter()
    tok = write_tokenizer(tdir)
    if tok["size"] > s["vocab_size"]:
        raise ValueError(f"tokenizer ({tok['size']} tokens) larger than the model's vocabulary")
    common = dict(s, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
                  attention_bias=False, hidden_act="silu", attention_dropout=0.0, torch_dtype=dtype_name)
    tcfg_raw = dict(common, architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=False,
                    bos_token_id=None, eos_token_id=tok["<|im_end|>"], pad_token_id=tok["<|endoftext|>"],
                    use_sliding_window=False)
    (tdir / "config.json").write_text(json.dumps(tcfg_raw, indent=2))
    (tdir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok["<|im_end|>"]], "pad_token_id": tok["<|endoftext|>"], "do_sample": False}, indent=2))
    dcfg_raw = dict(common, architectures=["DFlashDraftModel"], model_type="qwen3", tie_word_embeddings=False,
                    num_hidden_layers=draft_layers, block_size=BLOCK_SIZE, num_target_layers=s["num_hidden_layers"],
                    dflash_config={"mask_token_id": tok["<|MASK|>"], "target_layer_ids": layer_ids})
    (ddir / "config.json").write_text(json.dumps(dcfg_raw, indent=2))
    with torch.device("meta"):  # names and shapes only; the loader builds its models the same way
        target = Qwen3ForCausalLM(Qwen3Config.from_dict(tcfg_raw))
        drafter = DFlashDrafter(DFlashConfig.from_dict(dcfg_raw))
    tstats = write_safetensors(target, tdir, dtype, gen_device)
    dstats = write_safetensors(drafter, ddir, dtype, gen_device)
    if gen_device.startswith("cuda"):
        torch.cuda.empty_cache()
    total = time.perf_counter() - t0
    return {"dir": str(root), "target": tstats, "draft": dstats, "tokenizer": tok, "seconds": total,
            "gen_device": gen_device}


# ---- the server ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, timeout: float = 2.0) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


def server_env(triton_cache: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["TRITON_CACHE_DIR"] = str(triton_cache)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(triton_cache / "inductor")
    runtime_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (runtime_root, env.get("PYTHONPATH")) if p)
    return env


def start_server(args, ckpt: Path, triton_cache: Path, label: str, log_path: Path) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ddtree_runtime.server", "--target", str(ckpt / "target"),
           "--draft", str(ckpt / "draft"), "--mode", "ddtree", "--tree-budget", str(args.budget),
           "--device", args.device, "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port)]
    lines: list[tuple[float, str]] = []
    marks: dict[str, float] = {}
    res: dict = {"label": label, "triton_cache": "empty" if not any(triton_cache.rglob("*")) else "filled",
                 "command": " ".join(cmd[1:])}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=server_env(triton_cache))

    def reader() -> None:
        with open(log_path, "w") as f:
            for line in proc.stdout:
                t = time.perf_counter() - t0
                lines.append((t, line.rstrip("\n")))
                f.write(f"{t:8.3f} {line}")
                for name, rx in MARKERS.items():
                    m = rx.search(line)
                    if m and name not in marks:
                        marks[name] = t
                        if name == "loaded":
                            res["server_says_loaded_s"] = float(m.group(1))

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    first_answer = healthy = None
    health: dict = {}
    try:
        deadline = t0 + args.timeout
        while time.perf_counter() < deadline:
            if proc.poll() is not None:
                res["error"] = f"server exited with {proc.returncode} before it was healthy"
                break
            try:
                code, health = http("GET", base + "/health", timeout=1.0)
            except (OSError, ValueError):  # not listening yet
                code = None
            now = time.perf_counter() - t0
            if code is not None and first_answer is None:
                first_answer = now
            if code == 200 and health.get("status") == "ok":
                healthy = now
                break
            time.sleep(POLL_S)
        else:
            res["error"] = f"not healthy within {args.timeout}s"
        if healthy is not None and not args.no_request:
            res["requests"] = []
            for _ in range(2):
                t1 = time.perf_counter()
                code, body = http("POST", base + "/v1/completions",
                                  {"prompt": "def fib(n):", "max_tokens": args.request_tokens, "temperature": 0},
                                  timeout=args.timeout)
                res["requests"].append({"status": code, "seconds": time.perf_counter() - t1,
                                        "completion_tokens": (body.get("usage") or {}).get("completion_tokens")})
    finally:
        t_stop = time.perf_counter()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        res["stop_s"] = time.perf_counter() - t_stop
        th.join(timeout=5)
    res["returncode"] = proc.returncode
    res["first_http_answer_s"] = first_answer
    res["healthy_s"] = healthy
    res["health"] = health
    res["marks_s"] = dict(marks)
    if healthy is not None and {"load_begin", "loaded", "ready"} <= marks.keys():
        res["phases_s"] = {
            "launch_to_load_begin": marks["load_begin"],      # interpreter, imports, app, lifespan
            "engine_construction": marks["loaded"] - marks["load_begin"],  # tokenizer, weights, fuse, caches
            "warmup_generation": marks["ready"] - marks["loaded"],   # first graph captures, Triton kernels
            "ready_to_health_ok": healthy - marks["ready"],
        }
    quiet = [(t, s) for t, s in lines if "GET /health" not in s]  # the poll's access log lines
    res["log_tail"] = [f"{t:8.3f} {s}" for t, s in quiet[-40:]]
    return res


# ---- in-process breakdown (run in a fresh interpreter) -----------------------------------------------

def inproc(args) -> dict:
    t_start = time.perf_counter()
    out: dict = {}

    def mark(name: str, t: float) -> None:
        out[name] = time.perf_counter() - t

    t = time.perf_counter()
    import torch
    mark("import_torch_s", t)
    t = time.perf_counter()
    from transformers import AutoTokenizer

    from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
    from ddtree_runtime.model import load_drafter, load_target
    mark("import_runtime_s", t)
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        t = time.perf_counter()
        torch.zeros(1, device=args.device)
        sync()
        mark("cuda_init_s", t)
    tdir, ddir = str(Path(args.ckpt) / "target"), str(Path(args.ckpt) / "draft")
    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tdir)
    mark("tokenizer_s", t)
    t = time.perf_counter()
    target = load_target(tdir, args.device, args.dtype)
    sync()
    mark("load_target_s", t)
    t = time.perf_counter()
    drafter = load_drafter(ddir, args.device, args.dtype)
    sync()
    mark("load_drafter_s", t)
    out["weights_gb"] = sum(p.numel() * p.element_size() for m in (target, drafter) for p in m.parameters()) / 1e9
    t = time.perf_counter()
    engine = Engine(EngineConfig(tdir, ddir, mode="ddtree", tree_budget=args.budget, device=args.device,
                                 dtype=args.dtype), target=target, drafter=drafter, tokenizer=tok)
    sync()
    mark("engine_setup_s", t)  # everything Engine() does besides loading: fuse, KV caches, runners
    prompt = tok.encode("Hello", add_special_tokens=False)  # what the server's warm-up sends (worker.py)
    for i in (1, 2):
        t = time.perf_counter()
        n = sum(len(o.token_ids) for o in engine.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0.0)))
        sync()
        mark(f"warmup{i}_s", t)
        out[f"warmup{i}_tokens"] = n
    if cuda:
        out["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    out["total_s"] = time.perf_counter() - t_start
    return out


def run_inproc(args, ckpt: Path, triton_cache: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_inproc", "--ckpt", str(ckpt), "--device",
           args.device, "--dtype", args.dtype, "--budget", str(args.budget)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=server_env(triton_cache), timeout=args.timeout)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}", "stderr_tail": p.stderr[-3000:]}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["wall_s"] = wall  # interpreter start and exit included
    return res


# ---- driver ---------------------------------------------------------------------------------------

def fs_of(path: Path) -> dict:
    best = ("", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and str(path).startswith(parts[1]) and len(parts[1]) > len(best[0]):
                best = (parts[1], parts[2])
    except OSError:
        pass
    st = shutil.disk_usage(path)
    return {"mount": best[0], "fstype": best[1], "free_gb": st.free / 1e9}


def pick_root(args, need_bytes: int) -> Path:
    if args.workdir:
        base = Path(args.workdir)
    else:
        base = Path(tempfile.gettempdir())
        shm = Path("/dev/shm")
        if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1.3 * need_bytes:
            base = shm
    root = base / f"ddtree-start-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def model_shape(name: str) -> dict:
    """One table of model shapes for every benchmark: gpu_bench's (imported here: it pulls in torch)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_bench import SHAPES

    return dict(SHAPES[name])


def estimate_bytes(shape: str, dtype: str) -> int:
    s = model_shape(shape)
    h, i, v, hd = s["hidden_size"], s["intermediate_size"], s["vocab_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    layer = h * (q + 2 * kv) + q * h + 3 * h * i
    n = 2 * v * h + s["num_hidden_layers"] * layer + s["draft_layers"] * layer + len(s["target_layer_ids"]) * h * h
    return n * (4 if dtype == "float32" else 2)


def commit_id() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def fmt(x) -> str:
    return "-" if x is None else f"{x:7.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny random shapes (a CPU smoke test in seconds)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--budget", type=int, default=16, help="tree budget (default 16)")
    ap.add_argument("--workdir", help="where to write the checkpoints (default: /dev/shm if it has room, "
                    "else the temp dir)")
    ap.add_argument("--starts", type=int, default=2, help="server starts: the first with an empty Triton "
                    "cache, the rest with it filled (default 2)")
    ap.add_argument("--no-inproc", action="store_true", help="skip the in-process load/warm-up breakdown")
    ap.add_argument("--no-request", action="store_true", help="no completion request after healthy")
    ap.add_argument("--request-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=300.0, help="per start, seconds (default 300)")
    ap.add_argument("--keep", action="store_true", help="leave the checkpoints on disk")
    ap.add_argument("--commit", help="commit id to record (default: git rev-parse here)")
    ap.add_argument("--out", default="bench/results/start.json")
    ap.add_argument("--_inproc", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._inproc:
        print(json.dumps(inproc(args)))
        return 0

    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = "small" if args.small else "qwen3-8b"
    need = estimate_bytes(shape, args.dtype)
    root = pick_root(args, need)
    result: dict = {
        "commit": args.commit or commit_id(), "shape": shape, "device": args.device, "dtype": args.dtype,
        "mode": "ddtree", "tree_budget": args.budget,
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "storage": fs_of(root), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        import transformers
        result["transformers"] = transformers.__version__
    except ImportError:
        pass
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=2))

    try:
        log(f"writing {shape} checkpoints ({need / 1e9:.1f} GB {args.dtype}) to {root} "
            f"({result['storage']['fstype']})")
        gen_device = args.device if args.device.startswith("cuda") else "cpu"
        result["checkpoint"] = write_checkpoints(shape, args.dtype, root, gen_device)
        log(f"written in {result['checkpoint']['seconds']:.1f}s")
        save()
        cache = root / "triton-cache"
        result["starts"] = []
        for i in range(args.starts):
            label = "cold" if i == 0 else f"warm{i}"
            if i == 0:
                shutil.rmtree(cache, ignore_errors=True)
                cache.mkdir()
            log(f"server start {i + 1}/{args.starts} ({label} Triton cache)")
            r = start_server(args, root, cache, label, root / f"server-{label}.log")
            result["starts"].append(r)
            save()
            if r.get("error"):
                log(f"  {r['error']}")
                print("\n".join(r["log_tail"]))
                break
            log(f"  healthy after {r['healthy_s']:.2f}s")
        if not args.no_inproc:
            log("in-process breakdown (fresh interpreter, empty Triton cache)")
            cache2 = root / "triton-cache-inproc"
            shutil.rmtree(cache2, ignore_errors=True)
            cache2.mkdir()
            result["inproc"] = run_inproc(args, root, cache2)
            save()
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        save()

    ck = result.get("checkpoint", {})
    print()
    print(f"start to healthy: {shape} {args.dtype} on {result['gpu'] or args.device}, ddtree@{args.budget}, "
          f"checkpoints on {result['storage']['fstype']} ({(ck.get('target', {}).get('bytes', 0) + ck.get('draft', {}).get('bytes', 0)) / 1e9:.1f} GB)")
    print(f"  checkpoint write (not part of start): {fmt(ck.get('seconds'))} s")
    print(f"  {'start':<6} {'healthy':>8} {'imports':>8} {'engine':>8} {'(says)':>8} {'warm-up':>8} {'poll':>8} "
          f"{'listen':>8} {'req1':>8} {'req2':>8}")
    for r in result.get("starts", []):
        p = r.get("phases_s", {})
        reqs = r.get("requests") or [{}, {}]
        print(f"  {r['label']:<6} {fmt(r.get('healthy_s')):>8} {fmt(p.get('launch_to_load_begin')):>8} "
              f"{fmt(p.get('engine_construction')):>8} {fmt(r.get('server_says_loaded_s')):>8} "
              f"{fmt(p.get('warmup_generation')):>8} {fmt(p.get('ready_to_health_ok')):>8} "
              f"{fmt(r.get('marks_s', {}).get('listening')):>8} {fmt(reqs[0].get('seconds')):>8} "
              f"{fmt(reqs[-1].get('seconds')):>8}")
    ip = result.get("inproc")
    if ip and "error" not in ip:
        keys = ["import_torch_s", "import_runtime_s", "cuda_init_s", "tokenizer_s", "load_target_s",
                "load_drafter_s", "engine_setup_s", "warmup1_s", "warmup2_s", "total_s"]
        print("  in-process: " + ", ".join(f"{k[:-2]} {ip[k]:.2f}" for k in keys if k in ip) + " (s)")
        load = ip["load_target_s"] + ip["load_drafter_s"]
        print(f"  weight load alone (load_target + load_drafter): {load:.2f} s for {ip['weights_gb']:.1f} GB "
              f"({ip['weights_gb'] / load:.1f} GB/s)")
        for r in result.get("starts", []):
            if r.get("healthy_s") is not None:
                r["healthy_minus_weight_load_s"] = r["healthy_s"] - load
                print(f"  {r['label']}: start to healthy {r['healthy_s']:.2f} s = weight load {load:.2f} s + "
                      f"{r['healthy_minus_weight_load_s']:.2f} s (target: <= 30 s + weight load)")
        save()
    elif ip:
        print(f"  in-process: {ip['error']}\n{ip.get('stderr_tail', '')}")
    print(f"  JSON: {out_path}")
    ok = all(r.get("healthy_s") is not None for r in result.get("starts", [])) and result.get("starts")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Time one layer's decode attention (Qwen3-8B heads: 32 query / 8 KV heads of 128; --heads for others) on the GPU, with
an additive tree bias: SDPA, the split-KV kernel at a grid of launch shapes, and the kernel as the
rules in kernels.py configure it. Decides kernels.DECODE_ONE_SEQUENCE, DECODE_BATCH and
DECODE_BATCHED_ONE_QUERY (and where attend_decode uses the kernel).

    PYTHONPATH=runtime python runtime/bench/attn_probe.py             # one sequence, T 1..257
    PYTHONPATH=runtime python runtime/bench/attn_probe.py --batched   # batched rounds, with row lengths

--batched: B sequences, each over its own cache row of a kv_len bucket L whose real keys end earlier
(a batched round's rows: lengths = start + T, about 529 of a 1024 bucket, 4100 of 4608), bias as the
batch runner builds it (the context, then the tree's ancestors, nothing past the row's length). Per
case it prints SDPA, `old` (the one-sequence rule, which batched rounds ran before, no lengths),
`rule` (the rules now, with lengths), `rule-nolen` (the same without), `rule-shared` (lengths, no bias
read over the row's context: decode_attention's `shared`, as the engine runs passes with lengths),
`fitted` (the same with the split fitted to the rows' lengths, DDTREE_FIT_SPLIT=1, its plan made ahead as
a pass makes it once for all its layers: `fitted_split` in the JSON), `plan` (that plan's own time, once a
pass), and the grid's best each way; the JSON holds every grid point (rRsSwW-len / -nolen / -shared: BLOCK_R R,
split S keys, W warps; -len only for T = 1). --page-size reads the keys from a paged pool. The T=1
rows are the batched AR step: whether `rule` beats SDPA there decides DECODE_BATCHED_ONE_QUERY.
--mixed: row 0 keeps its ~`real` keys and every other row a sixteenth of them (one long request among
short ones: the grid is still the bucket's, so a split fitted to equal rows leaves most programs idle)."""

import argparse
import json
import itertools
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention.bias import causal_lower_right

from ddtree_runtime.model import kernels
from ddtree_runtime.model.kernels import DecodeLaunch, decode_attention, decode_launch
from ddtree_runtime.model.layers import attend_grouped
from ddtree_runtime.model.prompt_attention import attend_prompt, gather_pages
from ddtree_runtime.engine.runner import KV_BUCKET, prefill_kv_len

HQ, HKV, D = 32, 8, 128
DEVICE = "cuda"
SPLITS = (1, 2, 3, 4, 6, 8)   # the prefix's parts tried for a prompt piece (prompt_attention.attend_prompt)
# the batched sweep's grid; partial-softmax workspaces above this are skipped (they cost more than
# the keys and never win)
GRID_BLOCK_ROWS = (16, 32, 64, 128)
GRID_SPLITS = (64, 128, 256, 512, 1024)
GRID_WARPS = (4, 8)
GRID_STAGES = (3,)   # Triton's num_stages: the key loop's software pipelining
GRID_KEYS = (0,)     # keys per loop iteration (0: the kernel's choice, DecodeLaunch)
MAX_WORKSPACE = 512 << 20
PAGE = 0             # --page-size: the batched sweep reads a paged pool through block tables, as the engine


def timed(fn, reps: int = 20) -> float:
    """Microseconds per call on the device: reps calls captured in one CUDA graph, as the engine runs
    them (eager timing here would mostly measure this host's launch latency)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times) * 1e3 / reps


def single_sequence() -> None:
    """One sequence: T queries over 1K / 4.6K keys, the grid at each, and the one-sequence rule."""
    dev, dt = "cuda", torch.bfloat16
    for length in (1024, 4608):
        kbuf = torch.randn(1, HKV, 8192, D, device=dev, dtype=dt)
        vbuf = torch.randn_like(kbuf)
        k, v = kbuf[:, :, :length], vbuf[:, :, :length]  # strided views, as the cache gives them
        for t in (1, 17, 33, 65, 129, 257):
            q = torch.randn(1, HQ, t, D, device=dev, dtype=dt)
            ok = torch.rand(t, length, device=dev) < 0.9
            ok[:, 0] = True
            bias = torch.zeros(t, length, device=dev, dtype=dt).masked_fill(~ok, float("-inf"))[None, None]
            row = {"sdpa": timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                                        enable_gqa=True)),
                   "gemm": timed(lambda: attend_grouped(q, k, v, bias))}
            for split in (64, 128, 256, 512, 1024):
                for block_rows in (64, 128):
                    for warps in (4, 8):
                        launch = DecodeLaunch(block_rows, split, warps)
                        row[f"s{split}r{block_rows}w{warps}"] = timed(lambda: decode_attention(q, k, v, bias,
                                                                                                launch=launch))
            row["rule"] = timed(lambda: decode_attention(q, k, v, bias))
            print(f"L {length:5} T {t:3}: " + "  ".join(f"{name} {us:5.1f}us" for name, us in row.items()), flush=True)


def batched_case(batch: int, t: int, bucket: int, real: int, gen: torch.Generator, mixed: bool = False) -> dict:
    """One batched case's timings: rows of about `real` keys (start + T, a little apart per row) in
    a kv_len bucket of `bucket`; `mixed`: the rows after the first at a sixteenth of that."""
    dev, dt = DEVICE, torch.bfloat16
    kbuf = torch.randn(batch, HKV, bucket + 512, D, device=dev, dtype=dt)
    vbuf = torch.randn_like(kbuf)
    k, v = kbuf[:, :, :bucket], vbuf[:, :, :bucket]  # strided views of the pool's rows, as in a pass
    lengths = (real + torch.randint(-32, 33, (batch,), generator=gen)).clamp(t, bucket)
    if mixed:
        lengths[1:] = (lengths[1:] // 16).clamp(min=t)
    start = lengths - t
    cols = torch.arange(bucket)
    rel = cols[None, :] - start[:, None]                                          # [B, L]
    ancestors = torch.tril(torch.rand(batch, t, t, generator=gen) < 0.5) | torch.eye(t, dtype=torch.bool)
    in_tree = ancestors.gather(2, rel.clamp(0, t - 1)[:, None, :].expand(-1, t, -1))
    allowed = (rel < 0)[:, None, :] | ((rel < t)[:, None, :] & in_tree)           # [B, T, L]
    bias = torch.zeros(batch, 1, t, bucket, dtype=dt).masked_fill(~allowed[:, None], float("-inf")).to(dev)
    lengths = lengths.to(dev)
    q = torch.randn(batch, HQ, t, D, device=dev, dtype=dt)
    rows = HQ // HKV * t
    paged = {}
    if PAGE:  # the engine's layout: one pool of pages, each row's pages scattered in it (random values)
        width = -(-bucket // PAGE)
        pool = torch.randn(1, HKV, batch * width * PAGE, D, device=dev, dtype=dt)
        table = torch.randperm(batch * width, generator=gen).view(batch, width).to(dev)
        k = v = pool
        paged = dict(table=table, page_size=PAGE, length=bucket)

    def kernel(launch: DecodeLaunch | None, with_lengths: bool, shared: bool = False,
               plan: kernels.FitPlan | None = None) -> float:
        return timed(lambda: decode_attention(q, k, v, bias, lengths if with_lengths else None, launch=launch,
                                              shared=shared, plan=plan, **paged))

    old = decode_launch(batch, t, rows, bucket, HKV, rule=kernels.DECODE_ONE_SEQUENCE)
    sdpa_k, sdpa_v = (kbuf[:, :, :bucket], vbuf[:, :, :bucket])
    case = {"sdpa": timed(lambda: F.scaled_dot_product_attention(q, sdpa_k, sdpa_v, attn_mask=bias, enable_gqa=True)),
            "old": kernel(old, False), "rule": kernel(None, True), "rule-nolen": kernel(None, False),
            "rule-shared": kernel(None, True, True)}
    if batch > 1 and t > 1:  # the split fitted to the lengths (DDTREE_FIT_SPLIT=1): its time, which split, and
        # how far its result lies from the bucket's split's (the sums in another order)
        fitted, run, served = [], kernels.fitted_attention, kernels.DECODE_FIT_SPLIT
        kernels.fitted_attention = lambda *args: fitted.append(run(*args)) or fitted[-1]
        kernels.DECODE_FIT_SPLIT = True
        try:  # the plan made once, as a pass makes it for all its layers; and its own cost, once a pass
            plan = kernels.tree_attention_plan(lengths, bucket, t, HQ, HKV, D)
            case["fitted-shared"] = kernel(None, True, True, plan)
            if plan is not None:
                case["fit-plan"] = timed(lambda: kernels.tree_attention_plan(lengths, bucket, t, HQ, HKV, D))
            out = decode_attention(q, k, v, bias, lengths, shared=True, **paged)
        finally:
            kernels.fitted_attention, kernels.DECODE_FIT_SPLIT = run, served
        if fitted:   # (tiles the fit leaves to the bucket's split record nothing)
            bucket_rule = decode_launch(batch, t, rows, bucket, HKV)
            bucket_out = decode_attention(q, k, v, bias, lengths, launch=bucket_rule, shared=True, **paged)
            case["fitted_split"] = int(fitted[-1][0])
            case["fitted_max_abs_diff"] = (out.float() - bucket_out.float()).abs().max().item()
    grid = {}
    for block_rows in GRID_BLOCK_ROWS if t > 1 else (16,):
        rows_pad = -(-rows // block_rows) * block_rows
        for split in sorted({*GRID_SPLITS, triton.next_power_of_2(bucket)}):  # and one split (no reduce)
            n_splits = -(-bucket // split)
            if n_splits > 1 and batch * HKV * n_splits * rows_pad * D * 4 > MAX_WORKSPACE:
                continue
            for warps, stages, keys in itertools.product(GRID_WARPS, GRID_STAGES, GRID_KEYS):
                launch = DecodeLaunch(block_rows, split, warps, stages, keys)
                name = f"r{block_rows}s{split}w{warps}" + ("" if (stages, keys) == (3, 0) else f"p{stages}k{keys}")
                try:
                    if t == 1:
                        grid[f"{name}-len"] = kernel(launch, True)
                    grid[f"{name}-nolen"] = kernel(launch, False)
                    grid[f"{name}-shared"] = kernel(launch, True, True)
                except triton.runtime.errors.OutOfResources:  # too much shared memory for this device
                    continue
    case["grid"] = grid
    case["launch_old"] = old._asdict()
    case["launch_rule"] = decode_launch(batch, t, rows, bucket, HKV)._asdict()
    return case


def batched(batches: list[int], queries: list[int], buckets: list[int], out: str, mixed: bool = False) -> None:
    """The batched sweep: a table line per case, every timing in the JSON at `out`."""
    gen = torch.Generator().manual_seed(0)
    real_for = {1024: 529, 4608: 4100}
    report = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "heads": [HQ, HKV, D],
              "page_size": PAGE, "mixed": mixed, "unit": "us per call (CUDA graph)",
              "rules": {"one_sequence": kernels.DECODE_ONE_SEQUENCE._asdict(), "batch": kernels.DECODE_BATCH._asdict(),
                        "batched_one_query": kernels.DECODE_BATCHED_ONE_QUERY},
              "cases": []}
    print(f"{'B':>3} {'T':>3} {'L':>5} {'real':>5} | {'sdpa':>7} {'old':>7} {'rule':>7} {'rule-nl':>7} "
          f"{'shared':>7} {'fitted':>7} {'plan':>5} {'split':>6} | best with lengths (T = 1) | best without lengths | best shared")
    for bucket in buckets:
        real = real_for.get(bucket, bucket * 9 // 10)
        for t in queries:
            for batch in batches:
                case = batched_case(batch, t, bucket, real, gen, mixed)
                case.update(batch=batch, queries=t, bucket=bucket, real=real)
                report["cases"].append(case)
                grid = case["grid"]
                best = {tag: min(((us, name) for name, us in grid.items() if name.endswith(tag)),
                                 default=(float("nan"), "-")) for tag in ("-len", "-nolen", "-shared")}
                print(f"{batch:3} {t:3} {bucket:5} {real:5} | {case['sdpa']:7.1f} {case['old']:7.1f} "
                      f"{case['rule']:7.1f} {case['rule-nolen']:7.1f} {case['rule-shared']:7.1f} "
                      f"{case.get('fitted-shared', float('nan')):7.1f} {case.get('fit-plan', float('nan')):5.1f} "
                      f"{case.get('fitted_split', '-'):>6} | " +
                      " | ".join(f"{best[tag][1]:>22} {best[tag][0]:7.1f}" for tag in ("-len", "-nolen", "-shared")),
                      flush=True)
                torch.cuda.empty_cache()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


def quarter_octave(keys: int) -> int:
    """The smallest multiple of an eighth of the next doubling of KV_BUCKET that holds `keys`: four
    buckets an octave, padding at most 25% (against 100% for the doublings)."""
    doubling = prefill_kv_len(keys, 1 << 40, True)
    step = max(KV_BUCKET, doubling // 8)
    return -(-keys // step) * step


def prefill_case(width: int, context: int, gen: torch.Generator) -> dict:
    """One second turn's attention: `width` queries at positions context.. over the prefix and
    themselves (causal), in the buckets each candidate reads."""
    dev, dt = DEVICE, torch.bfloat16
    end = context + width
    buckets = {"doubling": prefill_kv_len(end, 1 << 40, True), "quarter": quarter_octave(end), "exact": end}
    most, page = buckets["doubling"], 16
    pool_k = torch.randn(1, HKV, most + 4 * page, D, device=dev, dtype=dt)
    pool_v = torch.randn_like(pool_k)
    pages = torch.randperm(most // page, generator=gen).to(dev)            # the row's pages, scattered
    index = (pages[:, None] * page + torch.arange(page, device=dev)).flatten()
    k_all, v_all = pool_k[:, :, index], pool_v[:, :, index]
    q = torch.randn(1, HQ, width, D, device=dev, dtype=dt)
    cols = torch.arange(most, device=dev)
    allowed = cols[None, :] <= context + torch.arange(width, device=dev)[:, None]   # [W, L]: causal
    bias = torch.zeros(width, most, device=dev, dtype=dt).masked_fill(~allowed, float("-inf"))[None, None]

    def sdpa(keys: int) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k_all[:, :, :keys], v_all[:, :, :keys],
                                              attn_mask=bias[..., :keys], enable_gqa=True)

    case: dict = {"width": width, "context": context, "buckets": buckets}
    for name, keys in buckets.items():
        case[f"sdpa-{name}"] = timed(lambda keys=keys: sdpa(keys))
        if name != "exact":
            case[f"gather-{name}"] = timed(lambda keys=keys: (pool_k[:, :, index[:keys]], pool_v[:, :, index[:keys]]))
    want = sdpa(end).float()
    lengths = torch.tensor([end], device=dev)
    # the runtime's path (layers.attend_static): the row's pages copied up to its length, then
    # FlashAttention-2's varlen kernel stopping there; and its parts, and FlashAttention over an index copy
    table = pages[None]

    def paged_flash() -> torch.Tensor:
        k = gather_pages(pool_k[0], table, page, lengths, most)
        return attend_prompt(q, k, gather_pages(pool_v[0], table, page, lengths, most), lengths)

    try:  # a torch build without FlashAttention-2 is reported, not a crash of the whole probe
        case["flash-paged"] = timed(paged_flash)
        case["flash-paged_max_abs_error"] = (paged_flash().float() - want).abs().max().item()
        case["gather-pages"] = timed(lambda: (gather_pages(pool_k[0], table, page, lengths, most),
                                              gather_pages(pool_v[0], table, page, lengths, most)))
        case["flash-over-doubling"] = timed(lambda: attend_prompt(q, k_all, v_all, lengths))
        case["flash-exact"] = timed(lambda: attend_prompt(q, k_all[:, :, :end], v_all[:, :, :end], lengths))
        for splits in SPLITS:  # the prefix in parts, merged (what attend_static picks: prompt_splits)
            case[f"flash-split{splits}"] = timed(lambda s=splits: attend_prompt(q, k_all, v_all, lengths, s))
            case[f"flash-split{splits}_max_abs_error"] = (attend_prompt(q, k_all, v_all, lengths, splits).float()
                                                          - want).abs().max().item()
    except RuntimeError as e:
        case["flash_error"] = str(e)[:300]
        print(f"flash path failed: {case['flash_error']}", flush=True)
    try:
        lower_right = causal_lower_right(width, end)
        case["sdpa-lower-right-exact"] = timed(lambda: F.scaled_dot_product_attention(
            q, k_all[:, :, :end], v_all[:, :, :end], attn_mask=lower_right, enable_gqa=True))
    except RuntimeError as e:
        case["sdpa-lower-right_error"] = str(e)[:300]
    grid, errors = {}, {}
    for block_rows, split, warps in itertools.product((64, 128), (1024, 2048, 4096), (4, 8)):
        launch = DecodeLaunch(block_rows, split, warps)
        name = f"r{block_rows}s{split}w{warps}"
        try:
            errors[name] = (decode_attention(q, k_all, v_all, bias, lengths, launch=launch).float()
                            - want).abs().max().item()
            grid[name] = timed(lambda launch=launch: decode_attention(q, k_all, v_all, bias, lengths, launch=launch))
        except triton.runtime.errors.OutOfResources:  # too much shared memory for this device
            continue
    case["kernel"], case["kernel_max_abs_error"] = grid, errors
    return case


def prefill(widths: list[int], contexts: list[int], out: str) -> None:
    """The second turn's attention per (width, context): a table line each, every timing in the JSON."""
    gen = torch.Generator().manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "heads": [HQ, HKV, D], "unit": "us per call (CUDA graph)",
              "cases": []}
    print(f"{'W':>4} {'C':>6} | sdpa: doubling  quarter    exact | gather: doubling quarter | flash: paged "
          f"(error) gather-pages over-doubling exact | kernel's best (error)")
    for context in contexts:
        for width in widths:
            case = prefill_case(width, context, gen)
            report["cases"].append(case)
            best = min(case["kernel"], key=case["kernel"].get, default=None)
            print(f"{width:4} {context:6} | {case['sdpa-doubling']:14.1f} {case['sdpa-quarter']:8.1f} "
                  f"{case['sdpa-exact']:8.1f} | {case['gather-doubling']:16.1f} {case['gather-quarter']:7.1f} | "
                  + (f"{case['flash-paged']:12.1f} ({case['flash-paged_max_abs_error']:.1e}) {case['gather-pages']:8.1f} "
                     f"{case['flash-over-doubling']:8.1f} {case['flash-exact']:6.1f} | " if "flash-paged" in case else "- | ")
                  + (f"{best} {case['kernel'][best]:.1f} ({case['kernel_max_abs_error'][best]:.1e})" if best else "-"),
                  flush=True)
            print("      flash with the prefix in parts: " + "  ".join(
                f"{s}: {case[f'flash-split{s}']:.1f}" for s in SPLITS if f"flash-split{s}" in case), flush=True)
            torch.cuda.empty_cache()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batched", action="store_true", help="the batched sweep (default: one sequence)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 17])
    ap.add_argument("--buckets", type=int, nargs="+", default=[1024, 4608])
    ap.add_argument("--out", default="bench/results/runtime-attn-probe-batched.json")
    ap.add_argument("--grid", nargs="+", default=[], metavar="DIM=V,V",
                    help="narrow or widen the batched grid: block_rows=, splits=, warps=, stages=, keys=")
    ap.add_argument("--prefill", type=int, nargs="+", default=[], metavar="W",
                    help="the second turn's pass instead: W queries after each of --contexts cached keys")
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384])
    ap.add_argument("--mixed", action="store_true",
                    help="--batched: one row of ~real keys, the others a sixteenth of it (one long request among short)")
    ap.add_argument("--page-size", type=int, default=0,
                    help="--batched: keys in a paged pool of pages this long (the engine's: 16), not one row each")
    ap.add_argument("--heads", default="32,8,128", metavar="HQ,HKV,D",
                    help="query heads, KV heads, head dim (Qwen3.6-27B's full attention: 24,4,256)")
    args = ap.parse_args()
    globals().update(zip(("HQ", "HKV", "D"), (int(v) for v in args.heads.split(","))))
    globals()["PAGE"] = args.page_size
    for spec in args.grid:
        dim, values = spec.split("=")
        globals()[f"GRID_{dim.upper()}"] = tuple(int(v) for v in values.split(","))
    if args.prefill:
        prefill(args.prefill, args.contexts, args.out)
    elif args.batched:
        batched(args.batches, args.queries, args.buckets, args.out, args.mixed)
    else:
        single_sequence()


if __name__ == "__main__":
    main()

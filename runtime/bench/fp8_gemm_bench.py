"""The block-scaled FP8 GEMM kernel by kernel (issue 35): every candidate at every (projection, rows) point
of a shape, under CUDA graphs, against bf16 F.linear, with its error and whether a row's result depends on
how many rows ran beside it.

    PYTHONPATH=runtime:runtime/bench python runtime/bench/fp8_gemm_bench.py [--shape qwen3.6-27b] [--out F.json]

Candidates (activation quantization counted in each FP8 one):
- `bf16`: F.linear on the bf16 weight;
- `scaled_mm`: torch.nn.functional.scaled_mm block-wise (cuBLASLt; rows padded to 16, Hopper only);
- `triton_old`: the kernel the runtime had before issue 35 (quantizing its tiles itself), read from an
  older fp8.py (`--legacy-fp8 PATH`, e.g. main's before the merge), at up to 272 rows;
- `triton[BMxBNwWsS]`: fp8.block_gemm at every tile of the sweep (tiles_for), the best one reported
  as `triton`; with `--groups`, at each count of K groups too (`...gG`: K summed in G groups, fp8.k_group);
- `fp8_runtime` (`--runtime`): fp8.fp8_linear as the engine runs it, after fp8.choose_gemms.
`--probe-scaled-mm` also lists, per shape, which row counts (fp8.PROBE_ROWS and the engine's largest
pass) give a row other bits in scaled_mm than among the most rows.
Each weight is copied until the copies pass three times the L2, and the timed calls rotate among them,
so no candidate reads its weight from cache. `row0_invariant`: the first row's output, bit for bit, is
the same at every row count (and, for Triton, at every tile). Not a test: figures depend on the machine."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from attn_probe import timed  # noqa: E402
from ddtree_runtime.model import fp8  # noqa: E402

# (name, N, K) of the projections as the engine runs them (fused)
SHAPES = {
    # the GDN in_proj: qkv, z, b and a, the 48-row b and a each padded to a 128-row block (layers.fuse_rows)
    "qwen3.6-27b": [("gdn_in_proj", 16640, 5120), ("attn_qkv", 14336, 5120), ("o_proj", 5120, 6144),
                    ("gate_up", 34816, 5120), ("down_proj", 5120, 17408)],
    "qwen3-8b": [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 24576, 4096), ("down_proj", 4096, 12288)],
}
ROWS = (1, 16, 17, 64, 128, 272, 4096)


def tiles_for(m: int) -> list[fp8.GemmTile]:
    """The sweep at m rows, in both families of tiles (family()): rows tiles of 16/32 and of 64/128."""
    small = ([fp8.GemmTile(16, bn, w, 4) for bn, w in ((32, 4), (64, 4), (128, 8))] if m <= 16 else
             [fp8.GemmTile(32, bn, w, s) for bn, w, s in ((32, 4, 4), (64, 4, 3), (128, 4, 3), (128, 8, 3))])
    large = [fp8.GemmTile(64, bn, 4, s) for bn, s in ((32, 4), (64, 4), (128, 3))]
    if m >= 1024:
        large += [fp8.GemmTile(128, 128, 8, 3), fp8.GemmTile(64, 256, 8, 3)]
    return small + large


def lean_tiles(m: int) -> list[fp8.GemmTile]:
    """A shorter sweep, two tiles per family at each row count (with --groups, each is timed per count)."""
    if m <= 16:
        return [fp8.GemmTile(*t) for t in ((16, 32, 4, 4), (16, 64, 4, 4), (64, 32, 4, 4), (64, 64, 4, 4))]
    if m <= 128:
        return [fp8.GemmTile(*t) for t in ((32, 32, 4, 4), (32, 64, 4, 3), (64, 32, 4, 4), (64, 64, 4, 4))]
    if m <= 1024:
        return [fp8.GemmTile(*t) for t in ((32, 64, 4, 3), (32, 128, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3))]
    return [fp8.GemmTile(*t) for t in ((32, 128, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (64, 256, 8, 3))]


def family(tile: fp8.GemmTile) -> str:
    """Tiles of 16 or 32 rows run mma.sync on a Hopper GPU, tiles of 64 or more wgmma: the two round a
    K block's dot differently (measured), so a row's bits are the same across the tiles of one family only."""
    return "triton_m32" if tile.block_m <= 32 else "triton_m64"


def timed_us(fns: list, reps: int = 24) -> float:
    """Microseconds per call: attn_probe.timed's CUDA graph of `reps` calls, rotating over `fns`."""
    calls = itertools.cycle(fns)
    return timed(lambda: next(calls)(), reps)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def bench_projection(name: str, n: int, k: int, rows: list[int], l2_bytes: int, old, log,
                     tiles=tiles_for, libraries: bool = True, runtime: bool = False,
                     groups: list[int | None] = (None,)) -> list[dict]:
    """Every candidate at each row count for one projection; `tiles(m)`: the Triton tiles timed, each
    at every count of K groups in `groups` (None: the runtime's, fp8.k_group)."""
    dev = torch.device("cuda")
    copies = max(1, min(8, -(-3 * l2_bytes // (n * k))))   # FP8 copies past 3x L2
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(max(1, -(-copies // 2)))]
    wq = [fp8.BlockFP8(*fp8.quantize_blocks(w16[i % len(w16)] * (1 + i / 64)), fp8.BLOCK) for i in range(copies)]
    if n % fp8.BLOCK:  # fused from parts not a multiple of 128 rows: the runtime keeps a scale per row
        wq = [fp8.BlockFP8(w.qweight, w.scale_inv.repeat_interleave(fp8.BLOCK, 0)[:n], 1) for w in wq]
    if runtime:  # what the engine decides at load, probed up to its largest pass (16 x 1025 rows)
        holder = torch.nn.Module()
        holder.weight = wq[0]
        log(f"  {name}: {fp8.choose_gemms(holder, dev, torch.bfloat16, 16 * 1025)}")
    x_all = torch.randn(max(rows), k, device=dev, dtype=torch.bfloat16)
    out_rows = []
    ref_row0: dict[str, torch.Tensor] = {}
    for m in rows:
        x = x_all[:m]
        want = fp8.fp8_linear_torch(x[:64].float(), wq[0])   # the torch reference, on the first 64 rows
        point = {"projection": name, "n": n, "k": k, "rows": m, "us": {}, "rel_err": {}, "row0_invariant": {}}

        def record(cand: str, fns, out0: torch.Tensor | None, tile: fp8.GemmTile | None = None,
                   arithmetic: str = "") -> None:
            try:
                point["us"][cand] = timed_us(fns)
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot run this size says why
                point["us"][cand] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                return
            if out0 is not None:
                point["rel_err"][cand] = rel_err(out0[:64], want)
                key = family(tile) + arithmetic if tile else cand
                first = out0[0].clone()
                same = bool(torch.equal(ref_row0.setdefault(key, first), first))
                point["row0_invariant"][key] = point["row0_invariant"].get(key, True) and same

        if libraries:
            record("bf16", [lambda w=w: F.linear(x, w) for w in w16], None)
            try:
                o = fp8.scaled_mm_gemm(x, wq[0])
                record("scaled_mm", [lambda w=w: fp8.scaled_mm_gemm(x, w) for w in wq], o)
            except Exception as exc:  # noqa: BLE001
                point["us"]["scaled_mm"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        if runtime:
            record("fp8_runtime", [lambda w=w: fp8.fp8_linear(x, w) for w in wq], fp8.fp8_linear(x, wq[0]))
            res = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
            got = fp8.fp8_linear(x, wq[0], residual=res.clone())
            point["rel_err"]["fp8_runtime_residual"] = rel_err(got[:64] - res[:64], want)
        if old is not None and m <= 272:
            record("triton_old", [lambda w=w: old(x, w) for w in wq], old(x, wq[0]))
        for t, g in itertools.product(tiles(m), groups):
            blocks = None if g is None else fp8.cdiv(fp8.cdiv(k, fp8.BLOCK), g)
            cand = f"triton[{t.block_m}x{t.block_n}w{t.warps}s{t.stages}]" + ("" if g is None else f"g{g}")
            try:
                o = fp8.block_gemm(x, wq[0], t, group=blocks)
            except Exception as exc:  # noqa: BLE001 - Triton's out-of-resources, per tile
                point["us"][cand] = f"{type(exc).__name__}"
                continue
            record(cand, [lambda w=w, t=t: fp8.block_gemm(x, w, t, group=blocks) for w in wq], o, t,
                   "" if g is None else f"g{g}")
        tri = {c: v for c, v in point["us"].items() if c.startswith("triton[") and isinstance(v, float)}
        for cand, v in sorted(tri.items()):
            log(f"    {cand} {v:.1f}")
        best = min(tri, key=tri.get) if tri else None
        point["triton_best"] = best
        point["us"]["triton"] = tri[best] if best else None
        for fam in ("triton_m32", "triton_m64"):
            mine = {c: v for c, v in tri.items() if family(fp8.GemmTile(*parse_tile(c))) == fam}
            if mine:
                point[f"{fam}_best"] = min(mine, key=mine.get)
                point["us"][fam] = mine[point[f"{fam}_best"]]
        log(f"  {name:<12} rows {m:>5}: " + "  ".join(
            f"{c} {v:.1f}" if isinstance(v, float) else f"{c} {str(v)[:60]}" for c, v in point["us"].items()
            if not c.startswith("triton[")) + f"  ({best}; err {point['rel_err'].get(best, float('nan')):.1e};"
            f" row-invariant {point['row0_invariant']})")
        out_rows.append(point)
    del w16, wq, x_all
    torch.cuda.empty_cache()
    return out_rows


def parse_tile(cand: str) -> list[int]:
    """"triton[BMxBNwWsS]" (and a "gG" after it) -> [BM, BN, W, S]."""
    bm, rest = cand[len("triton["):cand.index("]")].split("x")
    bn, rest = rest.split("w")
    w, st = rest.split("s")
    return [int(bm), int(bn), int(w), int(st)]


def scaled_mm_classes(n: int, k: int, rows: list[int], log) -> dict[int, bool]:
    """Row count -> whether scaled_mm gives its first min(rows, 16) rows the bits they have among max(rows)
    (random data; what fp8.choose_gemms probes, listed)."""
    dev = torch.device("cuda")
    w = fp8.BlockFP8(*fp8.quantize_blocks(torch.randn(n, k, device=dev) * 0.02), fp8.BLOCK)
    x = torch.randn(max(rows), k, device=dev, dtype=torch.bfloat16)
    full = fp8.scaled_mm_gemm(x, w)
    same = {m: bool(torch.equal(fp8.scaled_mm_gemm(x[:m], w)[:16], full[:min(m, 16)])) for m in rows}
    log(f"  scaled_mm {n}x{k}: rows whose bits differ from {max(rows)} rows': {[m for m, ok in same.items() if not ok]}")
    return same


def best_tiles(points: list[dict], key: str = "triton_best") -> dict[str, list]:
    """"N,K" -> [[rows, [block_m, block_n, warps, stages]], ...]: the fastest tile at each row count
    (key: "triton_best", or one family's, e.g. "triton_m32_best")."""
    table: dict[str, list] = {}
    for p in points:
        if p.get(key):
            table.setdefault(f"{p['n']},{p['k']}", []).append([p["rows"], parse_tile(p[key])])
    return table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.6-27b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--legacy-fp8", help="an older model/fp8.py whose fp8_linear is timed as triton_old")
    ap.add_argument("--runtime", action="store_true",
                    help="bf16 against fp8_linear as the engine runs it (choose_gemms' choice per shape) only")
    ap.add_argument("--triton-only", action="store_true", help="the Triton tiles alone (no bf16, scaled_mm)")
    ap.add_argument("--groups", help="counts of K groups each tile is timed at (e.g. 1,2,4,8; default: fp8.k_group's)")
    ap.add_argument("--lean", action="store_true", help="two tiles per family and row count (lean_tiles)")
    ap.add_argument("--projections", help="only these projections of the shape (names, comma-separated)")
    ap.add_argument("--probe-scaled-mm", action="store_true",
                    help="first, per projection, the row counts at which scaled_mm changes a row's bits")
    ap.add_argument("--tiles-out", help="also write the fastest tile per (N, K, rows) here (fp8.TILES' form)")
    ap.add_argument("--out", default="bench/results/runtime-fp8-gemm-bench.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 60 << 20)
    old = None
    if args.legacy_fp8:
        spec = importlib.util.spec_from_file_location("legacy_fp8", args.legacy_fp8)
        legacy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(legacy)
        old = legacy.fp8_linear
    report = {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
              "torch": torch.__version__, "shape": args.shape, "unit": "us per call (CUDA graph)", "points": []}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    shapes = [s for s in SHAPES[args.shape] if not args.projections or s[0] in args.projections.split(",")]
    groups = [int(g) for g in args.groups.split(",")] if args.groups else [None]
    tiles = (lambda m: []) if args.runtime else lean_tiles if args.lean else tiles_for
    with torch.inference_mode():
        if args.probe_scaled_mm:
            probe = sorted(set(fp8.PROBE_ROWS) | {16 * 1025})
            report["scaled_mm_rows_same"] = {f"{n}x{k}": scaled_mm_classes(n, k, probe, print) for _, n, k in shapes}
        for name, n, k in shapes:
            report["points"] += bench_projection(name, n, k, [int(r) for r in args.rows.split(",")], l2, old,
                                                 lambda s: print(s, flush=True), libraries=not args.triton_only,
                                                 runtime=args.runtime, tiles=tiles, groups=groups)
            Path(args.out).write_text(json.dumps(report, indent=1))   # kept as it grows
    if args.tiles_out:
        Path(args.tiles_out).write_text(json.dumps({fam: best_tiles(report["points"], f"{fam}_best")
                                                    for fam in ("triton_m32", "triton_m64")}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

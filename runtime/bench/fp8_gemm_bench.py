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
  as `triton`; with `--groups`, at each count of K groups too (`...gG`: K summed in G groups, fp8.k_group;
  a count k_group gives is timed once, unnamed);
- `triton_wm[BTxBNwWsS]`: the kernel's weight-major variant (fp8.GemmTile.weights_left: the W tile of BN
  rows as the MMA's M side, BT tokens on the other) at every tile of weight_major_tiles, the best one
  reported as `triton_wm`; `--weight-major-only` times it without the row-major tiles (bf16 and scaled_mm
  still beside it), at k_group's groups and at one group;
- `fp8_runtime` (`--runtime`): fp8.fp8_linear as the engine runs it, after fp8.choose_gemms.
`--probe-scaled-mm` also lists, per shape, which row counts (fp8.PROBE_ROWS and the engine's largest
pass) give a row other bits in scaled_mm than among the most rows.
Each weight is copied until the copies pass three times the L2, and the timed calls rotate among them,
so no candidate reads its weight from cache. `rows_invariant`: the first 64 rows' outputs (all of them
below 64), bit for bit, are the same at every row count (and, for Triton, at every tile of a family).
`--large`: the lean weight-major sweep and, from 64 rows, the row-major wgmma family's large tiles
(wgmma_tiles: `_tail` where the rows leave a last tile of 16 or fewer, taken weight-major), each also
with its operands read by tensor descriptors (`_tma`: Hopper's bulk copies), at
k_group's groups, beside bf16, scaled_mm and the runtime: whether one arithmetic can serve every row count
of a shape at no more than bf16's time.
`weight_major_agreement`, per projection and count of K groups: whether every weight-major tile at every
row count gave those rows the same bits, and whether they are the bits of the row-major kernel's 64-row
(wgmma) family. Not a test: figures depend on the machine."""

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


def weight_major_tiles(m: int, lean: bool = False, spilling: bool = False) -> list[fp8.GemmTile]:
    """The weight-major sweep at m rows: W tiles of 64 or 128 rows (wgmma's M side, filled at any row
    count), the three largest token tiles (BLOCK_T) from 16 to the rows' next power of two (at most 256:
    a smaller one walks W once per tile of tokens), 4 or 8 warps, 3 or 4 stages. lean: the two largest
    token tiles, (4 warps, 4 stages) and (8, 3). Tiles of more than 2048 outputs a warp spill 816-3200
    bytes of registers on sm90 (sm90_report.py) and are left out unless `spilling`."""
    top = min(256, max(16, 1 << (m - 1).bit_length()))
    tokens = [t for t in (16, 32, 64, 128, 256) if t <= top][-2 if lean else -3:]
    launches = ((4, 4), (8, 3)) if lean else ((4, 3), (4, 4), (8, 3), (8, 4))
    return [fp8.GemmTile(t, bn, w, st, True) for bn in (64, 128) for t in tokens for w, st in launches
            if spilling or t * bn <= 2048 * w]


def wgmma_tiles(m: int) -> list[fp8.GemmTile]:
    """From 64 rows, the large tiles of the 64-row (wgmma) family that a large row count may want (one
    accumulator beside the dot's tile since the kernel sums a lone K group without a second): 64x128
    (4 warps), 128x64 (4), 128x128 (8) at 3 and 4 stages, 64x256 (8) at 3; where m leaves a tile's last
    rows fp8.TAIL_ROWS or fewer (272 rows: 16), each such tile with that last tile weight-major (`_tail`);
    where m leaves a tile's last rows short, each tile and tail launch with x's codes padded to whole tiles
    (`_pad`, `_tail_pad`; TMA tiles only: no bulk copy reads past the matrix)."""
    if m < 64:
        return []
    tiles = ([fp8.GemmTile(bm, bn, w, st) for bm, bn, w in ((64, 128, 4), (128, 64, 4), (128, 128, 8))
              for st in (3, 4)] + [fp8.GemmTile(64, 256, 8, 3)])
    tails = [t._replace(tail=True) for t in tiles if 0 < m % t.block_m <= fp8.TAIL_ROWS]
    padded = [t._replace(padded=True) for t in tiles + tails if m % t.block_m]
    return tiles + tails + padded


def family(tile: fp8.GemmTile) -> str:
    """Tiles of 16 or 32 rows run mma.sync on a Hopper GPU, tiles of 64 or more wgmma: the two round a
    K block's dot differently (measured), so a row's bits are the same across the tiles of one family only.
    The weight-major tiles are a family of their own until the GPU shows whose bits they share."""
    if tile.weights_left:
        return "triton_wm"
    return "triton_m32" if tile.block_m <= 32 else "triton_m64"


def candidate(tile: fp8.GemmTile) -> str:
    """A tile's name in the report: "triton[BMxBNwWsS]", "triton_wm[BTxBNwWsS]" for a weight-major one,
    with "_tma" before the bracket where its operands come by tensor descriptors, "_tail" where its
    last tile of rows runs weight-major (GemmTile.tail) and "_pad" where x's codes are padded to whole
    tiles of rows (GemmTile.padded)."""
    kinds = (("_wm", tile.weights_left), ("_tma", tile.tma), ("_tail", tile.tail), ("_pad", tile.padded))
    return (f"triton{''.join(name for name, on in kinds if on)}"
            f"[{tile.block_m}x{tile.block_n}w{tile.warps}s{tile.stages}]")


def timed_us(fns: list, reps: int = 24) -> float:
    """Microseconds per call: attn_probe.timed's CUDA graph of `reps` calls, rotating over `fns`."""
    calls = itertools.cycle(fns)
    return timed(lambda: next(calls)(), reps)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def bench_projection(name: str, n: int, k: int, rows: list[int], l2_bytes: int, old, log,
                     tiles=tiles_for, libraries: bool = True, runtime: bool = False,
                     groups: list[int | None] = (None,)) -> tuple[list[dict], dict[str, dict]]:
    """Every candidate at each row count for one projection; `tiles(m)`: the Triton tiles timed, each
    at every count of K groups in `groups` (None: the runtime's, fp8.k_group). Returns the points and,
    where weight-major tiles ran, their agreement (module docstring)."""
    dev = torch.device("cuda")
    blocks_k = fp8.cdiv(k, fp8.BLOCK)
    runtime_groups = fp8.cdiv(blocks_k, fp8.k_group(n, k, fp8._device_limits(0)[0]))
    groups = list(dict.fromkeys(None if g == runtime_groups else g for g in groups))
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
    ref_rows: dict[str, torch.Tensor] = {}   # per family and arithmetic: the first rows seen, up to 64
    for m in rows:
        x = x_all[:m]
        want = fp8.fp8_linear_torch(x[:64].float(), wq[0])   # the torch reference, on the first 64 rows
        point = {"projection": name, "n": n, "k": k, "rows": m, "us": {}, "rel_err": {}, "rows_invariant": {}}

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
                got = out0[:64]
                seen = ref_rows.setdefault(key, got.clone())
                shared = min(len(seen), len(got))
                same = bool(torch.equal(seen[:shared], got[:shared]))
                if len(got) > len(seen):
                    ref_rows[key] = got.clone()
                point["rows_invariant"][key] = point["rows_invariant"].get(key, True) and same

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
            blocks = None if g is None else fp8.cdiv(blocks_k, g)
            cand = candidate(t) + ("" if g is None else f"g{g}")
            try:
                o = fp8.block_gemm(x, wq[0], t, group=blocks)
            except Exception as exc:  # noqa: BLE001 - Triton's out-of-resources, per tile
                point["us"][cand] = f"{type(exc).__name__}"
                continue
            record(cand, [lambda w=w, t=t: fp8.block_gemm(x, w, t, group=blocks) for w in wq], o, t,
                   "" if g is None else f"g{g}")
        tiled = {c: v for c, v in point["us"].items() if "[" in c and isinstance(v, float)}
        for cand, v in sorted(tiled.items()):
            log(f"    {cand} {v:.1f}")
        tri = {c: v for c, v in tiled.items() if c.startswith("triton[")}   # the row-major kernel's
        best = min(tri, key=tri.get) if tri else None
        point["triton_best"] = best
        point["us"]["triton"] = tri[best] if best else None
        for fam in ("triton_m32", "triton_m64", "triton_wm"):
            mine = {c: v for c, v in tiled.items() if family(parse_tile(c)) == fam}
            if mine:
                point[f"{fam}_best"] = min(mine, key=mine.get)
                point["us"][fam] = mine[point[f"{fam}_best"]]
        log(f"  {name:<12} rows {m:>5}: " + "  ".join(
            f"{c} {v:.1f}" if isinstance(v, float) else f"{c} {str(v)[:60]}" for c, v in point["us"].items()
            if "[" not in c) + f"  ({best}; err {point['rel_err'].get(best, float('nan')):.1e};"
            f" rows-invariant {point['rows_invariant']})")
        out_rows.append(point)
    agreement = {}
    for g in groups:
        key = "triton_wm" + ("" if g is None else f"g{g}")
        if key in ref_rows:   # the row-major kernel's 64-row family on the same rows, same groups
            seen = ref_rows[key]
            m64 = fp8.block_gemm(x_all[:len(seen)], wq[0], fp8.GemmTile(64, 64, 4, 4),
                                 group=None if g is None else fp8.cdiv(blocks_k, g))
            agreement[key] = {"tiles_and_rows_agree": all(p["rows_invariant"].get(key, True) for p in out_rows),
                              "equals_triton_m64": bool(torch.equal(m64, seen))}
            log(f"  {name}: {key} {agreement[key]}")
    del w16, wq, x_all
    torch.cuda.empty_cache()
    return out_rows, agreement


def parse_tile(cand: str) -> fp8.GemmTile:
    """candidate()'s name (and a "gG" after it) -> its tile."""
    bm, rest = cand[cand.index("[") + 1:cand.index("]")].split("x")
    bn, rest = rest.split("w")
    w, st = rest.split("s")
    kind = cand[:cand.index("[")].split("_")
    return fp8.GemmTile(int(bm), int(bn), int(w), int(st), "wm" in kind, "tma" in kind, "tail" in kind,
                        "pad" in kind)


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
    """"N,K" -> [[rows, [block_m, block_n, warps, stages, weights_left]], ...]: the fastest tile at each
    row count (key: "triton_best", or one family's, e.g. "triton_m32_best")."""
    table: dict[str, list] = {}
    for p in points:
        if p.get(key):
            table.setdefault(f"{p['n']},{p['k']}", []).append([p["rows"], list(parse_tile(p[key]))])
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
    ap.add_argument("--weight-major-only", action="store_true",
                    help="the weight-major tiles (weight_major_tiles) and no row-major ones, beside bf16 and "
                         "scaled_mm in the same call, at k_group's groups and one group unless --groups says")
    ap.add_argument("--large", action="store_true",
                    help="the lean weight-major sweep and, from 64 rows, the wgmma family's large row-major "
                         "tiles, with --runtime's figures (module docstring)")
    ap.add_argument("--lean", action="store_true",
                    help="two tiles per family and row count (lean_tiles), a shorter weight-major sweep")
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
    groups = ([int(g) for g in args.groups.split(",")] if args.groups else
              [None, 1] if args.weight_major_only else [None])
    def by_tma_too(tiles: list[fp8.GemmTile]) -> list[fp8.GemmTile]:   # padded: TMA only
        return [t for t in tiles if not t.padded] + [t._replace(tma=True) for t in tiles]
    row_major = ((lambda m: by_tma_too(wgmma_tiles(m))) if args.large else
                 (lambda m: []) if args.runtime or args.weight_major_only else lean_tiles if args.lean else tiles_for)
    weight_major = args.large or args.weight_major_only or not args.runtime

    def tiles(m: int) -> list[fp8.GemmTile]:
        swept = weight_major_tiles(m, args.lean or args.large) if weight_major else []
        return row_major(m) + (by_tma_too(swept) if args.large else swept)
    with torch.inference_mode():
        if args.probe_scaled_mm:
            probe = sorted(set(fp8.PROBE_ROWS) | {16 * 1025})
            report["scaled_mm_rows_same"] = {f"{n}x{k}": scaled_mm_classes(n, k, probe, print) for _, n, k in shapes}
        for name, n, k in shapes:
            points, agreement = bench_projection(
                name, n, k, [int(r) for r in args.rows.split(",")], l2, old, lambda s: print(s, flush=True),
                libraries=not args.triton_only, runtime=args.runtime or args.large, tiles=tiles,
                groups=groups)
            report["points"] += points
            if agreement:
                report.setdefault("weight_major_agreement", {})[name] = agreement
            Path(args.out).write_text(json.dumps(report, indent=1))   # kept as it grows
    if args.tiles_out:
        Path(args.tiles_out).write_text(json.dumps({fam: best_tiles(report["points"], f"{fam}_best")
                                                    for fam in ("triton_m32", "triton_m64", "triton_wm")}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""The Gated DeltaNet tree verify of one linear layer at the Qwen3.6-27B shape (48 value heads, 16 key heads,
dk = dv = 128, conv 4; 48 such layers a step), B rows of a T-node tree each (T = 17: ddtree@16), on the GPU:

    recurrence   gated_delta_torch (today's torch: path sums by matmul, [B, H, T, T] decays, float32
                 GEMMs against the state, a batched triangular solve) against gdn_kernels.tree_delta (one
                 launch: a (row, head)'s whole tree per program, the state read once) at its default
                 launch and a grid of others (precision, solve, tiles, warps)
    the layer    each piece of GatedDeltaNet.forward's tree pass: the fused in-projection (GEMM), the
                 torch ops that split it and make beta and g (`split_beta_g`, before the kernel made
                 them), conv_heads (alone; as the layer calls it, also writing the inputs and keys into
                 the cache's scratch; so again at each of CONV_LAUNCHES, whose bits each must equal the
                 first's, the grid as it was before them), the recurrence (torch; the kernel; the
                 kernel as the layer calls it, making the gates and writing into the scratch), the
                 save_step copies those writes removed, gated_norm, the out-projection (GEMM), and the
                 residual add its GEMM now does in place; and the whole layer forward as before the kernel
                 (`layer-torch`: torch gates and recurrence) and now (`layer-kernel`), and their outputs'
                 difference (bf16 rounding: under 5e-2 of the largest)

Every timing is a CUDA graph of 20 calls (attn_probe.timed), in microseconds per call; `x48` is per step.
The recurrence's calls take copies of their inputs in turn, past three times the L2 together (`input_sets`), as
a step's layers each read their own state (with the inputs of one call the state stayed in the L2 at 8 rows
and 1, and a launch that read it twice came out faster here and slower in the round: session 30).
Self-checking: before timing, every kernel launch is compared with the torch recurrence computed in float64
(relative error: max |diff| / max |reference|, printed, with torch float32's own); a NaN, or the default
launch over its bound, marks the case FAIL and the script exits 1 after writing its JSON. A launch that
does not compile is reported with its error and skipped.

The floor: the kernel must read each row's state once (B x 48 x 128 x 128 x 4 bytes a layer) plus its
inputs and outputs; `floor_us` is those bytes over the copy bandwidth measured here (gpu_bench).

    PYTHONPATH=runtime python runtime/bench/gdn_tree_bench.py [--batch 1 8 16] [--nodes 17] [--out F.json]
    PYTHONPATH=runtime python runtime/bench/gdn_tree_bench.py --tiny     # CPU, small dims, Triton's interpreter
"""

from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv:  # before Triton loads: the kernels then run in its interpreter on the CPU
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import measure_ceilings, target_config_of  # noqa: E402

import ddtree_runtime.model.gated_delta as gated_delta_module  # noqa: E402
from ddtree_runtime.engine.kv_cache import target_cache  # noqa: E402
from ddtree_runtime.engine.tree import ancestor_mask  # noqa: E402
from ddtree_runtime.model import Qwen35Config  # noqa: E402
from ddtree_runtime.model import gdn_kernels  # noqa: E402
from ddtree_runtime.model.gated_delta import Paths, gated_delta_torch, tree_paths  # noqa: E402
from ddtree_runtime.model.gdn_kernels import (ConvHeadsLaunch, Gates, TreeDeltaLaunch, conv_heads,  # noqa: E402
                                              gated_norm, tree_delta)
from ddtree_runtime.model.layers import TreeInputs, linear  # noqa: E402
from ddtree_runtime.model import qwen3_5  # noqa: E402
from ddtree_runtime.model.qwen3_5 import GatedDeltaNet  # noqa: E402

# Bounds against float64. u, which the commit folds into the state, within float32-like error (TF32x3);
# the output, which the layer rounds to 16 bits after its norm, within bf16's half ulp (2^-9). Launches
# outside them are only reported (plain TF32 everywhere is ~1e-3 on both by design).
MAX_ERROR = 1e-4
MAX_OUTPUT_ERROR = 2.0 ** -9
LAYERS = 48   # the 27B's linear layers: a step reads 48 states


def qualifies(result: dict) -> bool:
    return ("us" in result and not result["nan"] and result["u_error"] < MAX_ERROR
            and result["error"] < MAX_OUTPUT_ERROR)


LAUNCHES = [TreeDeltaLaunch(block_k=64, block_v=64, precision=p, squaring=s) for p in ("tf32x3", "ieee", "tf32") for s in (False, True)] + [
    TreeDeltaLaunch(block_k=k, block_v=v, warps=w, squaring=s)
    for k, v, w in ((32, 32, 4), (64, 32, 4), (32, 64, 4), (64, 128, 8), (128, 64, 8), (64, 64, 8), (32, 128, 4))
    for s in (False, True)] + [
    # the output's products in one TF32 product, u's in three (the commit keeps u in the state)
    TreeDeltaLaunch(block_k=k, block_v=64, warps=w, output_precision="tf32")
    for k, w in ((32, 4), (32, 8), (64, 4))] + [TreeDeltaLaunch(block_k=32, block_v=64, warps=8),
                                                TreeDeltaLaunch(block_k=32, block_v=64, precision="tf32")] + [
    # float32 FMAs where three TF32 products were, with the served tiles
    TreeDeltaLaunch(block_k=32, block_v=v, warps=w, precision="ieee") for v, w in ((64, 4), (128, 4), (128, 8))] + [
    # the root taken apart: a 17-node tree in blocks of 16
    TreeDeltaLaunch(block_k=k, block_v=v, warps=w, precision=p, peel=True)
    for k, v, w, p in ((32, 64, 4, "tf32x3"), (32, 128, 4, "tf32x3"), (64, 128, 4, "tf32x3"), (32, 128, 8, "tf32x3"),
                       (32, 64, 4, "ieee"), (32, 128, 4, "ieee"), (32, 64, 2, "tf32x3"), (32, 128, 2, "tf32x3"))] + [
    # dk in chunks of 16: 166-168 registers where 32-chunks take 243-255 (sm90_report.py, compiled offline),
    # so 3 programs share an SM at 4 warps, 6 at 2 (k16-v128: every column in one program, no kk recomputed)
    TreeDeltaLaunch(block_k=16, block_v=v, warps=w, precision=p, peel=True)
    for v, w, p in ((64, 4, "tf32x3"), (128, 4, "tf32x3"), (32, 2, "tf32x3"), (64, 2, "tf32x3"), (32, 4, "ieee"),
                    (64, 4, "ieee"))]


def launch_name(launch: TreeDeltaLaunch) -> str:
    out = f"-out-{launch.output_precision}" if launch.output_precision else ""
    return (f"k{launch.block_k}-v{launch.block_v}-w{launch.warps}-{launch.precision}{out}"
            + ("-squaring" if launch.squaring else "") + ("-peel" if launch.peel else ""))


# conv_heads's launches: the old grid (a program per node, value head and row) and the per-key-head ones
CONV_LAUNCHES = [ConvHeadsLaunch(per_key=False), ConvHeadsLaunch()] + [
    ConvHeadsLaunch(nodes=n, warps=w) for n, w in ((1, 2), (1, 8), (2, 4), (4, 4))]


def conv_launch_name(launch: ConvHeadsLaunch) -> str:
    return f"{'key' if launch.per_key else 'value'}-t{launch.nodes}-w{launch.warps}"


def conv_launches(conv_args: tuple, scratch_k: torch.Tensor, keep: torch.Tensor, device: torch.device) -> dict:
    """conv_heads as the layer calls it (k and the inputs into the scratch) at each of CONV_LAUNCHES: us,
    and whether its q, k, v have the bits of the first, the grid before ConvHeadsLaunch (a program per
    value head: on the H200 it gave the bits of the kernel before, which this script then carried), else
    the largest difference."""
    before = [x.clone() for x in conv_heads(*conv_args, launch=CONV_LAUNCHES[0])]
    cases = {}
    for launch in CONV_LAUNCHES:
        got = conv_heads(*conv_args, launch=launch)
        diff = max((a - b).abs().max().item() for a, b in zip(got, before))
        cases[conv_launch_name(launch)] = {
            "us": measure(lambda launch=launch: conv_heads(*conv_args, k=scratch_k, keep=keep, launch=launch), device),
            "same_bits": all(torch.equal(a, b) for a, b in zip(got, before)), "max_diff": diff}
    return cases


def measure(fn: Callable[[], object], device: torch.device) -> float:
    """Microseconds per call: a CUDA graph of 20 calls on the GPU; on the CPU (--tiny: only that the
    script runs) one call."""
    if device.type == "cuda":
        from attn_probe import timed
        return timed(fn)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def measure_rotating(fn: Callable[..., object], inputs: list[tuple], device: torch.device) -> float:
    """`measure` of fn(*inputs[i]), the calls taking the sets of inputs in turn: a step's 48 layers each
    read their own state, never one the L2 still holds (with one set a launch that read the state twice
    came out faster alone and slower in the round: session 30)."""
    sets = itertools.cycle(inputs)
    return measure(lambda: fn(*next(sets)), device)


def input_copies(inputs: tuple[torch.Tensor, ...], device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """`inputs` and copies of them (strides kept), past three times the GPU's L2 together, at most one a
    layer; on the CPU the inputs alone."""
    if device.type != "cuda":
        return [inputs]
    size = sum(x.numel() * x.element_size() for x in inputs)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    count = max(1, min(LAYERS, -(-3 * l2 // size)))
    return [inputs] + [tuple(x.clone() for x in inputs) for _ in range(count - 1)]


def random_trees(batch: int, nodes: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row its own tree: every node's parent drawn among the earlier ones. -> mask [B, T, T], depth [B, T]."""
    parents = torch.zeros(batch, nodes, dtype=torch.long)
    depth = torch.zeros(batch, nodes, dtype=torch.long)
    for i in range(1, nodes):
        parents[:, i] = torch.randint(0, i, (batch,), generator=gen)
        depth[:, i] = depth.gather(1, parents[:, i:i + 1])[:, 0] + 1
    return ancestor_mask(parents, nodes), depth


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error over the largest magnitude; `want` (float64) may live on the host."""
    want = want.to(got.device)
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def recurrence_case(cfg: Qwen35Config, batch: int, nodes: int, device: torch.device, gen: torch.Generator,
                    launches: list[TreeDeltaLaunch] = LAUNCHES) -> dict:
    """The recurrence alone on random data: errors against float64, then torch and every launch timed."""
    h, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    mask, _ = random_trees(batch, nodes, gen)
    paths = Paths(mask[:, None].to(device), torch.zeros(0, device=device))
    q = F.normalize(torch.randn(batch, h, nodes, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(batch, h, nodes, dk, generator=gen), dim=-1)
    v = torch.randn(batch, h, nodes, dv, generator=gen)
    g = -torch.rand(batch, nodes, h, generator=gen).transpose(1, 2) * 0.5   # strided, as the layer passes them
    beta = torch.rand(batch, nodes, h, generator=gen).transpose(1, 2)
    state = torch.randn(batch, h, dk, dv, generator=gen) * 0.1
    exact = Paths(mask[:, None], torch.zeros(0))
    exact.summing = exact.summing.double()
    want, want_step = gated_delta_torch(*(x.double() for x in (q, k, v, g, beta, state)), exact)
    q, k, v, g, beta, state = (x.to(device) for x in (q, k, v, g, beta, state))
    torch32 = gated_delta_torch(q, k, v, g, beta, state, paths)[0]
    sets = input_copies((q, k, v, g, beta, state), device)
    case = {"torch_f32_error": relative_error(torch32, want), "input_sets": len(sets), "torch_us": measure_rotating(
        lambda *x: gated_delta_torch(*x, paths), sets, device), "launches": {}}
    served = gdn_kernels.tree_delta_launch(batch)
    for launch in [served] + launches:
        name = launch_name(launch)
        if name in case["launches"]:
            continue
        try:
            out, u, _ = tree_delta(q, k, v, g, beta, state, paths.mask, launch)
            err = relative_error(out, want)
            us = measure_rotating(lambda *x, launch=launch: tree_delta(*x, paths.mask, launch), sets, device)
            case["launches"][name] = {"error": err, "u_error": relative_error(u, want_step.u),
                                      "nan": bool(out.isnan().any()), "us": us}
        except Exception as exc:  # a launch this device's Triton cannot build (registers, shared memory)
            case["launches"][name] = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
        if device.type != "cuda":
            break  # the interpreter: the default launch only
    default = case["launches"][launch_name(served)]
    case["default"] = launch_name(served)
    case["ok"] = qualifies(default)
    timed = {n: r for n, r in case["launches"].items() if qualifies(r)}
    case["best"] = min(timed, key=lambda n: timed[n]["us"]) if timed else None
    return case


def layer_case(cfg: Qwen35Config, batch: int, nodes: int, device: torch.device, dtype: torch.dtype,
               gen: torch.Generator) -> dict:
    """One GatedDeltaNet layer's tree pass, piece by piece as GatedDeltaNet.forward runs it, and whole."""
    torch.manual_seed(0)
    with torch.device(device):
        layer = GatedDeltaNet(cfg, 0).to(dtype).eval()
        with torch.no_grad():
            layer.A_log.uniform_(-1, 1)
    layer.fuse()
    cache = target_cache(cfg, 64, device, dtype, batch=batch, nodes=nodes)
    cache.conv.normal_()        # (on the device: the state is 2.4 GB at 16 rows)
    cache.state.normal_(0.0, 0.1)
    mask, depth = random_trees(batch, nodes, gen)
    mask, depth = mask.to(device), depth.to(device)
    paths = tree_paths(mask, depth + 10, cfg.linear_conv_kernel_dim)
    tree = TreeInputs(depth + 10, None, 64, mask, paths)
    x = torch.randn(batch, nodes, cfg.hidden_size, generator=gen).to(device, dtype)
    nv, dk, dv = layer.n_v, layer.dk, layer.dv

    def split(projected: torch.Tensor) -> tuple[torch.Tensor, ...]:  # as GatedDeltaNet.forward does
        mixed, z, beta, a = projected.split([layer.conv_dim, nv * dv, nv, nv], dim=-1)
        return mixed, z, torch.sigmoid(beta).float(), -layer.A_log.float().exp() * F.softplus(
            a.float() + layer.dt_bias.float())

    with torch.no_grad():
        projected = linear(x, layer._in_proj)
        mixed, z, beta, g = split(projected)
        weight = layer.conv1d.weight[:, 0]
        q, k, v = conv_heads(mixed, cache.conv[0], weight, paths.window, layer.n_k, nv, dk, dv)
        beta_t, g_t = beta.transpose(1, 2), g.transpose(1, 2)
        core, step = gated_delta_torch(q, k, v, g_t, beta_t, cache.state[0], paths)
        normed = gated_norm(core, z, layer.norm.weight, layer.norm.eps, dtype)
        projected_out = F.linear(normed, layer.out_proj.weight)
        b_in, a = projected.split([layer.conv_dim, nv * dv, nv, nv], dim=-1)[2:]
        gates = Gates(b_in, a, layer.A_log, layer.dt_bias)
        keep, scratch = cache.scratch(0, nodes)
        pieces = {
            "in_proj_gemm": lambda: linear(x, layer._in_proj),
            "split_beta_g": lambda: split(projected),
            "conv_heads": lambda: conv_heads(mixed, cache.conv[0], weight, paths.window, layer.n_k, nv, dk, dv),
            "conv_heads_as_layer": lambda: conv_heads(mixed, cache.conv[0], weight, paths.window, layer.n_k, nv,
                                                      dk, dv, k=scratch.k, keep=keep),
            "recurrence_torch": lambda: gated_delta_torch(q, k, v, g_t, beta_t, cache.state[0], paths),
            "recurrence_kernel": lambda: tree_delta(q, k, v, g_t, beta_t, cache.state[0], paths.mask),
            "recurrence_kernel_as_layer": lambda: tree_delta(q, k, v, None, None, cache.state[0], paths.mask,
                                                             gates=gates, u=scratch.u, pathsum=scratch.g),
            "save_step": lambda: cache.save_step(0, mixed, step, nodes),
            "gated_norm": lambda: gated_norm(core, z, layer.norm.weight, layer.norm.eps, dtype),
            "out_proj_gemm": lambda: F.linear(normed, layer.out_proj.weight),
            "residual_add": lambda: x + projected_out,   # what the out-projection's GEMM now adds in place
        }
        timings = {name: measure(fn, device) for name, fn in pieces.items()}
        kernel_out = layer(x, cache, 0, tree)
        timings["layer-kernel"] = measure(lambda: layer(x, cache, 0, tree), device)
        convs = conv_launches((mixed, cache.conv[0], weight, paths.window, layer.n_k, nv, dk, dv), scratch.k, keep,
                              device)
        for module in (gated_delta_module, qwen3_5):   # the layer as before the kernel
            module.tree_delta_fits = lambda *args: False
        try:
            torch_out = layer(x, cache, 0, tree)
            timings["layer-torch"] = measure(lambda: layer(x, cache, 0, tree), device)
        finally:
            for module in (gated_delta_module, qwen3_5):
                module.tree_delta_fits = gdn_kernels.tree_delta_fits
    diff = relative_error(kernel_out.float(), torch_out.double())
    return {"us": timings, "conv_launches": convs, "layer_output_error": diff,
            "ok": not kernel_out.isnan().any().item() and diff < 5e-2}


def floors(cfg: Qwen35Config, batch: int, nodes: int, bandwidth: float) -> dict:
    """Bytes the recurrence must move a layer (the state once, q/k/v in, out/u out, float32) and its
    useful FLOPs (unpadded T)."""
    h, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    state = batch * h * dk * dv * 4
    io = batch * h * nodes * (2 * dk + 3 * dv + 3) * 4
    flops = 2 * batch * h * (2 * nodes * dk * dv + 2 * nodes * nodes * dk + 1.5 * nodes * nodes * dv)
    return {"state_bytes": state, "io_bytes": io, "flops": flops, "floor_us": (state + io) / bandwidth * 1e6,
            "state_floor_us": state / bandwidth * 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="rows (default 1 8 16; --tiny: 3)")
    ap.add_argument("--nodes", type=int, default=17, help="tree nodes a row (root + budget)")
    ap.add_argument("--tiny", action="store_true", help="small dims on the CPU through Triton's interpreter")
    ap.add_argument("--launches", nargs="+", default=None, metavar="NAME",
                    help="time only these of the grid's launches (names as printed, e.g. k32-v64-w4-tf32-squaring)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/gdn_tree_bench[-tiny].json)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:  # conv_heads / gated_norm take their kernels (interpreted) as on CUDA
        from ddtree_devtools.interpreter import allow_loop_bounds
        allow_loop_bounds()
        gdn_kernels._use_triton = lambda x: True
    elif not torch.cuda.is_available():
        print("gdn_tree_bench: no CUDA device; run with --tiny on the CPU", file=sys.stderr)
        return 2
    names = {launch_name(launch): launch for launch in LAUNCHES}
    unknown = sorted(set(args.launches or ()) - set(names))
    if unknown:
        print(f"gdn_tree_bench: no launch {', '.join(unknown)} in the grid; it has {', '.join(names)}",
              file=sys.stderr)
        return 2
    chosen = [names[n] for n in args.launches] if args.launches else LAUNCHES
    cfg = target_config_of("hybrid-small" if args.tiny else "qwen3.6-27b")
    layers = len(cfg.linear_layers)
    batches = args.batch or ([3] if args.tiny else [1, 8, 16])
    ceilings = measure_ceilings(device)
    bandwidth = ceilings["copy_bytes_per_s"]
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
              "shape": "hybrid-small" if args.tiny else "qwen3.6-27b", "nodes": args.nodes,
              "linear_layers": layers, "unit": "us per call (CUDA graph of 20)", "ceilings": ceilings,
              "max_error": MAX_ERROR, "max_output_error": MAX_OUTPUT_ERROR, "cases": []}
    gen = torch.Generator().manual_seed(0)
    ok = True
    for batch in batches:
        rec = recurrence_case(cfg, batch, args.nodes, device, gen, chosen)
        try:
            lay = layer_case(cfg, batch, args.nodes, device, torch.float32 if args.tiny else torch.bfloat16, gen)
        except Exception:  # reported, and the other cases still run
            lay = {"failed": traceback.format_exc(limit=6), "ok": False}
        floor = floors(cfg, batch, args.nodes, bandwidth)
        report["cases"].append({"batch": batch, "recurrence": rec, "layer": lay, "floor": floor})
        ok &= rec["ok"] and lay["ok"]
        default = rec["launches"][rec["default"]]
        print(f"B {batch:2} T {args.nodes}: recurrence torch {rec['torch_us']:8.1f} us (x{layers} "
              f"{rec['torch_us'] * layers / 1e3:6.2f} ms, f32 err {rec['torch_f32_error']:.1e})  kernel "
              + (f"{default['us']:8.1f} us (x{layers} {default['us'] * layers / 1e3:6.2f} ms, err "
                 f"{default['error']:.1e})" if "us" in default else f"FAILED {default['failed']}")
              + f"  floor {floor['floor_us']:6.1f} us (state alone {floor['state_floor_us']:.1f})"
              + ("" if rec["ok"] else "  FAIL"), flush=True)
        if rec["best"]:
            best = rec["launches"][rec["best"]]
            print(f"      best launch {rec['best']}: {best['us']:.1f} us, err {best['error']:.1e} "
                  f"(u {best['u_error']:.1e}), "
                  f"{floor['flops'] / best['us'] / 1e6:.1f} TFLOP/s useful")
        for name, r in rec["launches"].items():
            print(f"      {name:32} " + (f"{r['us']:8.1f} us  err {r['error']:.1e}  u {r['u_error']:.1e}"
                                          + ("  NaN" if r["nan"] else "")
                                          if "us" in r else f"failed: {r['failed'][:120]}"))
        if "failed" in lay:
            print(f"      layer: FAILED\n{lay['failed']}", flush=True)
            continue
        us = lay["us"]
        print("      layer pieces: " + "  ".join(f"{n} {t:.1f}" for n, t in us.items()))
        print("      conv_heads as the layer calls it, us (bits against the first, the grid before ConvHeadsLaunch): "
              + "  ".join(f"{n} {r['us']:.1f} " + ("same" if r["same_bits"] else f"DIFFER {r['max_diff']:.1e}")
                          for n, r in lay["conv_launches"].items()))
        print(f"      layer: torch recurrence {us['layer-torch']:.1f} us -> kernel {us['layer-kernel']:.1f} us "
              f"(x{layers}: {us['layer-torch'] * layers / 1e3:.2f} -> {us['layer-kernel'] * layers / 1e3:.2f} ms a "
              f"step; outputs differ by {lay['layer_output_error']:.1e})" + ("" if lay["ok"] else "  FAIL"), flush=True)
    out = Path(args.out or f"bench/results/gdn_tree_bench{'-tiny' if args.tiny else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"{'all checks passed' if ok else 'CHECK FAILED'}; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Time the commit's recurrent-state advance on the GPU at the Qwen3.6-27B shape (48 Gated DeltaNet layers,
48 value heads of dk = dv = 128: a float32 state of ~151 MB a request), each variant captured in one CUDA
graph as the engine runs it (attn_probe.timed):

    torch        gated_delta.advance_along_torch: the decay over the whole state, then a layer at a time
                 the rank-P update (baddbmm_): two passes over the state, plus the gathers
    kernel       gdn_kernels.advance_state at its default launch (what advance_along runs on CUDA): one
                 read and one write of the state
    bK-vV-wW     the kernel at other launches (tiles of K x V of a head's [dk, dv], W warps)
    state_at     B = 1 only: the single-stream commit before the kernel (state_at, then state.copy_)

for B requests (B = 1: the single-stream commit) and paths of P nodes (P = 1: an AR step), each row its own
tree path through a scratch of T nodes. Before timing, checks the kernel against the torch form (the
largest difference over the largest value, float32 rounding only). `gbps` is the kernel's state bytes
read + written over its time (the H200 copies ~4 TB/s).

    PYTHONPATH=runtime python runtime/bench/state_bench.py [--batch 1 16] [--path 1 16] [--nodes 32] [--out F]"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attn_probe import timed  # noqa: E402
from gpu_bench import SHAPES  # noqa: E402

from ddtree_runtime.model.gated_delta import Step, advance_along_torch, state_at  # noqa: E402
from ddtree_runtime.model.gdn_kernels import AdvanceLaunch, advance_state  # noqa: E402

LAUNCHES = (AdvanceLaunch(16, 128, 4), AdvanceLaunch(64, 128, 4), AdvanceLaunch(64, 128, 8),
            AdvanceLaunch(32, 64, 4), AdvanceLaunch(128, 64, 8), AdvanceLaunch(128, 128, 8))


def target_shape() -> tuple[int, int, int, int]:
    """(linear layers, value heads, dk, dv) of Qwen3.6-27B."""
    s = SHAPES["qwen3.6-27b"]
    return (s["layer_types"].count("linear_attention"), s["linear_num_value_heads"], s["linear_key_head_dim"],
            s["linear_value_head_dim"])


def commit_inputs(batch: int, path: int, nodes: int) -> tuple[Step, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A scratch as a tree pass leaves it, a state, and each row's path: the root, then path - 1 nodes in
    tree order (ascending), each row its own."""
    n, h, dk, dv = target_shape()
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(n, batch, h, nodes, dk, device="cuda", generator=gen) * dk ** -0.5
    u = torch.randn(n, batch, h, nodes, dv, device="cuda", generator=gen)
    g = -(torch.rand(n, batch, h, nodes, device="cuda", generator=gen) * 0.05).cumsum(-1)
    state = torch.randn(n, batch, h, dk, dv, device="cuda", generator=gen)
    rest = torch.rand(batch, nodes - 1, device="cuda", generator=gen).argsort(-1)[:, :path - 1] + 1
    paths = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device="cuda"), rest.sort(-1).values], dim=1)
    length = torch.full((batch,), path, device="cuda")
    return Step(k, u, g), state, paths, length


def variants(step: Step, state: torch.Tensor, paths: torch.Tensor,
             length: torch.Tensor) -> dict[str, Callable[[], None]]:
    out = {"torch": lambda: advance_along_torch(step, state, paths, length),
           "kernel": lambda: advance_state(step.k, step.u, step.g, state, paths, length)}
    for launch in LAUNCHES:
        out[f"b{launch.block_k}-v{launch.block_v}-w{launch.warps}"] = (
            lambda launch=launch: advance_state(step.k, step.u, step.g, state, paths, length, launch))
    if state.shape[1] == 1:
        out["state_at"] = lambda: state.copy_(state_at(step, state, paths[0]))
    return out


def kernel_error(step: Step, state: torch.Tensor, paths: torch.Tensor, length: torch.Tensor) -> float:
    expected, got = state.clone(), state.clone()
    advance_along_torch(step, expected, paths, length)
    advance_state(step.k, step.u, step.g, got, paths, length)
    return ((got - expected).abs().max() / expected.abs().max()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--path", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--nodes", type=int, default=32, help="the scratch's tree nodes (T)")
    ap.add_argument("--out", default="bench/results/runtime-state-bench.json")
    args = ap.parse_args()
    n, h, dk, dv = target_shape()
    rows = []
    for batch in args.batch:
        for path in args.path:
            step, state, paths, length = commit_inputs(batch, path, max(args.nodes, path))
            err = kernel_error(step, state, paths, length)
            assert err < 1e-5, f"kernel differs from torch: {err}"
            times = {name: round(timed(fn), 1) for name, fn in variants(step, state, paths, length).items()}
            state_bytes = state.numel() * state.element_size()
            row = {"batch": batch, "path": path, "state_mb": round(state_bytes / 1e6, 1), "max_rel_err": err,
                   "us": times, "kernel_gbps": round(2 * state_bytes / times["kernel"] / 1e3, 1)}
            rows.append(row)
            print(f"B={batch:3d} P={path:3d} state {row['state_mb']:8.1f} MB  err {err:.1e}  "
                  + "  ".join(f"{name} {us:.1f}" for name, us in times.items())
                  + f"  (us; kernel {row['kernel_gbps']} GB/s)", flush=True)
            del step, state
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "shape": {"linear_layers": n, "value_heads": h, "dk": dk, "dv": dv},
                               "nodes": args.nodes, "default_launch": AdvanceLaunch()._asdict(), "rows": rows},
                              indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()

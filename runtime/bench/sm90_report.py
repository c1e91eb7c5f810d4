"""What the runtime's Triton launches compile to on an H200, found without one: each launch is compiled
for sm90 exactly as the layer makes it (the runtime's own call, its strides and constexprs, on CPU
tensors of the real shapes; an offline Triton driver turns the launch into a compile), and its cubin
read for registers, spills (local memory) and shared memory, its TTGIR for the tensor-core instruction
(wgmma, Hopper's, or the older mma), with the occupancy those allow on the H200's 132 SMs.

    PYTHONPATH=runtime:runtime/bench python runtime/bench/sm90_report.py [--rows 1 8 16] [--cases fp8_gemm]
        [--out F.json]

Cases: `tree_delta` at every launch of gdn_tree_bench.py's grid (27B: 48 value heads of 128, 17 nodes),
the split-KV tree attention (27B: 24 / 4 heads of 256, 17 queries over the paged pool) at its served
launch, and `fp8_gemm`: the FP8 GEMM on the 27B's o_proj, down_proj and gate_up at 1, 16 and 272 rows,
the runtime's row-major tile beside every weight-major tile of fp8_gemm_bench.py's sweep there and its
large wgmma tiles. Static
facts, not timings: a launch that spills, or holds so many registers that few programs share an SM, is a
candidate to change before a GPU call times it (docs/performance.md, sessions 22 and 23)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

# the H200 (sm90): per SM, and the shared memory one program may take
SMS, REGS_PER_SM, SHARED_PER_SM, WARPS_PER_SM, CTAS_PER_SM = 132, 65536, 228 * 1024, 64, 32
SHARED_PER_PROGRAM = 227 * 1024


class OfflineDriver:
    """Triton's active driver for a GPU this machine lacks: enough for a launch to compile, none to run."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def compiled_launches(call: Callable[[], object]) -> list[tuple[str, object, tuple]]:
    """Run `call` (which launches Triton kernels) with every launch compiled for sm90 and not run:
    [(kernel name, compiled kernel, grid)]."""
    from ddtree_runtime.model import fp8, gdn_kernels, kernels

    captured: list[tuple[str, object, tuple]] = []
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        compiled = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        captured.append((self.fn.__name__, compiled, tuple(grid)))
        return compiled

    saved = (JITFunction.run, kernels._use_triton, gdn_kernels._use_triton, fp8._device_limits, driver._active)
    driver.set_active(OfflineDriver(GPUTarget("cuda", 90, 32)))
    JITFunction.run = compile_only
    kernels._use_triton = gdn_kernels._use_triton = lambda x: True   # CPU tensors stand for the GPU's
    fp8._device_limits = lambda device: (SMS, SHARED_PER_PROGRAM)
    try:
        call()
    finally:
        JITFunction.run, kernels._use_triton, gdn_kernels._use_triton, fp8._device_limits, driver._active = saved
    return captured


def cuobjdump(compiled, option: str) -> str:
    """What Triton's bundled cuobjdump prints for the compiled kernel's cubin with `option`."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([str(tool), option, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def loop_opcodes(compiled) -> Counter:
    """The SASS opcodes inside the kernel's loops (each backward branch's span), predicates dropped: two
    kernels' key loops compared instruction by instruction, without a GPU."""
    code = [(int(at, 16), text) for at, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);",
                                                          cuobjdump(compiled, "-sass"))]
    index = {at: i for i, (at, _) in enumerate(code)}
    found: Counter = Counter()
    for i, (at, text) in enumerate(code):
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < at:
            for _, op in code[index[int(target.group(1), 16)]:i + 1]:
                found[op.split()[1] if op.startswith("@") else op.split()[0]] += 1
    return found


def resources(compiled) -> dict:
    """Registers, spills (the stack frame and local memory) and shared memory from the cubin
    (cuobjdump), the mma kind from the TTGIR, and how many programs of it an SM holds."""
    text = cuobjdump(compiled, "--dump-resource-usage")
    usage = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    ttgir = compiled.asm["ttgir"]
    versions = sorted(set(re.findall(r"versionMajor = (\d)", ttgir)))
    warps = compiled.metadata.num_warps
    regs = int(usage.get("REG", 0))
    shared = compiled.metadata.shared + int(usage.get("SHARED", 0))
    by_regs = REGS_PER_SM // max(1, regs * 32 * warps)
    by_shared = SHARED_PER_SM // shared if shared else CTAS_PER_SM
    per_sm = max(0, min(by_regs, by_shared, WARPS_PER_SM // warps, CTAS_PER_SM))
    # what does not fit the registers goes to the stack frame (local memory, through the L1)
    return {"warps": warps, "regs": regs, "spill_bytes": int(usage.get("STACK", 0)) + int(usage.get("LOCAL", 0)),
            "shared_bytes": shared,
            "mma": "wgmma" if "3" in versions else ("mma" if versions else "none"),
            "programs_per_sm": per_sm, "limited_by": min((("registers", by_regs), ("shared memory", by_shared),
                                                           ("warps", WARPS_PER_SM // warps)), key=lambda x: x[1])[0]}


def tree_delta_cases(rows: list[int]) -> list[dict]:
    """tree_delta as the 27B's linear layers call it (gates from the in-projection, a start state), at
    each launch of gdn_tree_bench's grid."""
    from gdn_tree_bench import LAUNCHES, launch_name

    from ddtree_runtime.model.gdn_kernels import Gates, tree_delta, tree_delta_launch

    heads, nodes, dk, dv = 48, 17, 128, 128
    out = []
    for b in rows:
        q, k = torch.randn(b, heads, nodes, dk), torch.randn(b, heads, nodes, dk)
        v, state = torch.randn(b, heads, nodes, dv), torch.randn(b, heads, dk, dv)
        mask = torch.ones(nodes, nodes, dtype=torch.bool).tril()
        raw = torch.randn(2, b, nodes, heads, dtype=torch.bfloat16)   # the in-projection's b and a columns
        gates = Gates(raw[0], raw[1], torch.randn(heads), torch.randn(heads))
        served = tree_delta_launch(b)
        for launch in LAUNCHES:
            (name, compiled, grid), = compiled_launches(
                lambda: tree_delta(q, k, v, None, None, state, mask, launch=launch, gates=gates))
            out.append({"kernel": name, "launch": launch_name(launch), "rows": b, "served": launch == served,
                        "programs": grid[0] * grid[1], **resources(compiled)})
    return out


def attention_cases(rows: list[int], keys: int = 8704) -> list[dict]:
    """The 27B's tree attention over the paged pool as its layers call it: a batch with per-row lengths
    over a shared context, one row without (kernels.py: its lengths stay off until a GPU call says); and
    a batch's launches with the split fitted to its rows (served; DDTREE_FIT_SPLIT=0: the bucket's), on the
    H200's wave."""
    from ddtree_runtime.model import kernels
    from ddtree_runtime.model.kernels import decode_attention

    hq, hkv, d, nodes, page = 24, 4, 256, 17, 16
    out = []
    served, programs = kernels.DECODE_FIT_SPLIT, kernels.fit_programs
    kernels.fit_programs = lambda device: SMS   # the fitted split's grid as on the H200 (CPU tensors here)
    try:
        for b in rows:
            pages = b * keys // page
            k = torch.randn(1, hkv, pages * page, d, dtype=torch.bfloat16)
            q = torch.randn(b, hq, nodes, d, dtype=torch.bfloat16)
            table = torch.arange(pages, dtype=torch.int32).view(b, keys // page)
            bias = torch.zeros(b, 1, nodes, keys, dtype=torch.bfloat16)
            lengths = torch.full((b,), keys, dtype=torch.long) if b > 1 else None
            for fitted in (False, True) if b > 1 else (False,):
                kernels.DECODE_FIT_SPLIT = fitted
                launches = compiled_launches(lambda: decode_attention(q, k, k, bias, lengths, table=table,
                                                                      page_size=page, length=keys, shared=b > 1))
                for name, compiled, grid in launches:
                    out.append({"kernel": name, "launch": f"{keys} keys" + (", fitted" if fitted else ""), "rows": b,
                                "served": fitted == served, "programs": math.prod(grid), **resources(compiled)})
    finally:
        kernels.DECODE_FIT_SPLIT, kernels.fit_programs = served, programs
    return out


def fp8_gemm_cases(rows: tuple[int, ...] = (1, 16, 272)) -> list[dict]:
    """_block_gemm_kernel as fp8.block_gemm launches it for the 27B's o_proj and down_proj (the shapes
    where the Triton kernel lost to bf16 at decode sizes): the runtime's row-major tile (gemm_tile, the
    16/32-row family; "served": the Triton path's, which the H200 leaves to scaled_mm/32 on these shapes)
    and HOPPER_TILES' (`served_triton`: what --fp8-gemm triton runs, by tensor descriptors), and each
    weight-major tile of fp8_gemm_bench.py's sweep at that many rows, with those it leaves out
    for spilling, and from 64 rows its large wgmma tiles (--large); gate_up beside them, a shape whose K
    is summed in one group (one accumulator a program)."""
    from fp8_gemm_bench import candidate, weight_major_tiles, wgmma_tiles

    from ddtree_runtime.model import fp8

    out = []
    for name, n, k in (("o_proj", 5120, 6144), ("down_proj", 5120, 17408), ("gate_up", 34816, 5120)):
        w = fp8.BlockFP8(torch.empty(n, k, dtype=fp8.FP8),
                         torch.ones(fp8.cdiv(n, fp8.BLOCK), fp8.cdiv(k, fp8.BLOCK)), fp8.BLOCK)
        for m in rows:
            x = torch.empty(m, k, dtype=torch.bfloat16)
            served = fp8.gemm_tile(m, n, k, SMS, SHARED_PER_PROGRAM)
            hopper = fp8.hopper_tile(m, n, k)   # what --fp8-gemm triton serves
            # (a padded launch compiles as its plain one: only the rows of x it is given differ)
            large = [t for t in wgmma_tiles(m) if not t.padded]
            for tile in [served, hopper] + weight_major_tiles(m, spilling=True) + large:
                (compiled, grid), = [(c, g) for kernel, c, g in compiled_launches(lambda: fp8.block_gemm(x, w, tile))
                                     if kernel == "_block_gemm_kernel"]
                out.append({"kernel": "_block_gemm_kernel", "launch": f"{name} {candidate(tile)}", "rows": m,
                            "served": tile == served, "served_triton": tile == hopper, "split_k": grid[1],
                            "programs": grid[0] * grid[1],
                            **resources(compiled)})
    return out


CASES = {"tree_delta": tree_delta_cases, "attention": attention_cases, "fp8_gemm": lambda rows: fp8_gemm_cases()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16],
                    help="batch rows of tree_delta and attention (fp8_gemm: 1, 16 and 272 tokens)")
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    ap.add_argument("--out", default="bench/results/runtime-sm90-report.json")
    args = ap.parse_args()
    cases = [c for name in args.cases for c in CASES[name](args.rows)]
    print(f"{'kernel':<28} {'launch':<34} {'rows':>4} {'progs':>6} {'warps':>5} {'regs':>4} {'spill':>5} "
          f"{'smem KB':>7} {'mma':>5} {'per SM':>6}  limited by")
    for c in cases:
        print(f"{c['kernel']:<28} {c['launch'] + (' *' if c['served'] else ''):<34} {c['rows']:>4} {c['programs']:>6} "
              f"{c['warps']:>5} {c['regs']:>4} {c['spill_bytes']:>5} {c['shared_bytes'] / 1024:>7.1f} {c['mma']:>5} "
              f"{c['programs_per_sm']:>6}  {c['limited_by']}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"target": "sm90 (H200), compiled offline", "triton": triton.__version__,
                               "cases": cases}, indent=1) + "\n")
    print(f"wrote {out}  (* the launch the layers serve at that many rows)")


if __name__ == "__main__":
    main()

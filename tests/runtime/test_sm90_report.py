"""sm90_report.py compiles the runtime's own launches for the H200 on a machine without a GPU and reads
what they hold: the launch the layer makes (its grid, its constexprs), not a description of it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime" / "bench"))

import sm90_report  # noqa: E402
from ddtree_runtime.model import fp8, gdn_kernels, kernels  # noqa: E402
from ddtree_runtime.model.kernels import decode_attention  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_served_tree_delta_launch_compiles_offline_with_its_grid():
    rows, heads, nodes, dk, dv = 16, 4, 17, 128, 128
    q, k = torch.randn(rows, heads, nodes, dk), torch.randn(rows, heads, nodes, dk)
    v, state = torch.randn(rows, heads, nodes, dv), torch.randn(rows, heads, dk, dv)
    mask = torch.ones(nodes, nodes, dtype=torch.bool).tril()
    launch = gdn_kernels.tree_delta_launch(rows)
    (name, compiled, grid), = sm90_report.compiled_launches(
        lambda: gdn_kernels.tree_delta(q, k, v, torch.randn(rows, heads, nodes), torch.rand(rows, heads, nodes),
                                       state, mask, launch=launch))
    assert name == "_tree_delta_kernel" and grid == (rows * heads, dv // launch.block_v)
    report = sm90_report.resources(compiled)
    assert report["warps"] == launch.warps and 0 < report["regs"] <= 255
    assert report["mma"] == "mma"   # 16-node blocks: tiles below wgmma's 64 rows a warp group
    assert report["programs_per_sm"] >= 1 and report["shared_bytes"] > 0
    assert gdn_kernels._use_triton(torch.zeros(1)) is False   # the CPU's tensors are the CPU's again


def test_the_tree_attention_compiles_to_wgmma():
    keys, page = 1024, 16
    k = torch.randn(1, 4, keys, 256, dtype=torch.bfloat16)
    q = torch.randn(1, 24, 17, 256, dtype=torch.bfloat16)
    table = torch.arange(keys // page, dtype=torch.int32).view(1, -1)
    bias = torch.zeros(1, 1, 17, keys, dtype=torch.bfloat16)
    launches = sm90_report.compiled_launches(lambda: decode_attention(
        q, k, k, bias, torch.full((1,), keys), table=table, page_size=page, length=keys, shared=True))
    part = next(c for n, c, _ in launches if n == "_decode_attn_part_kernel")
    assert sm90_report.resources(part)["mma"] == "wgmma"


def test_the_fitted_splits_work_item_costs_no_more_than_the_buckets_tile(monkeypatch):
    """The fitted split's item kernel (served) on the 27B's tree at 16 rows: wgmma, no more local memory
    than the bucket's kernel it replaces (made inside every program, the plan cost 1,152 bytes a thread
    against 960, and the equal rows' time on an H100: session 34), and no signed division in its key
    loops (a start read from the plan left the page index's sign unknown: 24 more shifts, 9% more
    instructions a block of keys, session 35)."""
    monkeypatch.setattr(kernels, "fit_programs", lambda device: sm90_report.SMS)
    rows, keys, page = 16, 1024, 16
    k = torch.randn(1, 4, rows * keys, 256, dtype=torch.bfloat16)
    q = torch.randn(rows, 24, 17, 256, dtype=torch.bfloat16)
    table = torch.arange(rows * keys // page, dtype=torch.int32).view(rows, -1)
    bias = torch.zeros(rows, 1, 17, keys, dtype=torch.bfloat16)
    found = {}
    for fitted in (False, True):
        monkeypatch.setattr(kernels, "DECODE_FIT_SPLIT", fitted)
        for name, compiled, _ in sm90_report.compiled_launches(lambda: decode_attention(
                q, k, k, bias, torch.full((rows,), keys), table=table, page_size=page, length=keys, shared=True)):
            found[name] = {**sm90_report.resources(compiled), "loops": sm90_report.loop_opcodes(compiled)}
    tile, item = found["_decode_attn_part_kernel"], found["_decode_attn_fit_kernel"]
    assert item["mma"] == tile["mma"] == "wgmma"
    assert item["spill_bytes"] <= tile["spill_bytes"]
    mma = [sum(n for op, n in kernel["loops"].items() if op.startswith("HGMMA")) for kernel in (item, tile)]
    assert mma[0] == mma[1] > 0
    assert item["loops"]["SHF.R.S32.HI"] == tile["loops"]["SHF.R.S32.HI"] == 0
    assert {"_fit_plan_kernel", "_decode_attn_fit_reduce_kernel"} <= found.keys()


def test_the_weight_major_fp8_gemm_compiles_to_wgmma_at_one_row():
    """With the W tile on the MMA's M side, one token still fills wgmma's 64 rows; the row-major tile of
    16 rows compiles to mma.sync."""
    x = torch.randn(1, 512, dtype=torch.bfloat16)
    w = fp8.BlockFP8(*fp8.quantize_blocks(torch.randn(256, 512)), fp8.BLOCK)
    kinds = {}
    for tile in (fp8.GemmTile(16, 64, 4, 3, True), fp8.GemmTile(16, 64, 4, 4)):
        (compiled,) = [c for name, c, _ in sm90_report.compiled_launches(lambda: fp8.block_gemm(x, w, tile))
                       if name == "_block_gemm_kernel"]
        report = sm90_report.resources(compiled)
        assert report["spill_bytes"] == 0
        kinds[tile.weights_left] = report["mma"]
    assert kinds == {True: "wgmma", False: "mma"}

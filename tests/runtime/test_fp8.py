"""FP8 weights (model/fp8.py, issue 25): the block scheme, fine-grained FP8 checkpoints in the layout the
other engines detect (written from the tiny fixtures by ddtree_devtools.fp8_checkpoint), `--quantize
fp8`, the fused projections, what is refused, and speculative decoding lossless against the FP8 target
on both tiny pairs, alone and batched. The Triton GEMM itself: tests/runtime/test_triton_kernels.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree_devtools.fp8_checkpoint import write_fp8_checkpoint
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.model import load_drafter, load_target
from ddtree_runtime.model import fp8 as F
from ddtree_runtime.model.fp8 import FP8, FP8Linear, expand_scales, fp8_linear_torch, quantize_blocks
from ddtree_runtime.model.layers import fuse_projections
from ddtree_runtime.quantization import UnsupportedCheckpoint, check_checkpoint
from ddtree_runtime.server.cli import build_parser, config_from_args
from ddtree_runtime.server.cli import main as serve_main
from ddtree_devtools.tiny_corpus import heldout_questions

MAX_NEW = 24


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def pair(request):
    return request.getfixturevalue("tiny_models" if request.param == "qwen3" else "tiny_hybrid_models")


@pytest.fixture(scope="module")
def fp8_target(pair, tmp_path_factory):
    return write_fp8_checkpoint(pair / "target", tmp_path_factory.mktemp("fp8") / "target")


def test_blocks_round_trip_within_half_a_step_of_their_scale():
    w = torch.randn(300, 200) * torch.logspace(-4, 1, 200)   # columns of very different sizes
    q, scale = quantize_blocks(w)
    assert q.dtype == FP8 and q.shape == w.shape and scale.shape == (3, 2)
    per_element = expand_scales(scale, 128, 300, 200)
    err = (q.float() * per_element - w).abs()
    # e4m3 keeps 3 mantissa bits: 1/16 of a value at most; below 2**-6 of the scale, half of 2**-9
    assert (err <= torch.maximum(w.abs() / 16, per_element * 2 ** -10) * (1 + 1e-6)).all()
    assert torch.allclose(scale * 448, w.abs().reshape(3 * 100, 200).new_tensor(
        [[w[i:i + 128, j:j + 128].abs().max() for j in (0, 128)] for i in (0, 128, 256)]))


def test_an_fp8_checkpoint_loads_its_scales_and_keeps_head_and_embeddings(pair, fp8_target):
    state = load_file(str(fp8_target / "model.safetensors"))
    config = json.loads((fp8_target / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]
    assert state["model.layers.0.mlp.down_proj.weight"].dtype == FP8
    assert state["model.layers.0.mlp.down_proj.weight_scale_inv"].dtype == torch.float32
    assert state["model.embed_tokens.weight"].dtype == torch.float32
    fp8, full = load_target(fp8_target), load_target(pair / "target")
    same = load_target(pair / "target", quantize="fp8")
    linears = [m for m in fp8.model.layers.modules() if isinstance(m, FP8Linear)]
    assert linears and not [m for m in fp8.model.layers.modules() if type(m) is torch.nn.Linear]
    assert type(fp8.lm_head) is torch.nn.Linear and fp8.model.embed_tokens.weight.dtype == torch.float32
    ids = torch.tensor([[5, 17, 99, 300, 42, 7, 64, 1000]])
    pos = torch.arange(ids.shape[1])[None]
    logits = fp8.logits(fp8(ids, pos)[0])
    # the checkpoint and quantizing at load are one scheme: the same numbers
    assert torch.equal(logits, same.logits(same(ids, pos)[0]))
    # the scales are applied: close to the float model (codes read as weights would be noise)
    ref = full.logits(full(ids, pos)[0])
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
    assert (logits - ref).abs().max() < 0.25 * ref.abs().max()
    # the fused projections (one GEMM for q/k/v, gate/up, a hybrid's in-projections) change nothing
    # but the float rounding of a larger GEMM (as in the float model: ~5e-6 on the hybrid)
    fuse_projections(fp8)
    torch.testing.assert_close(fp8.logits(fp8(ids, pos)[0]), logits, atol=1e-4, rtol=0)


def test_the_residual_and_mixed_fusions_agree_with_the_plain_projections(tiny_hybrid_models, tmp_path):
    # an FP8 checkpoint that left the hybrid's gate inputs (in_proj_a, in_proj_b) in float: their fused
    # in-projection is then FP8 and float parts side by side
    d = write_fp8_checkpoint(tiny_hybrid_models / "target", tmp_path / "t", skip=("lm_head", "in_proj_a", "in_proj_b"))
    model = load_target(d)
    gdn = model.model.layers[0].linear_attn
    assert isinstance(gdn.in_proj_qkv, FP8Linear) and type(gdn.in_proj_a) is torch.nn.Linear
    ids = torch.tensor([[3, 9, 27, 81, 243]])
    pos = torch.arange(5)[None]
    before = model.logits(model(ids, pos)[0])
    fuse_projections(model)
    torch.testing.assert_close(model.logits(model(ids, pos)[0]), before, atol=1e-4, rtol=0)
    lin = model.model.layers[0].mlp.down_proj
    x, y = torch.randn(2, 3, 128), torch.randn(2, 3, 256)
    assert torch.equal(fp8_linear_torch(y, lin.block(), residual=x), (x + lin(y).float()).float())


def test_a_hybrid_in_projection_fuses_into_whole_blocks_with_the_same_outputs(tiny_hybrid_models, tmp_path):
    """The GDN in-projection (qkv, z, b, a: b and a not multiples of 128 rows) fuses with each part on a
    128-row block of its own, so it keeps the checkpoint's block scales (the form cuBLASLt takes); its
    parts' outputs are the projections' own, bit for bit, and the gap rows are zeros."""
    from ddtree_runtime.model.fp8 import BLOCK, BlockFP8
    from ddtree_runtime.model.layers import linear, split_parts

    gdn = load_target(write_fp8_checkpoint(tiny_hybrid_models / "target", tmp_path / "t")).model.layers[0].linear_attn
    parts = [gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a]
    sizes = [p.out_features for p in parts]
    assert any(n % BLOCK for n in sizes)
    x = torch.randn(2, 5, gdn.in_proj_qkv.in_features)
    with torch.inference_mode():
        alone = [p(x) for p in parts]
        gdn.fuse()
        fused = gdn._in_proj
        y = linear(x, fused)
    assert isinstance(fused, BlockFP8) and fused.scale_rows == BLOCK
    assert fused.qweight.shape[0] == sum(-(-n // BLOCK) * BLOCK for n in sizes)
    starts = [sum(-(-n // BLOCK) * BLOCK for n in sizes[:i]) for i in range(4)]
    for got, want, start in zip(split_parts(y, sizes), alone, starts):
        assert torch.equal(got, want) and got.data_ptr() == y[..., start:].data_ptr()
    gaps = torch.ones(y.shape[-1], dtype=torch.bool)
    for start, n in zip(starts, sizes):
        gaps[start:start + n] = False
    assert gaps.any() and not y[..., gaps].any()
    assert gdn.in_proj_b.weight.data_ptr() == fused.qweight[starts[2]:].data_ptr()   # the state dict's views


def _set_config(d, **changes):
    config = json.loads((d / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("change,named", [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "'awq'"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "'gptq'"),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, "'compressed-tensors'"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, "'bitsandbytes'"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}, "per-tensor scales"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, "[64, 64]"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                              "activation_scheme": "static"}}, "'static'"),
    ({"quantization_config": None}, "no fine-grained fp8 quantization_config"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                              "modules_to_not_convert": ["down_proj"]}}, "modules_to_not_convert"),
])
def test_what_is_not_implemented_is_refused_in_one_line_naming_it(tiny_models, tmp_path, change, named):
    d = write_fp8_checkpoint(tiny_models / "target", tmp_path / "t")
    _set_config(d, **change)
    with pytest.raises(UnsupportedCheckpoint) as err:
        load_target(d)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_integer_or_fp8_embedding_tensors_are_refused(tiny_models, tmp_path):
    d = write_fp8_checkpoint(tiny_models / "target", tmp_path / "t")
    state = load_file(str(d / "model.safetensors"))
    save_file({**state, "model.layers.0.mlp.down_proj.qweight": torch.zeros(4, 4, dtype=torch.int32)},
              str(d / "model.safetensors"))
    with pytest.raises(UnsupportedCheckpoint, match="dtype I32"):
        check_checkpoint(d)
    embed, scale = quantize_blocks(state["model.embed_tokens.weight"])
    save_file({**state, "model.embed_tokens.weight": embed, "model.embed_tokens.weight_scale_inv": scale},
              str(d / "model.safetensors"))
    with pytest.raises(UnsupportedCheckpoint, match="only linear projections"):
        load_target(d)


def test_the_server_refuses_it_with_exit_2_and_one_line(tiny_models, tmp_path, capsys):
    d = tmp_path / "awq"
    shutil.copytree(tiny_models / "target", d)
    _set_config(d, quantization_config={"quant_method": "awq", "bits": 4})
    assert serve_main(["--target", str(d), "--mode", "ar"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--target" in err and "'awq' is not implemented" in err
    assert serve_main(["--target", str(tiny_models / "target"), "--mode", "ar", "--quantize-drafter"]) == 2
    assert "--quantize-drafter needs --quantize fp8" in capsys.readouterr().err
    args = build_parser().parse_args(["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                                      "--quantize", "fp8", "--quantize-drafter"])
    kwargs = config_from_args(args, {}).engine_kwargs()
    assert kwargs["quantization"] == "fp8" and kwargs["quantize_drafter"] is True


def _edit_tensor(d, key, value) -> None:
    state = load_file(str(d / "model.safetensors"))
    save_file({**state, key: value(state[key])}, str(d / "model.safetensors"))


SCALE = "model.layers.0.mlp.down_proj.weight_scale_inv"


@pytest.mark.parametrize("edit,named", [
    (lambda s: s.index_fill(1, torch.tensor([0]), float("nan")), "holds a NaN or Inf"),
    (lambda s: s.index_fill(0, torch.tensor([0]), float("inf")), "holds a NaN or Inf"),
    (lambda s: s.flatten(), "expected float"),                    # 1-D
    (lambda s: torch.cat([s, s]), "expected float"),              # a block row too many
])
def test_a_bad_block_scale_is_refused_before_loading_and_by_the_server(tiny_models, tmp_path, capsys, edit, named):
    """A NaN or Inf scale would serve NaN logits as empty completions; a scale of the wrong shape would
    fail inside the load and leave the server in "error": both are refused before anything loads."""
    d = write_fp8_checkpoint(tiny_models / "target", tmp_path / "t")
    _edit_tensor(d, SCALE, edit)
    with pytest.raises(UnsupportedCheckpoint) as err:
        load_target(d)
    assert named in str(err.value) and SCALE in str(err.value) and "\n" not in str(err.value)
    assert serve_main(["--target", str(d), "--mode", "ar"]) == 2
    out = capsys.readouterr().err.strip()
    assert out.count("\n") == 0 and named in out


def test_a_quantization_config_that_is_not_an_object_is_refused_in_one_line(tiny_models, tmp_path, capsys):
    d = write_fp8_checkpoint(tiny_models / "target", tmp_path / "t")
    _set_config(d, quantization_config="fp8")
    assert serve_main(["--target", str(d), "--mode", "ar"]) == 2
    out = capsys.readouterr().err.strip()
    assert out.count("\n") == 0 and "quantization_config is a str" in out


def test_a_row_of_the_fp8_gemm_does_not_depend_on_the_rows_beside_it():
    """Bit for bit: the same row alone, among 17 and among 300 (the torch path's per-block sums are exact)."""
    g = torch.Generator().manual_seed(3)
    lin = FP8Linear.quantized(torch.nn.Linear(384, 200, bias=True))
    x = torch.randn(300, 384, generator=g) * torch.logspace(-2, 1, 384)
    with torch.inference_mode():
        alone, some, many = lin(x[:1]), lin(x[:17]), lin(x)
    assert torch.equal(alone[0], some[0]) and torch.equal(some, many[:17])


def test_a_gemm_tile_fits_the_shared_memory_of_the_gpu_it_runs_on():
    """The H200's tiles on an RTX PRO 6000 (about 100 KB a program): fewer pipeline stages, same tile."""
    from ddtree_runtime.model import fp8

    for m in (1, 17, 272, 4096):
        h200, small = fp8.gemm_tile(m, 5120, 17408, 132, 232448), fp8.gemm_tile(m, 5120, 17408, 188, 101376)
        assert small._replace(stages=h200.stages) == h200 or small.block_n < h200.block_n
        assert 2 <= small.stages and small.stages * (small.block_m + small.block_n) * 128 <= 101376 - 8192


def test_seeded_sampling_in_fp8_is_the_same_alone_batched_and_after_a_cached_prefix(pair, prompts):
    """With --quantize fp8, a seed gives one text whatever runs beside it (a prefill chunked by 16 beside
    another request's decode) and whether its prompt's prefix was cached or not."""
    engine = Engine(EngineConfig(str(pair / "target"), str(pair / "draft"), quantization="fp8", max_running=4,
                                 max_batched_tokens=16))
    requests = [(prompts[i], SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=100 + i,
                                            mode=("ar", "ddtree", "dflash")[i % 3], logprobs=1)) for i in range(4)]
    cold = [list(engine.generate(p, q)) for p, q in requests]                   # each prompt new to the cache
    cached = [list(engine.generate(p, q)) for p, q in requests]                 # its prefix cached now
    ids = [engine.submit(p, q) for p, q in requests]
    batched: dict[int, list] = {i: [] for i in ids}
    while engine.has_work:
        for i, out in engine.step():
            batched[i].append(out)
    def text(outs): return [t for r in outs for t in r.token_ids]
    def logprobs(outs): return torch.tensor([lp.logprob for r in outs for lp in r.logprobs])
    for c, h, b in zip(cold, cached, batched.values()):
        assert text(c) == text(h) == text(b)
        # the rest of the float32 model still sums in batch-dependent orders (~1e-7, as in 16 bits); the
        # FP8 GEMM no longer amplifies that (it moved a logprob by ~1e-2 before)
        assert torch.allclose(logprobs(c), logprobs(h), atol=1e-5) and torch.allclose(logprobs(c), logprobs(b), atol=1e-5)
    assert engine.stats.prefix_tokens_saved > 0


@pytest.fixture(scope="module")
def prompts(pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pair / "target"))
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in heldout_questions(8, seed=7)]


def _tokens(engine: Engine, prompt: list[int], **kw) -> list[int]:
    return [t for r in engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW, **kw)) for t in r.token_ids]


def test_speculative_decoding_is_lossless_against_the_fp8_target(pair, fp8_target, prompts):
    """ddtree and dflash with the 16-bit drafter give the FP8 target's own greedy AR tokens, alone and
    batched; the target quantized at load gives the same tokens as its FP8 checkpoint."""
    engine = Engine(EngineConfig(str(fp8_target), str(pair / "draft")))
    reference = [_tokens(engine, p, mode="ar") for p in prompts]
    accepted = 0
    for p, ref in zip(prompts, reference):
        for mode, budget in (("dflash", None), ("ddtree", 16)):
            out = [r for r in engine.generate(p, SamplingParams(max_new_tokens=MAX_NEW, mode=mode, tree_budget=budget))]
            assert [t for r in out for t in r.token_ids] == ref, mode
            accepted += sum(r.accepted for r in out)
    assert accepted > len(prompts) * 2  # the 16-bit drafter still drafts well for the FP8 target

    batched = Engine(EngineConfig(str(pair / "target"), str(pair / "draft"), max_running=4, quantization="fp8"))
    ids = {(i, mode): batched.submit(p, SamplingParams(max_new_tokens=MAX_NEW, mode=mode))
           for i, p in enumerate(prompts[:4]) for mode in ("ar", "dflash", "ddtree")}
    got: dict[int, list[int]] = {n: [] for n in ids.values()}
    while batched.has_work:
        for n, out in batched.step():
            got[n] += out.token_ids
    for (i, mode), n in ids.items():
        assert got[n] == reference[i], f"prompt {i}, {mode}, batched"
    assert isinstance(batched.target.model.layers[0].mlp.down_proj, FP8Linear)
    assert engine.quantization == batched.quantization == "fp8"   # the checkpoint's, and --quantize's
    assert engine.fp8_gemm == batched.fp8_gemm == "torch"          # the GEMM path a CPU runs (/health)
    assert type(batched.drafter.layers[0].mlp.down_proj) is torch.nn.Linear  # the drafter stays unless asked


def test_an_fp8_drafter_is_opt_in_and_still_lossless(pair, prompts):
    engine = Engine(EngineConfig(str(pair / "target"), str(pair / "draft"), quantization="fp8",
                                 quantize_drafter=True))
    assert isinstance(engine.drafter.fc, FP8Linear) and isinstance(engine.drafter.layers[0].self_attn.k_proj, FP8Linear)
    for p in prompts[:3]:
        assert _tokens(engine, p, mode="ddtree") == _tokens(engine, p, mode="ar")
    with pytest.raises(ValueError, match="quantize_drafter needs"):
        Engine(EngineConfig(str(pair / "target"), str(pair / "draft"), quantize_drafter=True))


def test_the_gemm_benchmark_names_each_weight_major_tile_and_reads_it_back(capsys):
    """fp8_gemm_bench.py needs a GPU to time; its sweep and names are plain Python, checked here: every
    weight-major tile has 64 or 128 weight rows (wgmma's M side) and no more tokens than the rows' next
    power of two (16 at least), and a candidate's name in the JSON gives back its tile and family; --large's
    row-major tiles are wgmma's (64 rows and more), none more than 2,048 outputs a warp."""
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    sys.path.insert(0, str(Path(__file__).parents[2] / "runtime" / "bench"))
    import fp8_gemm_bench as bench

    for m in bench.ROWS:
        tiles = bench.weight_major_tiles(m)
        assert tiles and set(bench.weight_major_tiles(m, lean=True)) <= set(tiles)
        for tile in tiles:
            assert tile.weights_left and tile.block_n in (64, 128)
            assert 16 <= tile.block_m <= max(16, 1 << (m - 1).bit_length())
            assert bench.parse_tile(bench.candidate(tile) + "g1") == tile and bench.family(tile) == "triton_wm"
    row_major = bench.tiles_for(17)[0]
    assert bench.parse_tile(bench.candidate(row_major)) == row_major and bench.family(row_major) == "triton_m32"
    assert bench.wgmma_tiles(17) == [] and bench.wgmma_tiles(64)   # --large: wgmma tiles from 64 rows
    by_tma = bench.wgmma_tiles(64)[0]._replace(tma=True)
    # 272 rows leave 16 in a last tile of 64 or 128: each such tile also as a tail launch, named apart
    tails = [t for t in bench.wgmma_tiles(272) if t.tail and not t.padded]
    assert tails and {t._replace(tail=False) for t in tails} <= set(bench.wgmma_tiles(272))
    assert all(272 % t.block_m == 16 for t in tails) and not any(t.tail for t in bench.wgmma_tiles(256))
    # x's codes padded to whole tiles where the rows leave the last one short (none at 256 rows)
    padded = [t for t in bench.wgmma_tiles(272) if t.padded]
    assert padded and {t._replace(padded=False) for t in padded} <= set(bench.wgmma_tiles(272))
    assert {t._replace(padded=False) for t in padded if t.tail} == set(tails)   # the tail launches padded too
    assert not any(t.padded for t in bench.wgmma_tiles(256)) and not any(t.padded for t in bench.wgmma_tiles(4096))
    extra = tails + padded
    for tile in extra + [t._replace(tma=True) for t in extra]:
        assert bench.parse_tile(bench.candidate(tile)) == tile and bench.family(tile) == "triton_m64"
    assert bench.parse_tile(bench.candidate(by_tma)) == by_tma and bench.family(by_tma) == "triton_m64"
    assert all(bench.family(t) == "triton_m64" and t.block_m * t.block_n <= 2048 * t.warps for t in bench.wgmma_tiles(64))
    with pytest.raises(SystemExit) as done:
        bench.main(["--help"])
    assert done.value.code == 0 and "--weight-major-only" in capsys.readouterr().out


def test_hoppers_triton_tiles_are_wgmma_tiles_by_tensor_descriptors_for_every_row_count():
    """--fp8-gemm triton: each shape's table (and the default) is of the wgmma family alone (weight-major
    tiles of 64 or 128 weight rows, row-major of 64 tokens and more, x's codes padded to whole tiles there),
    reads by tensor descriptors and covers every row count; an unknown preference is refused by name."""
    for table in [*F.HOPPER_TILES.values(), F.HOPPER_DEFAULT]:
        assert [rows for rows, _ in table] == sorted(rows for rows, _ in table) and table[-1][0] >= 1 << 40
        for _, tile in table:
            assert tile.tma and (tile.block_n in (64, 128) if tile.weights_left else tile.block_m >= 64)
            assert tile.padded is not tile.weights_left   # row-major: x's codes in whole tiles of rows
    assert F.hopper_tile(1, 5120, 17408).weights_left and not F.hopper_tile(272, 5120, 17408).weights_left
    with pytest.raises(ValueError, match="fp8_gemm must be one of"):
        F.choose_gemms(torch.nn.Linear(2, 2), torch.device("cpu"), torch.float32, 16, "cublas")


def test_the_gpu_benchmark_runs_its_code_on_a_cpu(tmp_path):
    """runtime/bench/fp8_bench.py is for a GPU session; --device cpu --tiny runs every part of it, FP8 with
    each GEMM preference of a list against one bf16 run."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).parents[2] / "runtime" / "bench" / "fp8_bench.py"
    out = tmp_path / "fp8.json"
    done = subprocess.run([sys.executable, str(bench), "--device", "cpu", "--tiny", "--fp8-gemm", "auto,triton",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["gemm_rel_err"] and max(report["gemm_rel_err"].values()) < 1e-2
    result = report["shapes"]["hybrid-small"]
    assert result["fp8"]["target_bytes"] < result["bf16"]["target_bytes"]
    for precision in ("bf16", "fp8"):
        assert {"ar_step_ms", "ddtree16_round_ms", "ddtree16_4_running_ms", "prefill_128_ms"} <= set(result[precision])
    assert result["fp8_over_bf16"]["prefill_64_ms"] > 0
    assert report["fp8_gemm"] == "torch"   # the GEMM points need a GPU (fp8_gemm_bench.py)
    assert set(result["fp8"]["checks"]["matching_prefix_of_8"]) == {"ar", "dflash", "ddtree@16", "ddtree@128"}
    assert set(result["by_fp8_gemm"]) == {"auto", "triton"} and result["by_fp8_gemm"]["auto"]["fp8"] == result["fp8"]
    assert result["by_fp8_gemm"]["triton"]["targets"].keys() == result["targets"].keys()

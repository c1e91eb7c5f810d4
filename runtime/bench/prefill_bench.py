"""Long-context prefill and decode of the runtime's engine on a GPU, beside the field's own kernels.

    PYTHONPATH=runtime python runtime/bench/prefill_bench.py [--shapes qwen3.6-27b,qwen3-8b]
        [--contexts 4096,32768,131072] [--pieces 32768,16384,8192] [--skip-checks] [--out OUT.json]

Randomly initialised models of real shapes (gpu_bench.SHAPES), bf16. Per shape and context: the time to
first token of `Engine.generate` (the prefill and the first token's choice; what a request waits for
before its first token, less tokenisation and HTTP), then the ddtree@16 round at that context (the
median of per-round times, each synchronised; random weights accept nothing, so a round commits one
token). Beside it, the same prefill assembled from the field's kernels alone (fla-core's
chunk_gated_delta_rule for the Gated DeltaNet layers, PyTorch SDPA flash attention with is_causal for the
attention layers, plain bf16 GEMMs and torch elementwise ops for the rest), over the same weights, in the
same run. Floors: 2 x non-embedding parameters x tokens over the measured bf16 matmul rate, and the same
plus the causal attention's FLOPs. `--pieces`: the engine's prefill piece (PREFILL_PIECE) to compare,
each context served once per piece (the first listed also times the round; a context's row holds its
figures, `by_piece` every piece's), with the peak memory the prefill took above what was allocated
before it. The prefix cache is off, so a repeated prompt is prefilled again. Writes the JSON after every
measurement, so a run cut short keeps what it measured."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_bench import build_models, measure_ceilings, nbytes, sync
from ddtree_runtime.capacity import PREFILL_PIECE
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams, scheduler
from ddtree_runtime.engine.kv_cache import target_cache
from ddtree_runtime.engine.prefill import prefill
from ddtree_runtime.model import Qwen35Config
from ddtree_runtime.model.layers import fuse_projections
from ddtree_runtime.model.gdn_chunk import _fla_chunk, chunk_gated_delta, chunk_gated_delta_torch

DECODE_ROUNDS, DECODE_WARMUP = 12, 4


def check_fla(device: torch.device) -> dict:
    """chunk_gated_delta on CUDA in bf16 (fla's kernels) against the torch path in float32 over the same
    inputs, from a random state: ||out - ref|| / ||ref||, final state likewise."""
    g = torch.Generator(device=device).manual_seed(0)
    t, hk, hv, dk, dv = 1000, 16, 48, 128, 128
    q, k = (torch.randn(1, t, hk, dk, device=device, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, t, hv, dv, device=device, generator=g).bfloat16()
    decay = -torch.rand(1, t, hv, device=device, generator=g) * 0.3
    beta = torch.rand(1, t, hv, device=device, generator=g)
    state = torch.randn(1, hv, dk, dv, device=device, generator=g) * 0.1
    out, final = chunk_gated_delta(q, k, v, decay, beta, state)
    ref, ref_final = chunk_gated_delta_torch(q, k, v, decay, beta.bfloat16().float(), state, dk ** -0.5)

    def err(a, b):
        return float((a.float() - b).norm() / b.norm())
    return {"fla_used": _fla_chunk() is not None and out.dtype == torch.bfloat16,
            "out_rel_err": err(out, ref), "state_rel_err": err(final, ref_final)}


def check_pieces(device: torch.device) -> dict:
    """The engine's prefill in pieces against one forward over the same prompt (4-layer real-width
    shapes): ||h - ref|| / ||ref|| of the last hidden state and of the features, in bf16 (flash
    attention lower-right, fla from a carried state) and float32, and whether SDPA takes the flash
    kernel for a later piece's lower-right causal attention at the 27B's head shape."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    out = {}
    for shape, dtype, length, piece in (("qwen3.6-27b-4layer", torch.bfloat16, 20000, 16384),
                                        ("qwen3.6-27b-4layer", torch.float32, 5000, 2048),
                                        ("qwen3-8b-4layer", torch.bfloat16, 20000, 16384)):
        target, _ = build_models(shape, device, dtype)
        fuse_projections(target)
        target.feature_layers = [1, 2]
        ids = torch.randint(0, target.config.vocab_size - 1, (1, length), device=device)
        with torch.inference_mode():
            runs = [prefill(target, ids, target_cache(target.config, length + 512, device, dtype), piece=p)
                    for p in (length, piece)]
        (h, f), (hp, fp) = runs
        out[f"{shape}-{str(dtype)[6:]}-{length}-by-{piece}"] = {
            "h_rel_err": float((hp.float() - h.float()).norm() / h.float().norm()),
            "feats_rel_err": float((fp.float() - f.float()).norm() / f.float().norm())}
        del target, runs
        torch.cuda.empty_cache()
    q = torch.randn(1, 24, 16384, 256, device=device, dtype=torch.bfloat16)
    kv = torch.randn(1, 4, 32768, 256, device=device, dtype=torch.bfloat16)
    out["flash_for_lower_right_27b_heads"] = bool(can_use_flash_attention(
        SDPAParams(q, kv, kv, None, 0.0, True, True)))
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of the first cos.shape[-1] dims (partial RoPE), plain torch."""
    r = cos.shape[-1]
    x1, x2 = x[..., :r // 2], x[..., r // 2:r]
    return torch.cat([x[..., :r] * cos + torch.cat([-x2, x1], -1) * sin, x[..., r:]], -1)


@torch.inference_mode()
def field_prefill(target, ids: torch.Tensor) -> torch.Tensor:
    """The target's prefill from the field's kernels alone, over its (fused) weights; final hidden
    states [1, T, H]. No cache is written: it is the reference assembly's cost, not a serving path."""
    fla = _fla_chunk()
    cfg = target.config
    t, eps = ids.shape[1], cfg.rms_norm_eps
    x = target.model.embed_tokens(ids)
    cos, sin = target.rotary(torch.arange(t, device=ids.device)[None], x.dtype)
    norm = lambda y, w: F.rms_norm(y, (y.shape[-1],), w, eps)  # noqa: E731
    for layer in target.model.layers:
        h = norm(x, layer.input_layernorm.weight)
        if hasattr(layer, "linear_attn"):
            m = layer.linear_attn
            nk, nv = m.n_k * m.dk, m.n_v * m.dv
            mixed, z, b, a = F.linear(h, m._in_proj).split([m.conv_dim, nv, m.n_v, m.n_v], -1)
            conv = F.silu(F.conv1d(F.pad(mixed.transpose(1, 2), (m.kernel - 1, 0)), m.conv1d.weight,
                                   groups=m.conv_dim)).transpose(1, 2)
            q, k, v = conv.split([nk, nk, nv], -1)
            decay = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias.float())
            o, _ = fla(q.reshape(1, t, m.n_k, m.dk), k.reshape(1, t, m.n_k, m.dk), v.reshape(1, t, m.n_v, m.dv),
                       decay, b.sigmoid(), output_final_state=True, use_qk_l2norm_in_kernel=True)
            o = norm(o, m.norm.weight) * F.silu(z.reshape(1, t, m.n_v, m.dv))
            x = x + F.linear(o.reshape(1, t, -1), m.out_proj.weight)
        else:
            at = layer.self_attn
            d, nh, nkv = at.head_dim, at.n_heads, at.n_kv
            gated = isinstance(cfg, Qwen35Config)  # the hybrid's attention has an output gate
            qo = nh * d * (2 if gated else 1)
            qg, k, v = F.linear(h, *at._qkv).split([qo, nkv * d, nkv * d], -1)
            qg = qg.view(1, t, nh, -1)
            q = rope(norm(qg[..., :d], at.q_norm.weight).transpose(1, 2), cos, sin)
            k = rope(norm(k.view(1, t, nkv, d), at.k_norm.weight).transpose(1, 2), cos, sin)
            o = F.scaled_dot_product_attention(q, k, v.view(1, t, nkv, d).transpose(1, 2), is_causal=True,
                                               enable_gqa=True).transpose(1, 2).reshape(1, t, -1)
            if gated:
                o = o * torch.sigmoid(qg[..., d:].reshape(1, t, -1))
            x = x + F.linear(o, at.o_proj.weight)
        gate_up = F.linear(norm(x, layer.post_attention_layernorm.weight), layer.mlp._gate_up)
        gate, up = gate_up.chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)
    return norm(x, target.model.norm.weight)


def timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def serve_once(engine: Engine, prompt: list[int], rounds: int) -> dict:
    """Time to first token, then `rounds` ddtree@16 rounds (median of each round, synchronised)."""
    dev = engine.device
    gen = engine.generate(prompt, SamplingParams(max_new_tokens=17 * (rounds + DECODE_WARMUP) + 1,
                                                 mode="ddtree", tree_budget=16))
    out = {"ttft_s": timed(lambda: next(gen), dev)}
    if rounds:
        for _ in range(DECODE_WARMUP):
            next(gen)
        out["round_ms"] = 1e3 * statistics.median(timed(lambda: next(gen), dev) for _ in range(rounds))
    gen.close()
    return out


def serve_with_piece(engine: Engine, prompt: list[int], piece: int, rounds: int, repeat: bool) -> dict:
    """serve_once with prefill pieces of `piece` tokens, and the peak memory above what was allocated
    before (the prefill's activations: what capacity.prefill_workspace_bytes bounds); with `repeat`, a
    second time to first token (the first at a new length may pay allocations)."""
    shipped = scheduler.PREFILL_PIECE
    scheduler.PREFILL_PIECE = piece
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        run = serve_once(engine, prompt, rounds)
        run["serving_peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        run["prefill_peak_above_gib"] = (torch.cuda.max_memory_allocated() - before) / 2 ** 30
        if repeat:
            run["ttft_s_repeat"] = serve_once(engine, prompt, 0)["ttft_s"]
    except Exception:  # noqa: BLE001 (the benchmark reports what failed and goes on)
        run = {"error": traceback.format_exc()[-2000:]}
    finally:
        scheduler.PREFILL_PIECE = shipped
    return run


def floors(target, ctx: int, rate: float) -> dict:
    cfg = target.config
    params = (sum(p.numel() for p in target.parameters()) - target.model.embed_tokens.weight.numel()
              - target.lm_head.weight.numel())
    attn_layers = cfg.kv_layers
    # causal QK^T and PV: 2 GEMMs x 2 FLOPs x T^2 / 2 x heads x head_dim per attention layer
    attn = attn_layers * 2 * ctx * ctx * cfg.num_attention_heads * cfg.head_dim
    return {"gemm_s": 2 * params * ctx / rate, "gemm_attention_s": (2 * params * ctx + attn) / rate,
            "non_embedding_params": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3.6-27b,qwen3-8b")
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--field-max", type=int, default=32768, help="longest context the field assembly runs at")
    ap.add_argument("--repeat-max", type=int, default=32768, help="longest context whose first token is timed twice")
    ap.add_argument("--pieces", default=str(PREFILL_PIECE), help="prefill pieces to compare (tokens a forward)")
    ap.add_argument("--skip-checks", action="store_true", help="skip the fla and pieces accuracy checks")
    ap.add_argument("--out", default="bench/results/runtime-prefill-bench.json")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    device = torch.device("cuda")
    contexts = [int(c) for c in args.contexts.split(",")]
    pieces = [int(p) for p in args.pieces.split(",")]
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"label": args.label, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "ceilings": measure_ceilings(device), "shapes": {}}

    def save() -> None:
        out_path.write_text(json.dumps(report, indent=2))

    checks = {} if args.skip_checks else {"fla_check": check_fla, "pieces_check": check_pieces}
    for name, check in checks.items():
        try:
            report[name] = check(device)
        except Exception:  # noqa: BLE001 (the benchmark reports what failed and goes on)
            report[name] = {"error": traceback.format_exc()[-2000:]}
        print(f"{name}:", report[name], flush=True)
    rate = report["ceilings"]["matmul_flops_per_s"]
    save()
    g = torch.Generator().manual_seed(1)
    for shape in args.shapes.split(","):
        rows = report["shapes"][shape] = {}
        target, drafter = build_models(shape, device, torch.bfloat16)
        # the shapes' configs keep the default 40,960 positions; Qwen3.6 allows 262,144 (random weights:
        # positions are only a limit here)
        target.config.max_position_embeddings = max(contexts) + 2048
        engine = Engine(EngineConfig(f"random-{shape}", None, mode="ddtree", tree_budget=16, device="cuda",
                                     dtype="bfloat16", max_context=max(contexts) + 1024, prefix_cache=False),
                        target=target, drafter=drafter)
        vocab = target.config.vocab_size
        rows["target_bytes"], rows["drafter_bytes"] = nbytes(target), nbytes(drafter)
        rows["max_context"] = engine.max_context
        warm = torch.randint(0, vocab - 1, (1000,), generator=g).tolist()
        serve_once(engine, warm, DECODE_ROUNDS)              # Triton compiles, fla's autotuning, graphs
        rows["round_512"] = serve_once(engine, warm[:512], DECODE_ROUNDS)
        print(f"{shape}: ddtree@16 round at 512: {rows['round_512']['round_ms']:.2f} ms", flush=True)
        save()
        for ctx in contexts:
            prompt = torch.randint(0, vocab - 1, (ctx,), generator=g).tolist()
            row = rows[str(ctx)] = {"floors": floors(target, ctx, rate), "by_piece": {}}
            for i, piece in enumerate(pieces):
                run = serve_with_piece(engine, prompt, piece, DECODE_ROUNDS if i == 0 else 0, ctx <= args.repeat_max)
                row["by_piece"][str(piece)] = run
                if i == 0:
                    row.update(run)
                print(f"{shape} ctx {ctx} piece {piece}: {json.dumps(run)}", flush=True)
                save()
            try:
                ids = torch.tensor([prompt], device=device)
                if _fla_chunk() is not None and ctx <= args.field_max:
                    field_prefill(target, ids[:, :1024])
                    field = functools.partial(field_prefill, target, ids)
                    row["field_prefill_s"] = min(timed(field, device) for _ in range(2))
            except Exception:  # noqa: BLE001
                row["error"] = traceback.format_exc()[-2000:]
            torch.cuda.empty_cache()
            print(f"{shape} ctx {ctx}: {json.dumps({k: v for k, v in row.items() if k != 'error'})}"
                  + (f"\n{row['error']}" if "error" in row else ""), flush=True)
            save()
        del engine
        torch.cuda.empty_cache()
        # the default context on this device: the target's positions as far as free memory holds them
        target.config.max_position_embeddings = 262144
        engine = Engine(EngineConfig(f"random-{shape}", None, mode="ddtree", tree_budget=16, device="cuda",
                                     dtype="bfloat16"), target=target, drafter=drafter)
        rows["default_max_context_of_262144"] = engine.max_context
        rows["needed_gib_at_131072"] = engine.needed_bytes(131072) / 2 ** 30
        print(f"{shape}: default max context {engine.max_context}", flush=True)
        save()
        del engine, target, drafter
        torch.cuda.empty_cache()

    print(f"\n{'shape':<12}{'ctx':>7}{'TTFT s':>9}{'again':>8}{'field s':>9}{'ours/field':>11}{'floor s':>9}"
          f"{'+attn':>8}{'round ms':>10}{'x 512':>7}")
    for shape, rows in report["shapes"].items():
        for ctx in contexts:
            r = rows.get(str(ctx))
            if not r or "ttft_s" not in r:
                continue
            best = min(r["ttft_s"], r.get("ttft_s_repeat", r["ttft_s"]))
            field = r.get("field_prefill_s")
            print(f"{shape:<12}{ctx:>7}{r['ttft_s']:>9.3f}{r.get('ttft_s_repeat', float('nan')):>8.3f}"
                  f"{field or float('nan'):>9.3f}{best / field if field else float('nan'):>11.2f}"
                  f"{r['floors']['gemm_s']:>9.3f}{r['floors']['gemm_attention_s']:>8.3f}"
                  f"{r.get('round_ms', float('nan')):>10.2f}"
                  f"{r.get('round_ms', float('nan')) / rows['round_512']['round_ms']:>7.2f}")
    if len(pieces) > 1:
        print(f"\n{'shape':<12}{'ctx':>7}{'piece':>7}{'TTFT s':>9}{'again':>8}{'peak above GiB':>16}")
        for shape, rows in report["shapes"].items():
            for ctx in contexts:
                for piece, r in rows.get(str(ctx), {}).get("by_piece", {}).items():
                    ttft, again, above = (r.get(k, float("nan")) for k in ("ttft_s", "ttft_s_repeat",
                                                                            "prefill_peak_above_gib"))
                    print(f"{shape:<12}{ctx:>7}{piece:>7}{ttft:>9.3f}{again:>8.3f}{above:>16.2f}")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()

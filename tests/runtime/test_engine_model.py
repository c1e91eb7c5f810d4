"""Model-level checks: our Qwen3 matches transformers; the drafter loads z-lab-format checkpoints and
its cached (inference) path equals its masked (training) path; KV compaction moves the right rows."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ddtree_runtime.engine.kv_cache import KVCache
from ddtree_runtime.model import load_drafter, load_target


@pytest.fixture(scope="module")
def hf_qwen3_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, tie_word_embeddings=False, rope_theta=10000.0)
    model = Qwen3ForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(str(d))
    return d, model


def test_qwen3_matches_transformers(hf_qwen3_dir):
    d, hf = hf_qwen3_dir
    ours = load_target(d)
    ours.feature_layers = [0, 2, 1]  # out of order on purpose: features follow this order
    ids = torch.randint(0, 320, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        h, feats = ours(ids, torch.arange(37)[None].expand(2, -1))
    torch.testing.assert_close(ours.logits(h), ref.logits, rtol=1e-4, atol=1e-4)
    expect = torch.cat([ref.hidden_states[1], ref.hidden_states[3], ref.hidden_states[2]], dim=-1)
    torch.testing.assert_close(feats, expect, rtol=1e-4, atol=1e-4)


def test_qwen3_cached_decode_matches_full_forward(hf_qwen3_dir):
    d, _ = hf_qwen3_dir
    m = load_target(d)
    c = m.config
    ids = torch.randint(0, 320, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = m.logits(m(ids, torch.arange(20)[None])[0])
        cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 32, "cpu", torch.float32)
        part = [m.logits(m(ids[:, :12], torch.arange(12)[None], cache, 0)[0])]
        for i in range(12, 20):
            part.append(m.logits(m(ids[:, i:i + 1], torch.tensor([[i]]), cache, i)[0]))
    torch.testing.assert_close(torch.cat(part, 1), full, rtol=1e-4, atol=1e-4)


def test_qwen3_loads_in_bfloat16(tiny_models):
    m = load_target(tiny_models / "target", dtype="bfloat16")
    assert m.lm_head.weight.dtype == torch.bfloat16
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()  # tied
    h, _ = m(torch.tensor([[1, 2, 3]]), torch.arange(3)[None])
    assert torch.isfinite(m.logits(h)).all()


def _zlab_checkpoint(path, hidden=64, layers=2, heads=4, kv=2, head_dim=16, inter=128,
                     target_ids=(1, 3), vocab=320):
    """A drafter checkpoint laid out like z-lab's DFlash releases (config fields and weight names)."""
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "block_size": 16, "num_target_layers": 6,
        "dflash_config": {"mask_token_id": 300, "target_layer_ids": list(target_ids)},
        "head_dim": head_dim, "hidden_act": "silu", "hidden_size": hidden, "intermediate_size": inter,
        "layer_types": ["full_attention"] * layers, "max_position_embeddings": 4096,
        "num_attention_heads": heads, "num_hidden_layers": layers, "num_key_value_heads": kv,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "sliding_window": None, "tie_word_embeddings": False, "use_cache": True, "vocab_size": vocab,
        "dtype": "bfloat16",
    }
    g = torch.Generator().manual_seed(3)
    w = {}
    for i in range(layers):
        p = f"layers.{i}."
        w[p + "self_attn.q_proj.weight"] = torch.randn(heads * head_dim, hidden, generator=g) * 0.05
        w[p + "self_attn.k_proj.weight"] = torch.randn(kv * head_dim, hidden, generator=g) * 0.05
        w[p + "self_attn.v_proj.weight"] = torch.randn(kv * head_dim, hidden, generator=g) * 0.05
        w[p + "self_attn.o_proj.weight"] = torch.randn(hidden, heads * head_dim, generator=g) * 0.05
        w[p + "self_attn.q_norm.weight"] = torch.ones(head_dim)
        w[p + "self_attn.k_norm.weight"] = torch.ones(head_dim)
        w[p + "mlp.gate_proj.weight"] = torch.randn(inter, hidden, generator=g) * 0.05
        w[p + "mlp.up_proj.weight"] = torch.randn(inter, hidden, generator=g) * 0.05
        w[p + "mlp.down_proj.weight"] = torch.randn(hidden, inter, generator=g) * 0.05
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    w["norm.weight"] = torch.ones(hidden)
    w["hidden_norm.weight"] = torch.ones(hidden)
    w["fc.weight"] = torch.randn(hidden, len(target_ids) * hidden, generator=g) * 0.05
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.to(torch.bfloat16) for k, v in w.items()}, str(path / "model.safetensors"))


def test_drafter_loads_zlab_format(tmp_path):
    _zlab_checkpoint(tmp_path / "draft")
    d = load_drafter(tmp_path / "draft")
    cfg = d.config
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (16, 300, [1, 3])
    assert cfg.rope_theta == 1_000_000.0 and cfg.num_target_layers == 6
    assert d.fc.weight.shape == (64, 128) and d.fc.weight.dtype == torch.float32
    d16 = load_drafter(tmp_path / "draft", dtype="bfloat16")
    assert d16.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_drafter_cached_path_matches_masked_path(tmp_path):
    """Inference (context k/v cached over two rounds) == training layout (explicit mask, no cache)."""
    _zlab_checkpoint(tmp_path / "draft")
    d = load_drafter(tmp_path / "draft")
    c = d.config
    g = torch.Generator().manual_seed(4)
    T, bs = 30, c.block_size
    feats = torch.randn(1, T, 2 * c.hidden_size, generator=g)
    block = torch.randn(1, bs, c.hidden_size, generator=g)
    s = 21  # block root position: the block sees context positions < s
    pos = torch.arange(s, s + bs)[None]
    with torch.no_grad():
        mask = torch.cat([(torch.arange(T) < s)[None].expand(bs, T), torch.ones(bs, bs, dtype=torch.bool)], 1)
        ref = d(block, pos, feats, torch.arange(T)[None], mask=mask[None, None])
        cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 64, "cpu", torch.float32)
        d(block, torch.arange(13, 13 + bs)[None], feats[:, :13], torch.arange(13)[None], cache, 0)
        got = d(block, pos, feats[:, 13:s], torch.arange(13, s)[None], cache, 13)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_kv_compaction_moves_selected_rows():
    cache = KVCache(2, 1, 4, 16, "cpu", torch.float32)
    vals = torch.arange(16, dtype=torch.float32)[None, None, :, None].expand(1, 1, 16, 4)
    for layer in range(2):
        cache.write(layer, 0, vals, -vals)
    cache.compact(torch.tensor([5]), torch.tensor([[0, 2, 3, 7]]), torch.tensor([4]))  # nodes at 5,7,8,12
    assert cache.k[1, 0, 0, :9, 0].tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 12]
    assert cache.v[0, 0, 0, 5:9, 0].tolist() == [-5, -7, -8, -12]


@pytest.mark.parametrize("extra", [
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}},
    {"use_sliding_window": True, "sliding_window": 1024},
])
def test_unsupported_configs_fail_loudly(extra):
    from ddtree_runtime.model import Qwen3Config

    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4}
    Qwen3Config.from_dict(base)
    with pytest.raises(ValueError):
        Qwen3Config.from_dict({**base, **extra})

"""The tiny models ddtree-tiny builds: loadable by transformers, z-lab drafter layout, Qwen-style chat
template, and a drafter good enough to make speculation worthwhile."""

from __future__ import annotations

import json

import torch


def test_layout_and_marker(tiny_models):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (tiny_models / "target" / name).exists(), name
    for name in ("config.json", "model.safetensors"):
        assert (tiny_models / "draft" / name).exists(), name
    assert (tiny_models / ".complete").exists()


def test_target_loads_in_transformers(tiny_models):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(tiny_models / "target"), dtype=torch.float32)
    assert m.config.model_type == "qwen3" and m.config.num_hidden_layers == 4
    assert m.config.max_position_embeddings == 2048
    out = m(torch.tensor([[1, 2, 3]]))
    assert out.logits.shape[-1] == m.config.vocab_size


def test_tokenizer_and_chat_template(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_models / "target"))
    assert tok.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    off = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert off == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    on = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=True)
    assert on.endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                   enable_thinking=False) == off
    text = "say: cat dog 12+7=19"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_drafter_config_is_zlab_format(tiny_models):
    from transformers import AutoTokenizer

    cfg = json.loads((tiny_models / "draft" / "config.json").read_text())
    tcfg = json.loads((tiny_models / "target" / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(tiny_models / "target"))
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 16 and cfg["num_target_layers"] == tcfg["num_hidden_layers"]
    assert cfg["dflash_config"]["mask_token_id"] == tok.convert_tokens_to_ids("<|MASK|>")
    assert all(0 <= i < tcfg["num_hidden_layers"] for i in cfg["dflash_config"]["target_layer_ids"])
    from safetensors import safe_open

    with safe_open(str(tiny_models / "draft" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= keys
    assert not any("embed" in k or "lm_head" in k for k in keys)


def test_recorded_acceptance(tiny_models):
    res = json.loads((tiny_models / "tiny_results.json").read_text())
    assert res["ddtree_b16"] >= 3.0
    assert res["ddtree_b16"] >= res["dflash_b15"] - 0.2  # the tree should not lose to the chain


def test_hybrid_target_is_a_transformers_qwen3_5(tiny_hybrid_models):
    """--arch qwen3_5: Gated DeltaNet and full-attention layers mixed, loadable by transformers as
    Qwen3.5 (zero-centred norms written back), with a drafter that makes speculation pay."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(tiny_hybrid_models / "target"), dtype=torch.float32)
    assert m.config.model_type == "qwen3_5_text"
    assert set(m.config.layer_types) == {"linear_attention", "full_attention"}
    norms = [p for n, p in m.named_parameters() if n.endswith("input_layernorm.weight")]
    assert all(p.abs().mean() < 0.5 for p in norms)  # stored as w, applied as 1 + w
    draft = json.loads((tiny_hybrid_models / "draft" / "config.json").read_text())
    assert draft["num_target_layers"] == m.config.num_hidden_layers
    res = json.loads((tiny_hybrid_models / "tiny_results.json").read_text())
    # fixture v2 answers and stops (v1 ran on in repetitions a drafter guesses easily: dflash 8.9)
    assert res["ddtree_b16"] >= 3.0 and res["dflash_b15"] >= 2.0

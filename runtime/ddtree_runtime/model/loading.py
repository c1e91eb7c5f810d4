"""Load HF-style checkpoint directories (config.json + *.safetensors) into our modules."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from .config import DFlashConfig, Qwen35Config, target_config
from .dflash import DFlashDrafter
from .layers import Rotary
from .qwen3 import Qwen3ForCausalLM
from .qwen3_5 import Qwen35ForCausalLM, from_hf_state

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of every *.safetensors file in a directory (handles sharded checkpoints)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _load_into(module: nn.Module, state: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> None:
    wanted = set(module.state_dict().keys())
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items() if k in wanted}
    missing = wanted - set(state)
    if missing:
        raise KeyError(f"checkpoint lacks {sorted(missing)[:5]} (+{max(0, len(missing) - 5)} more)")
    module.load_state_dict(state, strict=True, assign=True)


def load_target(path: str | Path, device: str = "cpu", dtype: str = "float32") -> Qwen3ForCausalLM:
    """A Qwen3 or hybrid Qwen3.5/3.6 target, by its config.json's model_type."""
    cfg = target_config(json.loads((Path(path) / "config.json").read_text()))
    state = read_safetensors_dir(path)
    hybrid = isinstance(cfg, Qwen35Config)
    if hybrid:
        state = from_hf_state(state)
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):  # no random init: weights arrive by assignment
        model = (Qwen35ForCausalLM if hybrid else Qwen3ForCausalLM)(cfg)
    _load_into(model, state, device, DTYPES[dtype])
    model.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta).to(device)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def load_drafter(path: str | Path, device: str = "cpu", dtype: str = "float32") -> DFlashDrafter:
    raw = json.loads((Path(path) / "config.json").read_text())
    cfg = DFlashConfig.from_dict(raw)
    # some exports prefix drafter weights with "model."; strip it so both layouts load
    state = {k.removeprefix("model."): v for k, v in read_safetensors_dir(path).items()}
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    _load_into(model, state, device, DTYPES[dtype])
    model.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta).to(device)
    return model.eval().requires_grad_(False)

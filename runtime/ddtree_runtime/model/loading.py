"""Load HF-style checkpoint directories (config.json + *.safetensors) into our modules: 16-bit or
float32 weights, or fine-grained FP8 (model/fp8.py); `quantize="fp8"` turns a 16-bit checkpoint's
projections into FP8 at load. Anything else quantized is refused before a tensor is read
(ddtree_runtime.quantization)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ..limits import QUANTIZE_METHODS
from ..quantization import Fp8Scheme, UnsupportedCheckpoint, check_checkpoint
from .config import DFlashConfig, Qwen35Config, target_config
from .dflash import DFlashDrafter
from .fp8 import FP8, fp8_modules, quantize_linears, skipped
from .layers import Rotary
from .parallel import TensorParallel, local_config, shard_model, shard_state, splits
from .qwen3 import Qwen3ForCausalLM
from .qwen3_5 import Qwen35ForCausalLM, from_hf_state

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointSlice:
    """A checkpoint tensor not read yet: a tensor-parallel rank reads only its shard of it (`narrow`),
    not the whole checkpoint (27B in bf16 is 54 GB of host memory per rank read whole)."""

    def __init__(self, handle) -> None:
        self.handle = handle  # safetensors' slice (it keeps its file open)
        self.shape = torch.Size(handle.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.handle[(slice(None),) * dim + (slice(start, start + length),)]

    def whole(self) -> torch.Tensor:
        return self.handle[:]


def read_safetensors_dir(path: str | Path, lazy: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of every *.safetensors file in a directory (handles sharded checkpoints); those whose
    key `lazy(key)` is true as CheckpointSlice, read later where they are cut."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if lazy is None:
            state.update(load_file(str(f)))
            continue
        handle = safe_open(str(f), "pt")
        for key in handle.keys():
            state[key] = CheckpointSlice(handle.get_slice(key)) if lazy(key) else handle.get_tensor(key)
    return state


def _load_into(module: nn.Module, state: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> None:
    """Assign the state dict: floating weights in `dtype`, FP8 weights as they are with float32 scales."""
    wanted = {k: v.dtype for k, v in module.state_dict().items()}
    for key, value in state.items():
        if value.dtype == FP8 and wanted.get(key, FP8) != FP8:
            raise UnsupportedCheckpoint(f"checkpoint tensor {key} is fp8, but only linear projections are "
                                        f"served in fp8 (not the embeddings, the LM head or a norm)")
    state = {k: v.to(device=device, dtype=_dtype_for(k, wanted[k], dtype)) for k, v in state.items() if k in wanted}
    missing = set(wanted) - set(state)
    if missing:
        raise KeyError(f"checkpoint lacks {sorted(missing)[:5]} (+{max(0, len(missing) - 5)} more)")
    module.load_state_dict(state, strict=True, assign=True)


def _dtype_for(key: str, wanted: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    if wanted == FP8:
        return FP8
    return torch.float32 if key.endswith(".weight_scale_inv") else dtype


def _build(model_cls, cfg, state: dict[str, torch.Tensor], scheme: Fp8Scheme | None, path: str | Path,
           dtype: torch.dtype, tp: TensorParallel | None = None) -> nn.Module:
    """The model on the meta device (no random init: weights arrive by assignment), with an FP8Linear
    wherever an FP8 checkpoint holds e4m3 weights; with `tp`, one rank's shard (cfg: its local_config)."""
    with torch.device("meta"):
        model = model_cls(cfg)
        if tp is not None:
            shard_model(model, tp)
        if scheme is not None:
            for name in fp8_modules(model, state, dtype):
                if skipped(name, scheme.skip):
                    raise UnsupportedCheckpoint(f"{path}: {name} holds fp8 weights, but the checkpoint's "
                                                f"modules_to_not_convert says it is not quantized")
    return model


def _checked(path: str | Path, quantize: str) -> Fp8Scheme | None:
    if quantize not in QUANTIZE_METHODS:
        raise ValueError(f"quantize {quantize!r}: expected one of {', '.join(QUANTIZE_METHODS)}")
    return check_checkpoint(path)


def load_target(path: str | Path, device: str = "cpu", dtype: str = "float32",
                quantize: str = "none", tp: TensorParallel | None = None) -> Qwen3ForCausalLM:
    """A Qwen3 or hybrid Qwen3.5/3.6 target, by its config.json's model_type. quantize="fp8": its
    projections in FP8 blocks (an FP8 checkpoint is FP8 already); the LM head and embeddings stay.
    tp: this rank's shard of it (model/parallel.py), cut from the full checkpoint; ValueError when the
    target does not split over tp.world ranks."""
    scheme = _checked(path, quantize)
    cfg = target_config(json.loads((Path(path) / "config.json").read_text()))
    state = read_safetensors_dir(path, None if tp is None else splits)
    hybrid = isinstance(cfg, Qwen35Config)
    if hybrid:
        state = from_hf_state(state)
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    if tp is not None:
        full, cfg = cfg, local_config(cfg, tp.world)  # refuses a target that does not split
        state = shard_state(state, full, tp)
    model = _build(Qwen35ForCausalLM if hybrid else Qwen3ForCausalLM, cfg, state, scheme, path, DTYPES[dtype], tp)
    _load_into(model, state, device, DTYPES[dtype])
    model.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta).to(device)
    if tp is None:  # a shard's head holds only its rows of the (tied) embeddings
        model.tie_weights()
    if quantize == "fp8" and scheme is None:
        quantize_linears(model)
    return model.eval().requires_grad_(False)


def load_drafter(path: str | Path, device: str = "cpu", dtype: str = "float32",
                 quantize: str = "none") -> DFlashDrafter:
    """A DFlash drafter; quantize="fp8" as for load_target (the engine keeps drafters in 16 bits unless asked)."""
    scheme = _checked(path, quantize)
    raw = json.loads((Path(path) / "config.json").read_text())
    cfg = DFlashConfig.from_dict(raw)
    # some exports prefix drafter weights with "model."; strip it so both layouts load
    state = {k.removeprefix("model."): v for k, v in read_safetensors_dir(path).items()}
    model = _build(DFlashDrafter, cfg, state, scheme, path, DTYPES[dtype])
    _load_into(model, state, device, DTYPES[dtype])
    model.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta).to(device)
    if quantize == "fp8" and scheme is None:
        quantize_linears(model)
    return model.eval().requires_grad_(False)

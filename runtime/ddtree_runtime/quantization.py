"""What a checkpoint's quantization is, read from its config.json and its safetensors headers, without
torch: the server checks a model directory with it before anything loads (one line and exit 2 for a
checkpoint it would serve wrongly), and the loader checks the same before it reads a tensor.

The one quantized layout implemented is the fine-grained FP8 of transformers, vLLM and SGLang:
`quantization_config: {quant_method: fp8, weight_block_size: [128, 128], activation_scheme: dynamic}`,
e4m3 weights and one float32 `weight_scale_inv` per 128x128 block (W = W_fp8 * scale_inv). Everything
else that is quantized (AWQ, GPTQ, compressed-tensors, bitsandbytes, per-tensor or static FP8, integer
or e5m2 tensors) is refused by name, never served as if its codes were weights."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .limits import FP8_CHECKPOINT

# safetensors dtype names the loader turns into weights as they are
PLAIN_DTYPES = frozenset({"BF16", "F16", "F32"})
FP8_DTYPE = "F8_E4M3"
# checkpoints written by the other FP8 tools name the format; anything but e4m3 is refused
FP8_FORMATS = (None, "e4m3", "float8_e4m3fn")


class UnsupportedCheckpoint(ValueError):
    """A checkpoint this runtime does not implement; the message is one line naming what and where."""


@dataclass(frozen=True)
class Fp8Scheme:
    """Fine-grained FP8: weights in 128x128 blocks, activations quantized per token in groups of 128.
    `skip`: module names (or name suffixes) left unquantized, as the checkpoint's modules_to_not_convert
    says; the LM head and the embeddings are never quantized."""
    skip: tuple[str, ...] = ()


def quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """A config.json's quantization_config: at the top, or under text_config (multimodal releases)."""
    return config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")


def scheme_of(config: dict[str, Any], where: str) -> Fp8Scheme | None:
    """The scheme a config.json declares (None: not quantized); UnsupportedCheckpoint otherwise."""
    qc = quantization_config(config)
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != FP8_CHECKPOINT["quant_method"]:
        raise UnsupportedCheckpoint(f"{where}: quantization {method!r} is not implemented (only fine-grained "
                                    f"fp8 is: quant_method fp8, weight_block_size [128, 128], dynamic activations)")
    block = qc.get("weight_block_size")
    if block is None or list(block) != FP8_CHECKPOINT["weight_block_size"]:
        kind = "per-tensor scales" if block is None else f"weight_block_size {list(block)}"
        raise UnsupportedCheckpoint(f"{where}: fp8 with {kind} is not implemented (only 128x128 weight blocks)")
    if qc.get("activation_scheme", "dynamic") != FP8_CHECKPOINT["activation_scheme"]:
        raise UnsupportedCheckpoint(f"{where}: fp8 with activation_scheme {qc['activation_scheme']!r} is not "
                                    f"implemented (only dynamic, per-token activation scales)")
    if qc.get("fmt") not in FP8_FORMATS:
        raise UnsupportedCheckpoint(f"{where}: fp8 format {qc['fmt']!r} is not implemented (only e4m3)")
    return Fp8Scheme(skip=tuple(qc.get("modules_to_not_convert") or ()))


def tensor_dtypes(model_dir: Path) -> dict[str, str]:
    """Each tensor's safetensors dtype name, from the files' JSON headers (no tensor is read)."""
    dtypes: dict[str, str] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < size <= path.stat().st_size - 8:  # what a safetensors file starts with: its header's length
                raise ValueError(f"{path.name} is not a safetensors file (its header length is {size})")
            header = json.loads(f.read(size))
        if not isinstance(header, dict) or not all(isinstance(m, dict) and "dtype" in m
                                                   for n, m in header.items() if n != "__metadata__"):
            raise ValueError(f"{path.name} is not a safetensors file (its header lists no tensors)")
        dtypes.update({name: meta["dtype"] for name, meta in header.items() if name != "__metadata__"})
    return dtypes


def check_checkpoint(model_dir: str | Path) -> Fp8Scheme | None:
    """The scheme of a model directory, checked against its tensors: what config.json declares must be
    what the tensors hold. UnsupportedCheckpoint (one line) for anything this runtime would get wrong."""
    model_dir = Path(model_dir)
    where = str(model_dir)
    scheme = scheme_of(json.loads((model_dir / "config.json").read_text()), where)
    dtypes = tensor_dtypes(model_dir)
    allowed = PLAIN_DTYPES | ({FP8_DTYPE} if scheme else set())
    for name, dtype in sorted(dtypes.items()):
        if dtype not in allowed:
            hint = ("fp8 weights, but config.json declares no fine-grained fp8 quantization_config"
                    if dtype == FP8_DTYPE else "a quantized checkpoint this runtime does not implement")
            raise UnsupportedCheckpoint(f"{where}: tensor {name} has dtype {dtype} ({hint})")
    if scheme:
        for name, dtype in dtypes.items():
            if dtype == FP8_DTYPE and not name.endswith(".weight"):
                raise UnsupportedCheckpoint(f"{where}: fp8 tensor {name} is not a linear weight")
            if dtype == FP8_DTYPE and name.removesuffix("weight") + "weight_scale_inv" not in dtypes:
                raise UnsupportedCheckpoint(f"{where}: fp8 weight {name} has no weight_scale_inv (its block scales)")
    return scheme

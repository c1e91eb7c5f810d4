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
import math
import struct
from array import array
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


def quantization_config(config: dict[str, Any], where: str) -> dict[str, Any] | None:
    """A config.json's quantization_config: at the top, or under text_config (multimodal releases);
    UnsupportedCheckpoint when it is not a JSON object."""
    text = config.get("text_config")
    qc = config.get("quantization_config") or (text.get("quantization_config") if isinstance(text, dict) else None)
    if qc and not isinstance(qc, dict):
        raise UnsupportedCheckpoint(f"{where}: quantization_config is a {type(qc).__name__}, not an object "
                                    f"(expected {{quant_method: fp8, weight_block_size: [128, 128], ...}})")
    return qc or None


def scheme_of(config: dict[str, Any], where: str) -> Fp8Scheme | None:
    """The scheme a config.json declares (None: not quantized); UnsupportedCheckpoint otherwise."""
    qc = quantization_config(config, where)
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


def safetensors_headers(model_dir: Path) -> dict[str, tuple[Path, int, dict[str, Any]]]:
    """Each tensor's header entry (dtype, shape, data_offsets) with its file and where its data starts,
    from the files' JSON headers (no tensor is read)."""
    tensors: dict[str, tuple[Path, int, dict[str, Any]]] = {}
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
        tensors.update({name: (path, 8 + size, meta) for name, meta in header.items() if name != "__metadata__"})
    return tensors


def finite_floats(raw: bytes, dtype: str) -> bool:
    """Whether a safetensors tensor's little-endian float data (F32, BF16 or F16) holds no NaN or Inf."""
    if dtype == "BF16":  # a bfloat16 is the high half of a float32
        wide = bytearray(2 * len(raw))
        wide[2::4], wide[3::4] = raw[0::2], raw[1::2]
        raw = bytes(wide)
    values = struct.unpack(f"<{len(raw) // 2}e", raw) if dtype == "F16" else array("f", raw)
    return all(map(math.isfinite, values))


def _check_scales(where: str, tensors: dict[str, tuple[Path, int, dict[str, Any]]]) -> None:
    """Every FP8 weight's weight_scale_inv: float, 2-D, one per 128x128 block, and finite (a NaN or Inf
    scale would turn the whole block's outputs, and every logit after it, into NaN)."""
    for name, (_, _, meta) in sorted(tensors.items()):
        if meta["dtype"] != FP8_DTYPE:
            continue
        scale = name.removesuffix("weight") + "weight_scale_inv"
        path, start, smeta = tensors[scale]
        if len(meta["shape"]) != 2:
            raise UnsupportedCheckpoint(f"{where}: fp8 weight {name} has shape {meta['shape']}, not [out, in]")
        n, k = meta["shape"]
        want = [-(-n // 128), -(-k // 128)]
        if smeta["dtype"] not in ("F32", "BF16", "F16") or list(smeta["shape"]) != want:
            raise UnsupportedCheckpoint(f"{where}: {scale} is {smeta['dtype']} {list(smeta['shape'])}, expected "
                                        f"float {want} (one scale per 128x128 block of its {n}x{k} weight)")
        lo, hi = smeta["data_offsets"]
        with path.open("rb") as f:
            f.seek(start + lo)
            raw = f.read(hi - lo)
        if len(raw) != hi - lo or not finite_floats(raw, smeta["dtype"]):
            raise UnsupportedCheckpoint(f"{where}: {scale} holds a NaN or Inf (or is cut short); block scales "
                                        f"must be finite: re-export the checkpoint")


def check_checkpoint(model_dir: str | Path) -> Fp8Scheme | None:
    """The scheme of a model directory, checked against its tensors: what config.json declares must be
    what the tensors hold. UnsupportedCheckpoint (one line) for anything this runtime would get wrong."""
    model_dir = Path(model_dir)
    where = str(model_dir)
    scheme = scheme_of(json.loads((model_dir / "config.json").read_text()), where)
    tensors = safetensors_headers(model_dir)
    dtypes = {name: meta["dtype"] for name, (_, _, meta) in tensors.items()}
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
        _check_scales(where, tensors)
    return scheme

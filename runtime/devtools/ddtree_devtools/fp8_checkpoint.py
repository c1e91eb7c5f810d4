"""ddtree-fp8: write a fine-grained FP8 copy of a checkpoint, in exactly the layout Qwen's FP8 releases
use (and transformers, vLLM and SGLang detect): every linear projection's `weight` in e4m3 with its
float32 `weight_scale_inv` (one per 128x128 block, W = W_fp8 * scale_inv), and config.json's
`quantization_config: {quant_method: fp8, weight_block_size: [128, 128], activation_scheme: dynamic}`.
Embeddings, the LM head, norms and convolutions are left as they are; so is what `skip` names (written
as modules_to_not_convert). Tests build tiny FP8 targets and drafters from the committed fixtures with it."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ddtree_runtime.model.fp8 import quantize_blocks, skipped
from ddtree_runtime.model.loading import read_safetensors_dir

NOT_LINEAR = ("embed_tokens", "lm_head")


def fp8_config(skip: tuple[str, ...]) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
            "modules_to_not_convert": list(skip) or None}


def write_fp8_checkpoint(src: str | Path, out: str | Path, skip: tuple[str, ...] = ("lm_head",)) -> Path:
    """Copy the model directory `src` to `out` with its linear projections in FP8; returns `out`."""
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    state = {}
    for key, value in read_safetensors_dir(src).items():
        module = key.removesuffix(".weight")
        if (key.endswith(".weight") and value.dim() == 2 and module.rsplit(".", 1)[-1] not in NOT_LINEAR
                and not skipped(module.removeprefix("model.").removeprefix("language_model."), skip)):
            state[key], state[f"{module}.weight_scale_inv"] = quantize_blocks(value)
        else:
            state[key] = value
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = fp8_config(skip)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="ddtree-fp8", description=__doc__.splitlines()[0])
    p.add_argument("src", help="model directory (16-bit or float32 safetensors)")
    p.add_argument("out", help="where to write the FP8 copy")
    p.add_argument("--skip", nargs="*", default=["lm_head"], metavar="MODULE",
                   help="modules left unquantized, written as modules_to_not_convert (default: lm_head)")
    args = p.parse_args(argv)
    print(write_fp8_checkpoint(args.src, args.out, tuple(args.skip)))


if __name__ == "__main__":
    main()

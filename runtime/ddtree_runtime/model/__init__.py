"""Torch modules: the Qwen3 target and the DFlash drafter, plus checkpoint loading."""

from .config import DFlashConfig, Qwen3Config
from .dflash import DFlashDrafter
from .loading import DTYPES, load_drafter, load_target, read_safetensors_dir
from .qwen3 import Qwen3ForCausalLM

__all__ = ["DFlashConfig", "DFlashDrafter", "DTYPES", "Qwen3Config", "Qwen3ForCausalLM",
           "load_drafter", "load_target", "read_safetensors_dir"]

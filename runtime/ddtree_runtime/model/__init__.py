"""Torch modules: the Qwen3 and hybrid Qwen3.5 targets and the DFlash drafter, plus checkpoint loading."""

from .config import DFlashConfig, Qwen35Config, Qwen3Config, target_config
from .dflash import DFlashDrafter
from .loading import DTYPES, load_drafter, load_target, read_safetensors_dir
from .qwen3 import Qwen3ForCausalLM
from .qwen3_5 import Qwen35ForCausalLM

__all__ = ["DFlashConfig", "DFlashDrafter", "DTYPES", "Qwen35Config", "Qwen35ForCausalLM", "Qwen3Config",
           "Qwen3ForCausalLM", "load_drafter", "load_target", "read_safetensors_dir", "target_config"]

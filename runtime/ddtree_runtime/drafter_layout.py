"""A DFlash drafter's config.json read as z-lab's reference reads it (`dflash==0.1.0`, dflash/model.py, over
transformers' Qwen3Config): each layer's attention, the block, the context layers, and the scalars that
change the computation. Torch-free, so ddops's preflight refuses, with the same one line, a drafter the
runtime's loader (model/config.py) would refuse (ddops reads it as ddops/bundled.py says).

z-lab's precedence, field by field:
- `sliding_window` counts only with `use_sliding_window` (default 4096 when that is set and it is not);
- `layer_types`, else layers from `max_window_layers` (default 28) on are sliding when a window is set;
- a sliding layer is causal inside the block and sees keys at positions (p - window, p] from query
  position p; a full layer sees the whole context and the whole block; `is_causal` (top level), when
  set, makes every layer causal or not (a non-causal sliding layer sees |p - k| < window);
- `block_size`, `mask_token_id`, `target_layer_ids`, `input_embedding_scale`, `output_multiplier`,
  `final_logit_softcapping`: from `dflash_config` first, then the top level (model.py's `_draft_value`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

FULL, SLIDING = "full_attention", "sliding_attention"
# transformers' Qwen3Config defaults, which z-lab's class inherits
DEFAULT_WINDOW = 4096
DEFAULT_MAX_WINDOW_LAYERS = 28
DEFAULT_BLOCK_SIZE = 16
DFLASH2 = "DFlash2DraftModel"


class DraftAttention(NamedTuple):
    """What one draft layer's block queries see: causal inside the block or not, and a window of
    positions back (None: the whole context)."""
    causal: bool
    window: int | None


FULL_ATTENTION = DraftAttention(causal=False, window=None)


@dataclass(frozen=True)
class DrafterLayout:
    attention: tuple[DraftAttention, ...]    # per draft layer
    block_size: int
    mask_token_id: int | None
    target_layer_ids: tuple[int, ...]
    input_embedding_scale: float = 1.0       # the block's target embeddings are scaled by it
    output_multiplier: float = 1.0           # the draft logits are multiplied by it
    final_logit_softcapping: float | None = None  # then softcap * tanh(logits / softcap)


class UnsupportedDrafter(ValueError):
    """A drafter config.json this runtime would serve wrongly: its message is one line naming the field."""


def draft_value(config: dict[str, Any], name: str, default: Any = None) -> Any:
    """A DFlash field: dflash_config's, else the top level's, else the default (z-lab's `_draft_value`)."""
    inner = config.get("dflash_config") or {}
    if name in inner:
        return inner[name]
    return config.get(name, default)


def rope_problem(config: dict[str, Any]) -> str | None:
    """Only default (unscaled, whole-head) RoPE is implemented, for targets and drafters alike."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default"):
        return f"unsupported RoPE scaling {kind!r} (only default RoPE is implemented)"
    return None


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spread layer ids between layer 1 and layer n-3, as DFlash checkpoints without explicit ids assume."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _attention(config: dict[str, Any], n_layers: int) -> tuple[DraftAttention, ...]:
    window = config.get("sliding_window", DEFAULT_WINDOW) if config.get("use_sliding_window") else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise UnsupportedDrafter(f"drafter sliding_window {window!r} is not a positive number of tokens")
    kinds = config.get("layer_types")
    if kinds is None:
        first = config.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
        kinds = [SLIDING if window is not None and i >= first else FULL for i in range(n_layers)]
    if len(kinds) != n_layers or set(kinds) - {FULL, SLIDING}:
        raise UnsupportedDrafter(f"drafter layer_types {kinds} must name its {n_layers} layers, each "
                                 f"{FULL} or {SLIDING}")
    forced = config.get("is_causal")
    return tuple(DraftAttention(causal=kind == SLIDING if forced is None else bool(forced),
                                window=window if kind == SLIDING else None) for kind in kinds)


def drafter_layout(config: dict[str, Any]) -> DrafterLayout:
    """The layout of a DFlash drafter's config.json; UnsupportedDrafter (one line, naming the field and
    what to do) for what the runtime does not serve."""
    if DFLASH2 in (config.get("architectures") or []):
        raise UnsupportedDrafter(f"drafter architecture {DFLASH2} (z-lab's DFlash2: dynamic convolutions and a "
                                 "candidate selector) is not served by the DDTree runtime; use a DFlashDraftModel "
                                 "drafter")
    problem = rope_problem(config)
    if problem:
        raise UnsupportedDrafter(f"drafter: {problem}")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedDrafter(f"drafter hidden_act {act!r} is not implemented (only silu)")
    n_layers = int(config["num_hidden_layers"])
    ids = draft_value(config, "target_layer_ids")
    if ids is None:
        ids = default_target_layer_ids(int(config.get("num_target_layers", 0)), n_layers)
    softcap = draft_value(config, "final_logit_softcapping")
    mask = draft_value(config, "mask_token_id")
    return DrafterLayout(
        attention=_attention(config, n_layers),
        block_size=int(draft_value(config, "block_size", DEFAULT_BLOCK_SIZE)),
        mask_token_id=None if mask is None else int(mask),
        target_layer_ids=tuple(int(i) for i in ids),
        input_embedding_scale=float(draft_value(config, "input_embedding_scale", 1.0)),
        output_multiplier=float(draft_value(config, "output_multiplier", 1.0)),
        final_logit_softcapping=float(softcap) if softcap is not None and float(softcap) > 0 else None,
    )


def drafter_problem(config: dict[str, Any]) -> str | None:
    """drafter_layout's refusal as a line (ddops's preflight), or None when the runtime serves it."""
    try:
        drafter_layout(config)
    except UnsupportedDrafter as e:
        return str(e)
    except KeyError as e:
        return f"drafter config.json has no {e.args[0]}"
    except (TypeError, ValueError) as e:
        return f"drafter config.json is unreadable: {e}"
    return None

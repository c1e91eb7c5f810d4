"""Model configs read from HF-style config.json files (Qwen3 and hybrid Qwen3.5 targets, DFlash drafter)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..drafter_layout import FULL_ATTENTION, DraftAttention, drafter_layout, rope_problem


def _rope_theta(d: dict[str, Any]) -> float:
    # transformers >= 5 moves rope_theta under rope_parameters; older configs keep it flat.
    params = d.get("rope_parameters") or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(d.get("rope_theta", 1_000_000.0))


def _check_supported(d: dict[str, Any]) -> None:
    """Fail loudly on features this compact implementation would otherwise silently get wrong (a
    target's; a drafter's are drafter_layout's)."""
    problem = rope_problem(d)
    if problem:
        raise ValueError(problem)
    if d.get("use_sliding_window") and d.get("sliding_window"):
        raise ValueError("sliding-window attention is not implemented for targets")


@dataclass
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def rotary_dim(self) -> int:
        return self.head_dim

    @property
    def kv_layers(self) -> int:
        """Layers that keep a KV cache (all of them here)."""
        return self.num_hidden_layers

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Qwen3Config":
        _check_supported(d)
        return cls(**_qwen3_fields(d))

    @classmethod
    def from_dir(cls, path: str | Path) -> "Qwen3Config":
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))


def _qwen3_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3 numbers of a config.json, unchecked."""
    return dict(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(d),
        max_position_embeddings=d.get("max_position_embeddings", 40960),
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        attention_bias=d.get("attention_bias", False),
        raw=d,
    )


# model_type -> the target family this runtime implements for it (a checkpoint's own name, not ours)
TARGET_ARCHS = {"qwen3": "qwen3", "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5"}


def target_arch(d: dict[str, Any]) -> str:
    """The family of a target's config.json; ValueError names what is unsupported and what is."""
    kind = d.get("model_type")
    if kind not in TARGET_ARCHS:
        known = ", ".join(sorted(TARGET_ARCHS))
        raise ValueError(f"unsupported target model_type {kind!r} (architectures {d.get('architectures')}); "
                         f"this runtime serves {known}")
    return TARGET_ARCHS[kind]


@dataclass
class Qwen35Config(Qwen3Config):
    """Qwen3.5/3.6 text model: Gated DeltaNet (linear attention) layers with a full-attention layer every
    few, gated attention output, partial RoPE, zero-centred RMSNorm weights."""
    layer_types: list[str] = field(default_factory=list)   # "linear_attention" | "full_attention"
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    partial_rotary_factor: float = 0.25

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == "linear_attention"]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == "full_attention"]

    @property
    def kv_layers(self) -> int:
        return len(self.full_layers)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear layer's causal conv: its q, k and v, concatenated."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def linear_state_bytes(self) -> int:
        """The float32 recurrent state of every linear layer (Hv x dk x dv each)."""
        return (4 * len(self.linear_layers) * self.linear_num_value_heads * self.linear_key_head_dim
                * self.linear_value_head_dim)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Qwen35Config":
        # the released checkpoints are multimodal: the language model's config sits under text_config
        text = {**d.get("text_config", {}), **{k: d[k] for k in ("tie_word_embeddings",) if k in d}} \
            if "text_config" in d else d
        base = Qwen3Config.from_dict(text)
        n = base.num_hidden_layers
        kinds = text.get("layer_types") or [
            "full_attention" if (i + 1) % text.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(n)]
        if len(kinds) != n or set(kinds) - {"linear_attention", "full_attention"}:
            raise ValueError(f"layer_types must name {n} layers, each linear_attention or full_attention")
        rope = text.get("rope_parameters") or {}
        return cls(
            **{k: getattr(base, k) for k in base.__dataclass_fields__},
            layer_types=list(kinds),
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            linear_key_head_dim=text.get("linear_key_head_dim", 128),
            linear_value_head_dim=text.get("linear_value_head_dim", 128),
            linear_num_key_heads=text.get("linear_num_key_heads", 16),
            linear_num_value_heads=text.get("linear_num_value_heads", 32),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 text.get("partial_rotary_factor", 0.25))),
        )


def target_config(d: dict[str, Any]) -> Qwen3Config:
    return {"qwen3": Qwen3Config, "qwen3_5": Qwen35Config}[target_arch(d)].from_dict(d)


@dataclass
class DFlashConfig(Qwen3Config):
    """A DFlash drafter, as drafter_layout reads z-lab's fields (the refusals are its)."""
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: list[int] = field(default_factory=list)
    num_target_layers: int = 0
    attention: tuple[DraftAttention, ...] = ()   # per layer; () reads as every layer full
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def layer_attention(self, layer: int) -> DraftAttention:
        return self.attention[layer] if self.attention else FULL_ATTENTION

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DFlashConfig":
        layout = drafter_layout(d)
        return cls(
            **_qwen3_fields(d),
            block_size=layout.block_size,
            mask_token_id=0 if layout.mask_token_id is None else layout.mask_token_id,
            target_layer_ids=list(layout.target_layer_ids),
            num_target_layers=int(d.get("num_target_layers", 0)),
            attention=layout.attention,
            input_embedding_scale=layout.input_embedding_scale,
            output_multiplier=layout.output_multiplier,
            final_logit_softcapping=layout.final_logit_softcapping,
        )

"""Model facts read from a checkpoint's config.json, normalised across HF config versions.

HF configs spell RoPE two ways: older ones carry ``rope_theta`` and ``rope_scaling`` at the top
level, newer ones a single ``rope_parameters`` dict holding ``rope_theta`` and ``rope_type``.
Both end up in `RopeSpec`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    params: dict[str, Any] = field(default_factory=dict)  # factor, low_freq_factor, ...


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v/o (Llama, Qwen3 style)
    mlp_bias: bool = False
    sliding_window: int | None = None  # only set when the model really uses one

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        try:
            num_heads = int(d["num_attention_heads"])
            hidden_size = int(d["hidden_size"])
            cfg = cls(
                architecture=archs[0],
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(d.get("head_dim") or hidden_size // num_heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                rope=_rope_spec(d),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                sliding_window=_sliding_window(d),
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks the field {e.args[0]!r}") from e
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"num_attention_heads ({cfg.num_heads}) is not a multiple of "
                             f"num_key_value_heads ({cfg.num_kv_heads})")
        return cfg

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError as e:
            raise ValueError(f"{model_dir} has no config.json; is it a HF checkpoint?") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e


def _rope_spec(d: dict[str, Any]) -> RopeSpec:
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    # Old configs name the type "type"; "default" and missing mean unscaled.
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    return RopeSpec(theta=theta, rope_type=rope_type, params=params)


def _sliding_window(d: dict[str, Any]) -> int | None:
    window = d.get("sliding_window")
    if not window:
        return None
    # Qwen2/Qwen3 configs carry a window they only use when use_sliding_window is set.
    if "use_sliding_window" in d and not d["use_sliding_window"]:
        return None
    return int(window)

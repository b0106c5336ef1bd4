"""Model facts read from a checkpoint's config.json, normalised across HF config versions.

HF configs spell RoPE two ways: older ones carry ``rope_theta`` and ``rope_scaling`` at the top
level, newer ones a single ``rope_parameters`` dict holding ``rope_theta`` and ``rope_type``.
Both end up in `RopeSpec`.

Every value Folio uses is checked here (positive integer sizes, heads that divide, booleans that
are booleans), so a damaged config.json ends in one `CheckpointError` naming the file and the
field, never in a tensor of negative size deep inside the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoints.files import CheckpointError, read_json_object


@dataclass(frozen=True)
class RopeSpec:
    """How positions are rotated. For yarn, longrope and dynamic, ``params`` always holds the
    resolved ``original_max_position_embeddings`` (the pretraining context) and ``factor``."""

    theta: float = 10000.0
    # default | linear | llama3 | yarn | longrope | dynamic | freq_factors (from GGUF)
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)  # factor, low_freq_factor, ...

    def max_position(self, max_position_embeddings: int) -> int:
        """The longest context the scaling is meant for, as vLLM derives it: YaRN and dynamic
        NTK configs keep the pretraining value in max_position_embeddings and reach factor
        times the original; LongRoPE (Phi-3) and llama3 configs already state the extended
        length there. Never below max_position_embeddings."""
        match self.rope_type:
            case "yarn":
                scaled = self.params["original_max_position_embeddings"] * self.params["factor"]
            case "dynamic":
                scaled = max_position_embeddings * self.params["factor"]
            case _:
                scaled = max_position_embeddings
        return max(max_position_embeddings, int(scaled))


_REQUIRED = object()


def _int(d: dict[str, Any], key: str, default: Any = _REQUIRED) -> int:
    """A positive JSON integer. Strings and fractions are refused: HF writes sizes as integers,
    and a model built from a silently rounded size would only fail later, on a tensor."""
    value = d.get(key)
    if value is None:  # absent, or null as some configs write head_dim
        value = default
    if value is _REQUIRED:
        raise ValueError(f"lacks the field {key!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value


def _float(d: dict[str, Any], key: str, default: float) -> float:
    """A positive finite JSON number."""
    value = d.get(key)
    if value is None:
        value = default
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or not 0 < value < math.inf):
        raise ValueError(f"{key} must be a positive number, got {value!r}")
    return float(value)


def _bool(d: dict[str, Any], key: str) -> bool:
    value = d.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):  # "false" would be truthy
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


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

    def __post_init__(self) -> None:
        # Relations between sizes; each size alone was checked where it was read.
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even: RoPE rotates pairs")
        if self.rope.rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(self.rope.params[key]) != self.head_dim // 2:
                    raise ValueError(f"rope {key} has {len(self.rope.params[key])} entries; "
                                     f"head_dim {self.head_dim} needs {self.head_dim // 2}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive integer, got "
                             f"{self.sliding_window}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read and check every field Folio uses; ValueError says which one and why."""
        archs = d.get("architectures")
        if not archs:
            raise ValueError("has no 'architectures' entry; cannot pick a model class")
        if not isinstance(archs, list) or not isinstance(archs[0], str):
            raise ValueError(f"architectures must be a list of class names, got {archs!r}")
        num_heads = _int(d, "num_attention_heads")
        hidden_size = _int(d, "hidden_size")
        if d.get("head_dim") is None and hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) is not a multiple of "
                             f"num_attention_heads ({num_heads}) and no head_dim is given")
        return cls(
            architecture=archs[0],
            vocab_size=_int(d, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_int(d, "intermediate_size"),
            num_layers=_int(d, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=_int(d, "num_key_value_heads", num_heads),
            head_dim=_int(d, "head_dim", hidden_size // num_heads),
            rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),
            max_position_embeddings=_int(d, "max_position_embeddings", 2048),
            rope=_rope_spec(d),
            tie_word_embeddings=_bool(d, "tie_word_embeddings"),
            attention_bias=_bool(d, "attention_bias"),
            mlp_bias=_bool(d, "mlp_bias"),
            sliding_window=_sliding_window(d),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise CheckpointError(path, "not found (the directory has no config.json; is it a "
                                        "HF checkpoint?)")
        try:
            return cls.from_dict(read_json_object(path))
        except CheckpointError:
            raise
        except ValueError as e:
            raise CheckpointError(path, str(e)) from None


def _rope_spec(d: dict[str, Any]) -> RopeSpec:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters / rope_scaling must be an object, got {params!r}")
    params = dict(params)
    theta = _float({"rope_theta": params.pop("rope_theta", d.get("rope_theta"))}, "rope_theta",
                   10000.0)
    # Old configs name the type "type"; "default" and missing mean unscaled.
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if not isinstance(rope_type, str):
        raise ValueError(f"rope_type must be a string, got {rope_type!r}")
    if rope_type in ("yarn", "longrope", "dynamic"):
        _resolve_original_context(d, rope_type, params)
    # The numbers the scaled variants divide by (see models/rope.py).
    needed = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"),
              "yarn": ("factor",),
              "dynamic": ("factor",)}.get(rope_type, ())
    for key in needed:
        if key not in params:
            raise ValueError(f"rope type {rope_type!r} needs {key!r}, which is missing")
        _float(params, key, math.nan)
    # Optional numbers: checked when given (null means "use the default", as in HF).
    for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if params.get(key) is not None:
            _float(params, key, math.nan)
    if not isinstance(params.get("truncate", True), bool):
        raise ValueError(f"rope truncate must be true or false, got {params['truncate']!r}")
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            factors = params.get(key)
            if not (isinstance(factors, list) and factors and all(
                    isinstance(f, int | float) and not isinstance(f, bool) and 0 < f < math.inf
                    for f in factors)):
                raise ValueError(f"rope type 'longrope' needs {key!r}, a list of positive "
                                 f"numbers, got {factors!r}")
    if rope_type == "freq_factors":
        # Folio's own type, written by the GGUF converter: one divisor per rotary frequency.
        factors = params.get("freq_factors")
        if not (isinstance(factors, list) and factors and all(
                isinstance(f, int | float) and not isinstance(f, bool) and 0 < f < math.inf
                for f in factors)):
            raise ValueError("rope type 'freq_factors' needs 'freq_factors', a list of "
                             f"positive numbers, got {factors!r}")
    if rope_type == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise ValueError("rope high_freq_factor must be larger than low_freq_factor, got "
                         f"{params['high_freq_factor']} <= {params['low_freq_factor']}")
    return RopeSpec(theta=theta, rope_type=rope_type, params=params)


def _resolve_original_context(d: dict[str, Any], rope_type: str, params: dict[str, Any]) -> None:
    """Fill in the pretraining context and (LongRoPE) the factor as HF does: a top-level
    original_max_position_embeddings (Phi-3 writes it there) wins over the rope dict's, which
    defaults to max_position_embeddings; LongRoPE without a factor takes the ratio. Dynamic NTK
    scales against max_position_embeddings itself, as HF's does."""
    max_pos = _int(d, "max_position_embeddings", 2048)
    if rope_type == "dynamic":
        original = max_pos
    elif d.get("original_max_position_embeddings") is not None:
        original = _int(d, "original_max_position_embeddings")
    else:
        original = _int(params, "original_max_position_embeddings", max_pos)
    params["original_max_position_embeddings"] = original
    if rope_type == "longrope" and params.get("factor") is None:
        params["factor"] = max_pos / original


def _sliding_window(d: dict[str, Any]) -> int | None:
    if not d.get("sliding_window"):
        return None
    # Qwen2/Qwen3 configs carry a window they only use when use_sliding_window is set.
    if "use_sliding_window" in d and not d["use_sliding_window"]:
        return None
    return _int(d, "sliding_window")


def local_kv_heads(cfg: ModelConfig, tp_size: int) -> int:
    """KV heads one tensor-parallel rank holds (and caches): num_kv_heads / tp, or one when
    there are fewer KV heads than ranks (each is then replicated on tp / num_kv_heads ranks)."""
    return max(1, cfg.num_kv_heads // tp_size)


def check_tensor_parallel(cfg: ModelConfig, tp_size: int) -> None:
    """ValueError, with the numbers, when the model cannot be split over `tp_size` ranks."""
    if tp_size == 1:
        return
    flag = f"--tensor-parallel-size {tp_size}"
    if cfg.num_heads % tp_size:
        raise ValueError(f"{flag} does not divide num_attention_heads {cfg.num_heads} "
                         f"({cfg.num_heads} % {tp_size} = {cfg.num_heads % tp_size}); pick a "
                         "size that divides it")
    if cfg.num_kv_heads % tp_size and tp_size % cfg.num_kv_heads:
        raise ValueError(f"{flag}: num_key_value_heads {cfg.num_kv_heads} is neither a "
                         f"multiple of {tp_size} nor a divisor of it, so the KV heads can "
                         "be neither split nor replicated evenly; pick a size that divides "
                         "it or that it divides")
    if cfg.intermediate_size % tp_size:
        raise ValueError(f"{flag} does not divide intermediate_size {cfg.intermediate_size} "
                         f"({cfg.intermediate_size} % {tp_size} = "
                         f"{cfg.intermediate_size % tp_size}); pick a size that divides it")

"""How a checkpoint's config.json says positions are rotated, and the context that implies.

HF configs spell RoPE two ways: older ones carry ``rope_theta`` and ``rope_scaling`` at the top
level, newer ones a single ``rope_parameters`` dict holding ``rope_theta`` and ``rope_type``.
Both end up in `RopeSpec`, checked field by field (a ValueError names the field). The executor
builds its rotary tables from it (executor_svc/models/rope.py); both services take the model's
context from `context_length`, so the scheduler's limit before an executor connects is the one
the executor then reports (before the operator's cap; sliding windows do not cap it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from checkpoints.config_fields import positive_float as _float
from checkpoints.config_fields import positive_int as _int

DEFAULT_MAX_POSITION_EMBEDDINGS = 2048  # what HF assumes when a config leaves it out


@dataclass(frozen=True)
class RopeSpec:
    """How positions are rotated. For yarn, longrope and dynamic, ``params`` always holds the
    resolved ``original_max_position_embeddings`` (the pretraining context) and ``factor``."""

    theta: float = 10000.0
    # default | linear | llama3 | yarn | longrope | dynamic | freq_factors (from GGUF)
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)  # factor, low_freq_factor, ...
    # The share of each head's dimensions rotated (Phi-4-mini: 0.75); the rest pass through.
    # HF rotates int(head_dim * factor) of them and builds every RoPE type's frequencies for
    # that width; the model config turns it into `rotary_dim` (it knows head_dim).
    partial_rotary_factor: float = 1.0

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


LAYER_TYPES = ("full_attention", "sliding_attention")


def rope_spec(d: dict[str, Any], layer_type: str = "full_attention") -> RopeSpec:
    """The RoPE a config (the whole config.json object) states, every field checked.

    Gemma 3's transformers 5 configs key ``rope_parameters`` by layer type (``full_attention``
    and ``sliding_attention``, each a whole RoPE dict); `layer_type` picks one. Other configs
    have one RoPE for every layer. The model's context is always the full-attention one's."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters / rope_scaling must be an object, got {params!r}")
    if params and set(params) <= set(LAYER_TYPES):  # keyed by layer type
        params = params.get(layer_type) or {}
        if not isinstance(params, dict):
            raise ValueError(f"rope_parameters.{layer_type} must be an object, got {params!r}")
    params = dict(params)
    theta = _float({"rope_theta": params.pop("rope_theta", d.get("rope_theta"))}, "rope_theta",
                   10000.0)
    # Old configs name the type "type"; "default" and missing mean unscaled.
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if not isinstance(rope_type, str):
        raise ValueError(f"rope_type must be a string, got {rope_type!r}")
    # Phi-3's older names for LongRoPE, as HF's Phi3Config reads them ("yarn" only with
    # LongRoPE's factor lists, which a real YaRN config never carries).
    if rope_type == "su" or (rope_type == "yarn" and "short_factor" in params
                             and "long_factor" in params):
        rope_type = "longrope"
    # HF's configs carry it in rope_parameters (transformers 5 moves a top-level one there).
    partial = params.pop("partial_rotary_factor", None)
    partial = _float({"partial_rotary_factor": d.get("partial_rotary_factor")
                      if partial is None else partial}, "partial_rotary_factor", 1.0)
    if partial > 1.0:
        raise ValueError(f"partial_rotary_factor must be at most 1 (the whole head), got "
                         f"{partial!r}")
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
    return RopeSpec(theta=theta, rope_type=rope_type, params=params,
                    partial_rotary_factor=partial)


def _resolve_original_context(d: dict[str, Any], rope_type: str, params: dict[str, Any]) -> None:
    """Fill in the pretraining context and (LongRoPE) the factor as HF does: a top-level
    original_max_position_embeddings (Phi-3 writes it there) wins over the rope dict's, which
    defaults to max_position_embeddings; LongRoPE without a factor takes the ratio. Dynamic NTK
    scales against max_position_embeddings itself, as HF's does."""
    max_pos = _int(d, "max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS)
    if rope_type == "dynamic":
        original = max_pos
    elif d.get("original_max_position_embeddings") is not None:
        original = _int(d, "original_max_position_embeddings")
    else:
        original = _int(params, "original_max_position_embeddings", max_pos)
    params["original_max_position_embeddings"] = original
    if rope_type == "longrope" and params.get("factor") is None:
        params["factor"] = max_pos / original


def context_length(config: dict[str, Any]) -> int:
    """The longest context the model is meant for: max_position_embeddings, scaled as its RoPE
    says (`RopeSpec.max_position`)."""
    max_pos = _int(config, "max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS)
    return rope_spec(config).max_position(max_pos)

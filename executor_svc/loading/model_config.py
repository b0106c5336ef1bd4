"""Model facts read from a checkpoint's config.json, normalised across HF config versions.

RoPE is read by `checkpoints.rope` (both services need the context length it implies).

Every value Folio uses is checked here (positive integer sizes, heads that divide, booleans that
are booleans), so a damaged config.json ends in one `CheckpointError` naming the file and the
field, never in a tensor of negative size deep inside the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoints.config_fields import boolean as _bool
from checkpoints.config_fields import positive_float as _float
from checkpoints.config_fields import positive_int as _int
from checkpoints.files import CheckpointError, read_json_object
from checkpoints.rope import DEFAULT_MAX_POSITION_EMBEDDINGS, RopeSpec, rope_spec


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

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window, 0 = full attention."""
        return (self.sliding_window or 0,) * self.num_layers

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
            max_position_embeddings=_int(d, "max_position_embeddings",
                                         DEFAULT_MAX_POSITION_EMBEDDINGS),
            rope=rope_spec(d),
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

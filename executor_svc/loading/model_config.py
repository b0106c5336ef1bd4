"""Model facts read from a checkpoint's config.json, normalised across HF config versions.

RoPE is read by `checkpoints.rope` (both services need the context length it implies).

Sliding windows: `layer_windows` holds one window per decoder layer (0 = full attention). A
query at position p in a layer with window w attends to keys p-w+1..p (HF's
``kv_idx > q_idx - sliding_window``). Each family states its windows its own way (see
`_layer_windows`); all end in this one tuple, and the attention layers honour it, so a window
never caps max_model_len.

Every value Folio uses is checked here (positive integer sizes, heads that divide, booleans that
are booleans), so a damaged config.json ends in one `CheckpointError` naming the file and the
field, never in a tensor of negative size deep inside the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoints.config_fields import boolean as _bool
from checkpoints.config_fields import positive_float as _float
from checkpoints.config_fields import positive_int as _int
from checkpoints.files import CheckpointError, read_json_object
from checkpoints.rope import (
    DEFAULT_MAX_POSITION_EMBEDDINGS,
    LAYER_TYPES,
    RopeSpec,
    context_length,
    rope_spec,
)

# MLP activations: HF's names for SiLU (SwiGLU) and for GELU with the tanh approximation (GeGLU).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")

# What HF's config classes assume when a config.json leaves a field out (a null that is
# written stays null: "no softcap"). Only the Gemma families have defaults that matter.
_GEMMA_DEFAULTS: dict[str, Any] = dict(query_pre_attn_scalar=256, sliding_window=4096,
                                       hidden_activation="gelu_pytorch_tanh",
                                       tie_word_embeddings=True)
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": {**_GEMMA_DEFAULTS, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0},
    "Gemma3ForCausalLM": {**_GEMMA_DEFAULTS, "rope_theta": 1_000_000.0,
                          "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6},
    "GptOssForCausalLM": {"attention_bias": True, "head_dim": 64, "rope_theta": 150_000.0,
                          "sliding_window": 128, "rms_norm_eps": 1e-5,
                          "swiglu_limit": 7.0, "swiglu_alpha": 1.702},
}
# GptOssConfig's RoPE when a config.json states none (neither rope_parameters nor rope_scaling).
_GPT_OSS_ROPE: dict[str, Any] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False,
                                 "original_max_position_embeddings": 4096}


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
    hidden_activation: str = "silu"  # one of ACTIVATIONS
    # One attention window per decoder layer, 0 = full attention; () = all full.
    layer_windows: tuple[int, ...] = ()
    # RoPE of the sliding-window layers when it is not `rope` (Gemma 3's local base).
    local_rope: RopeSpec | None = None
    # tanh capping: scores -> cap * tanh(scores / cap); 0 = none (Gemma 2).
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    # The attention scale is query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # The leading dimensions of each q/k head that RoPE rotates (neox pairs within them), the
    # rest passing through: int(head_dim * rope.partial_rotary_factor). 0: the whole head.
    rotary_dim: int = 0
    # Mixture of experts (`_moe_fields`); num_experts 0: every layer has a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # each expert's intermediate size
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one)
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not one of these (dense MLP)
    # gpt-oss's clamped SwiGLU ("swigluoai", kernels.fused_moe): the clamp and sigmoid gain.
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # gpt-oss's experts stored as MXFP4 blocks and scales (quantization_config.quant_method
    # "mxfp4", as openai ships them), dequantized into the model dtype as they load.
    mxfp4_experts: bool = False
    # The dtype the checkpoint's float weights were saved in (config.json's "dtype", or
    # "torch_dtype" before transformers 5), one of CHECKPOINT_DTYPES; None when unstated.
    checkpoint_dtype: str | None = None

    def __post_init__(self) -> None:
        # Relations between sizes; each size alone was checked where it was read.
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even: RoPE rotates pairs")
        if not self.rotary_dim:  # frozen: the one place the default is filled in
            object.__setattr__(self, "rotary_dim",
                               int(self.head_dim * self.rope.partial_rotary_factor))
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor {self.rope.partial_rotary_factor!r} "
                             f"rotates {self.rotary_dim} of head_dim {self.head_dim}'s "
                             "dimensions: RoPE needs an even, non-zero number of them")
        if self.rope.rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(self.rope.params[key]) != self.rotary_dim // 2:
                    partial = ("" if self.rotary_dim == self.head_dim else
                               f" (partial_rotary_factor {self.rope.partial_rotary_factor!r}"
                               f" rotates {self.rotary_dim} of its dimensions)")
                    raise ValueError(f"rope {key} has {len(self.rope.params[key])} entries; "
                                     f"head_dim {self.head_dim}{partial} needs "
                                     f"{self.rotary_dim // 2}")
        if not self.layer_windows:  # frozen: the one place the default is filled in
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for "
                             f"{self.num_layers} layers")
        context = self.rope.max_position(self.max_position_embeddings)
        for window in self.layer_windows:
            if window < 0:
                raise ValueError(f"sliding_window must be a positive integer, got {window}")
            if window > context:
                raise ValueError(f"sliding_window ({window}) is larger than the model's "
                                 f"context ({context}, from max_position_embeddings and its "
                                 "RoPE scaling)")
        if self.hidden_activation not in ACTIVATIONS:
            raise ValueError(f"hidden_activation {self.hidden_activation!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` has a sparse MoE block (else a dense MLP of
        intermediate_size), as HF's Qwen2-MoE/Qwen3-MoE decide it (Mixtral: every layer)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def with_num_layers(self, num_layers: int) -> ModelConfig:
        """The first `num_layers` decoder layers (a draft model cut from this one)."""
        return dataclasses.replace(self, num_layers=num_layers,
                                   layer_windows=self.layer_windows[:num_layers])

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read and check every field Folio uses; ValueError says which one and why."""
        archs = d.get("architectures")
        if not archs:
            raise ValueError("has no 'architectures' entry; cannot pick a model class")
        if not isinstance(archs, list) or not isinstance(archs[0], str):
            raise ValueError(f"architectures must be a list of class names, got {archs!r}")
        d = {**_FAMILY_DEFAULTS.get(archs[0], {}), **d}  # a written null stays null
        if (archs[0] == "GptOssForCausalLM" and d.get("rope_parameters") is None
                and d.get("rope_scaling") is None):
            d["rope_parameters"] = dict(_GPT_OSS_ROPE)
        if _bool(d, "use_bidirectional_attention"):  # Gemma-based embedding models
            raise ValueError("use_bidirectional_attention is set: Folio serves causal "
                             "decoders only")
        num_layers = _int(d, "num_hidden_layers")
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
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=_int(d, "num_key_value_heads", num_heads),
            head_dim=_int(d, "head_dim", hidden_size // num_heads),
            rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),
            max_position_embeddings=_int(d, "max_position_embeddings",
                                         DEFAULT_MAX_POSITION_EMBEDDINGS),
            rope=rope_spec(d),
            tie_word_embeddings=_bool(d, "tie_word_embeddings"),
            attention_bias=_attention_bias(d, archs[0]),
            mlp_bias=_bool(d, "mlp_bias"),
            hidden_activation=_activation(d),
            layer_windows=_layer_windows(d, archs[0], num_layers),
            local_rope=_local_rope(d, archs[0]),
            attn_logit_softcapping=_softcap(d, "attn_logit_softcapping"),
            final_logit_softcapping=_softcap(d, "final_logit_softcapping"),
            query_pre_attn_scalar=(None if d.get("query_pre_attn_scalar") is None
                                   else _float(d, "query_pre_attn_scalar", 0.0)),
            mxfp4_experts=_mxfp4_experts(d, archs[0]),
            checkpoint_dtype=_checkpoint_dtype(d),
            **_moe_fields(d, archs[0], num_layers),
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


def _checkpoint_dtype(d: dict[str, Any]) -> str | None:
    """config.json's weight dtype; "auto" or a name Folio does not load as such counts as
    unstated (it decides nothing but `--dtype auto`'s choice)."""
    value = d.get("dtype") if d.get("dtype") is not None else d.get("torch_dtype")
    return value if value in CHECKPOINT_DTYPES else None


def _attention_bias(d: dict[str, Any], arch: str) -> bool:
    """attention_bias; Qwen2-MoE states its q/k/v biases as qkv_bias (HF's default: true),
    and never has one on o_proj (models/qwen2_moe.py)."""
    if arch == "Qwen2MoeForCausalLM":
        return True if d.get("qkv_bias") is None else _bool(d, "qkv_bias")
    return _bool(d, "attention_bias")


def _activation(d: dict[str, Any]) -> str:
    # Gemma 2/3 name it hidden_activation; Llama-style configs hidden_act.
    key = "hidden_activation" if d.get("hidden_activation") is not None else "hidden_act"
    value = d.get(key) or "silu"
    if value not in ACTIVATIONS:
        raise ValueError(f"{key} {value!r} is not supported (supported: "
                         f"{', '.join(ACTIVATIONS)})")
    return value


def _layer_windows(d: dict[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    """One window per layer (0 = full attention), as transformers 5.24 reads each family:

    - Mistral: ``sliding_window`` on every layer (layer_types, if any, is ignored as HF does).
    - Qwen2/Qwen3: only with ``use_sliding_window``; then ``layer_types`` or, without it, the
      layers from ``max_window_layers`` on slide.
    - Gemma 2, gpt-oss: ``layer_types`` or alternation, even layers sliding (0, 2, ...).
    - Gemma 3: ``layer_types`` or ``sliding_window_pattern`` (every pattern-th layer full).
    - Llama: none (HF's Llama reads neither field; a GGUF-converted Mistral is a Llama).
    - Phi-3: ``sliding_window`` on every layer, except that a window past the context (the
      128k configs state 262144 over 131072 positions) is full attention, as HF's mask makes it.
    - any other: ``layer_types`` if given, else ``sliding_window`` on every layer.
    """
    if arch == "LlamaForCausalLM":
        return (0,) * num_layers
    window = d.get("sliding_window")
    if arch == "Phi3ForCausalLM" and isinstance(window, int) and window >= context_length(d):
        window = None
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM") and _bool(d, "use_sliding_window"):
        raise ValueError("use_sliding_window is set: Folio serves the Qwen MoE families with "
                         "full attention only")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
                "Qwen3MoeForCausalLM") and not _bool(d, "use_sliding_window"):
        window = None  # HF drops the window when use_sliding_window is off
    types = d.get("layer_types")
    if arch == "MistralForCausalLM":
        types = None
    if types is not None:
        if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
            bad = types if not isinstance(types, list) else next(
                t for t in types if t not in LAYER_TYPES)
            raise ValueError(f"layer_types has an unknown entry {bad!r} (known: "
                             f"{', '.join(LAYER_TYPES)})")
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries; num_hidden_layers is "
                             f"{num_layers}")
        sliding = [t == "sliding_attention" for t in types]
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = d.get("max_window_layers", 28)  # 0: every layer slides
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ValueError(f"max_window_layers must be a non-negative integer, got {first!r}")
        sliding = [i >= first for i in range(num_layers)]
    elif arch in ("Gemma2ForCausalLM", "GptOssForCausalLM"):
        sliding = [i % 2 == 0 for i in range(num_layers)]
    elif arch == "Gemma3ForCausalLM":
        pattern = _int(d, "sliding_window_pattern", 6)
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    else:
        sliding = [True] * num_layers
    if window is None or not any(sliding):
        return (0,) * num_layers
    size = _int(d, "sliding_window")  # names the field when not a positive integer
    return tuple(size if s else 0 for s in sliding)


# Mixture-of-experts families: Mixtral names its expert count num_local_experts, the Qwen MoE
# families num_experts (transformers 5 may write either for Qwen3-MoE).
MOE_ARCHS = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
             "GptOssForCausalLM")
# The routers Folio implements: softmax over every expert's logit, then greedy top-k. A config
# that states another scoring or selection (DeepSeek's sigmoid, grouped top-k) is refused.
_ROUTER_FIELDS = {"scoring_func": ("softmax",), "topk_method": ("greedy",),
                  "router_type": ("softmax", "topk")}


def _mxfp4_experts(d: dict[str, Any], arch: str) -> bool:
    """Whether config.json declares MXFP4 experts, which only gpt-oss has (transformers'
    MXFP4 integration converts GptOssExperts alone). The scheme's other fields are
    checkpoints/quant_config.py's."""
    qc = d.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "mxfp4":
        return False
    if arch != "GptOssForCausalLM":
        raise ValueError(f"quantization_config.quant_method 'mxfp4' is gpt-oss's expert "
                         f"format; {arch} has no MXFP4 weights Folio can load")
    return True


def _moe_fields(d: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """The MoE fields of `ModelConfig` (none for a dense family), each checked.
    router_aux_loss_coef, output_router_logits and router_jitter_noise only matter in
    training and are ignored."""
    if arch not in MOE_ARCHS:
        return {}
    for key, known in _ROUTER_FIELDS.items():
        if d.get(key) is not None and d[key] not in known:
            raise ValueError(f"{key} {d[key]!r} is not supported (supported: "
                             f"{', '.join(known)}): Folio routes with a softmax over the "
                             "experts and a greedy top-k")
    counts = {key: _int(d, key) for key in ("num_experts", "num_local_experts")
              if d.get(key) is not None}
    if not counts:
        raise ValueError("lacks the field 'num_local_experts'"
                         if arch in ("MixtralForCausalLM", "GptOssForCausalLM")
                         else "lacks the field 'num_experts'")
    if len(set(counts.values())) > 1:
        raise ValueError(f"num_experts ({counts['num_experts']}) and num_local_experts "
                         f"({counts['num_local_experts']}) disagree")
    num_experts = next(iter(counts.values()))
    top_k = _int(d, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) is larger than the number of experts "
                         f"({num_experts})")
    if arch == "MixtralForCausalLM":  # experts of intermediate_size; always renormalised
        return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=_int(d, "intermediate_size"), norm_topk_prob=True)
    if arch == "GptOssForCausalLM":  # experts of intermediate_size; softmax over the top k
        return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=_int(d, "intermediate_size"), norm_topk_prob=True,
                    swiglu_limit=_float(d, "swiglu_limit", 7.0),
                    swiglu_alpha=_float(d, "swiglu_alpha", 1.702))
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(
            not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers
            for i in only):
        raise ValueError(f"mlp_only_layers must be a list of layer indices in "
                         f"[0, {num_layers}), got {only!r}")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=_int(d, "moe_intermediate_size"),
        shared_expert_intermediate_size=(_int(d, "shared_expert_intermediate_size")
                                         if arch == "Qwen2MoeForCausalLM" else 0),
        norm_topk_prob=_bool(d, "norm_topk_prob"),
        decoder_sparse_step=_int(d, "decoder_sparse_step", 1),
        mlp_only_layers=tuple(sorted(set(only))),
    )


def _softcap(d: dict[str, Any], key: str) -> float:
    """A tanh cap: a positive number, or 0.0 for none (absent or null)."""
    return 0.0 if d.get(key) is None else _float(d, key, 0.0)


def _local_rope(d: dict[str, Any], arch: str) -> RopeSpec | None:
    """Gemma 3's sliding layers rotate with their own unscaled base: ``rope_local_base_freq``
    in older configs, ``rope_parameters.sliding_attention`` in transformers 5 ones."""
    if arch != "Gemma3ForCausalLM":
        return None
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "sliding_attention" in params:
        return rope_spec(d, "sliding_attention")
    theta = _float(d, "rope_local_base_freq", 10_000.0)
    return RopeSpec(theta=theta)


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
    for key, size in (("moe_intermediate_size", cfg.moe_intermediate_size),
                      ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)):
        if size % tp_size:
            raise ValueError(f"{flag} does not divide {key} {size} ({size} % {tp_size} = "
                             f"{size % tp_size}); pick a size that divides it")

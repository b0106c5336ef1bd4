"""config.json and generation_config.json from a GGUF file's metadata.

llama.cpp writes an HF config's numbers under `<arch>.<key>` names; this maps them back for the
architectures Folio serves. Where transformers' own GGUF reader guesses, this reads what the file
states instead:
- head_dim: `<arch>.attention.key_length` when present (transformers ignores it for qwen3 and
  falls back to the config class's default of 128);
- llama3-style RoPE scaling: llama.cpp stores it as a `rope_freqs` tensor of per-frequency
  divisors, not as metadata, and transformers drops that tensor; here it becomes Folio's
  `freq_factors` rope type, which divides each inverse frequency by its factor exactly as
  llama.cpp does;
- YaRN: `<arch>.rope.scaling.*` (factor, original_context_length, yarn_beta_fast/slow) become
  HF's yarn rope parameters; llama.cpp's attention-factor keys, which multiply the scale where
  HF's attention_factor replaces it, are refused by name;
- a llama-architecture file whose name says "mistral" stays a Llama model (transformers makes it
  a Mistral one with a 4096-token sliding window the file does not state);
- Phi-3: LongRoPE's factors are the `rope_factors_long` / `rope_factors_short` tensors (read into
  rope_parameters, with `phi3.rope.scaling.original_context_length` as the top-level
  original_max_position_embeddings HF's Phi3Config reads); its attention factor must be the one
  HF derives from the two context lengths (a different one becomes attention_factor);
- Gemma 2 and 3: the soft-capping values, the sliding window, the layer pattern and the RoPE
  bases of the two kinds of layer; what the file does not state takes the default llama.cpp
  and HF share for the family (each named where it is used);
- mixture of experts (qwen2moe, qwen3moe, and a llama file with `llama.expert_count` > 0,
  which is Mixtral): the expert sizes `expert_feed_forward_length` /
  `expert_shared_feed_forward_length` (transformers ignores both and takes the config class's
  defaults), absent ones as llama.cpp sizes them; `norm_topk_prob` as llama.cpp's graph for
  the architecture fixes it (`_moe_fields`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from checkpoints.files import CheckpointError
from checkpoints.gguf.reader import Metadata

# GGUF `general.architecture` -> (HF class, HF model_type). Mistral files say "llama".
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),  # the text model of a Gemma 3 file
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
MIXTRAL = ("MixtralForCausalLM", "mixtral")  # a llama file with experts
GEMMA = ("gemma2", "gemma3")
MOE = ("llama", "qwen2moe", "qwen3moe")  # architectures whose files may hold experts
# Whether llama.cpp renormalises the top-k router weights (build_moe_ffn's norm_w): fixed by
# its graph for each architecture, never read from the file. HF's Mixtral always does.
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}
# Tensors read into config.json, not weights: llama3 scaling's divisors, Phi-3's LongRoPE.
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

# Metadata that changes the model's math in ways Folio's Llama/Qwen code does not implement.
# Each is refused rather than silently ignored.
_UNSUPPORTED_KEYS = {
    "expert_count": "mixture-of-experts layers",
    "logit_scale": "scaled output logits",
    "embedding_scale": "scaled embeddings",
    "residual_scale": "scaled residuals",
    "attention.scale": "a non-default attention scale",
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
    # Routers other than a softmax over every expert's logit and a plain top k.
    "expert_gating_func": "expert gating functions other than softmax (1)",
    "expert_weights_scale": "scaled expert weights",
    "expert_group_count": "grouped expert routing",
}
# ... except where the family's HF config has the field (read in _gemma_fields, _moe_fields).
_FAMILY_KEYS = {**{arch: ("attn_logit_softcapping", "final_logit_softcapping")
                   for arch in GEMMA},
                **{arch: ("expert_count",) for arch in MOE}}


def architecture(meta: Metadata) -> str:
    arch = meta.str("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(meta.path, f"GGUF architecture {arch!r} is not supported; "
                                         f"supported: {', '.join(sorted(ARCHITECTURES))} "
                                         "(Mistral files use 'llama')")
    return arch


def build_config(meta: Metadata, tensor_names: set[str],
                 config_tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """The HF config.json dict for this file. `config_tensors`: the file's CONFIG_TENSORS
    (`read_config_tensors`): llama.cpp's per-frequency RoPE divisors, Phi-3's LongRoPE
    factors."""
    arch = architecture(meta)
    for key, what in _UNSUPPORTED_KEYS.items():
        if key in _FAMILY_KEYS.get(arch, ()):
            continue
        value = meta.get(f"{arch}.{key}")
        if value not in (None, 0, 0.0, 1.0):
            raise CheckpointError(meta.path, f"metadata {arch}.{key} = {value!r}: {what} "
                                             "are not supported")
    hf_class, model_type = ARCHITECTURES[arch]
    hidden_size = meta.positive_int(f"{arch}.embedding_length")
    num_heads = meta.positive_int(f"{arch}.attention.head_count")
    head_dim = _head_dim(meta, arch, hidden_size, num_heads)
    rope_freqs = config_tensors.get("rope_freqs.weight")
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": _vocab_size(meta, arch),
        "hidden_size": hidden_size,
        "intermediate_size": meta.positive_int(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.positive_int(f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta.positive_int(f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": meta.positive_int(f"{arch}.context_length"),
        "rms_norm_eps": meta.positive_float(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_parameters": _rope_parameters(meta, arch, head_dim, rope_freqs),
        # llama.cpp writes output.weight only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "mlp_bias": False,
        "dtype": "float32",
    }
    if arch not in ("qwen2", "qwen2moe"):  # Qwen2 always has q/k/v biases (and no o bias); its
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names  # config says nothing
    if arch in ("qwen2", "qwen3", "qwen2moe", "qwen3moe"):
        config["use_sliding_window"] = False
    if meta.get(f"{arch}.expert_count"):  # MOE only: refused above for the others
        _moe_fields(meta, arch, config, tensor_names)
    elif arch in ("qwen2moe", "qwen3moe"):
        raise CheckpointError(meta.path, f"metadata {arch}.expert_count is missing; a {arch} "
                                         "file states how many experts each layer holds")
    if arch == "phi3":
        _phi3_fields(meta, config, config_tensors)
    elif arch in GEMMA:
        _gemma_fields(meta, arch, config)
    elif f"{arch}.attention.sliding_window" in meta:
        config["sliding_window"] = meta.positive_int(f"{arch}.attention.sliding_window")
    for name in ("bos", "eos", "pad"):
        key = "padding" if name == "pad" else name
        if (token_id := meta.token_id(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[f"{name}_token_id"] = token_id
    return config


def _moe_fields(meta: Metadata, arch: str, config: dict[str, Any],
                tensor_names: set[str]) -> None:
    """The HF MoE config of a file with experts: Mixtral for llama (experts of
    feed_forward_length, as llama.cpp sizes them for llama), Qwen2-MoE / Qwen3-MoE with
    `expert_feed_forward_length` (absent: feed_forward_length / expert_used_count, llama.cpp's
    default) and Qwen2-MoE's shared expert of `expert_shared_feed_forward_length` (absent:
    feed_forward_length). llama.cpp runs every layer of these files as a MoE layer."""
    num_experts = meta.positive_int(f"{arch}.expert_count")
    top_k = meta.positive_int(f"{arch}.expert_used_count")
    if top_k > num_experts:
        raise CheckpointError(meta.path, f"metadata {arch}.expert_used_count ({top_k}) is "
                                         f"larger than {arch}.expert_count ({num_experts})")
    norm = meta.get(f"{arch}.expert_weights_norm")
    if norm is not None and bool(norm) != _NORM_TOPK[arch]:
        raise CheckpointError(meta.path, f"metadata {arch}.expert_weights_norm = {norm!r}: "
                                         f"llama.cpp runs {arch} files with "
                                         f"{_NORM_TOPK[arch]}, and so does Folio")
    ffn = config["intermediate_size"]
    del config["mlp_bias"]
    if arch == "llama":
        if config.pop("attention_bias"):
            raise CheckpointError(meta.path, "blk.0.attn_q.bias: a llama file with experts "
                                             "(Mixtral) has no attention biases in HF's Mixtral")
        config["architectures"], config["model_type"] = [MIXTRAL[0]], MIXTRAL[1]
        config |= {"num_local_experts": num_experts, "num_experts_per_tok": top_k}
        config.setdefault("sliding_window", None)  # MixtralConfig's: full attention
        return
    config |= {"num_experts": num_experts, "num_experts_per_tok": top_k,
               "moe_intermediate_size": meta.positive_int(
                   f"{arch}.expert_feed_forward_length", max(1, ffn // top_k)),
               "norm_topk_prob": _NORM_TOPK[arch], "decoder_sparse_step": 1,
               "mlp_only_layers": []}
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = meta.positive_int(
            f"{arch}.expert_shared_feed_forward_length", ffn)
        config["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names


def _phi3_fields(meta: Metadata, config: dict[str, Any],
                 config_tensors: dict[str, np.ndarray]) -> None:
    """Phi3Config's own fields: no head_dim, mlp_bias or attention_bias (hidden / heads, and
    never a bias), the original context at the top level, LongRoPE from the factor tensors,
    a sliding window only when one is stated (llama.cpp writes 0 for none)."""
    if config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
        raise CheckpointError(meta.path, f"phi3.attention.key_length ({config['head_dim']}) "
                                         "is not embedding_length / head_count, which Phi-3 "
                                         "assumes")
    for key in ("head_dim", "mlp_bias", "attention_bias"):
        del config[key]
    if config["rope_parameters"]["rope_type"] != "default":
        raise CheckpointError(meta.path, "Phi-3 files state LongRoPE as rope_factors_* tensors; "
                                         "other RoPE scaling metadata is not supported")
    # Absent: Phi3Config's default (4096), as HF would assume.
    original = meta.positive_int("phi3.rope.scaling.original_context_length", 4096)
    config["original_max_position_embeddings"] = original
    window = meta.get("phi3.attention.sliding_window")
    if window:
        config["sliding_window"] = meta.positive_int("phi3.attention.sliding_window")
    # Phi-4-mini rotates part of each head: rope.dimension_count of hidden / heads.
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary_dim = meta.positive_int("phi3.rope.dimension_count", head_dim)
    if rotary_dim > head_dim or rotary_dim % 2:
        raise CheckpointError(meta.path, f"phi3.rope.dimension_count ({rotary_dim}) must be an "
                                         f"even number of a head's {head_dim} dimensions")
    partial = {} if rotary_dim == head_dim else {"partial_rotary_factor": rotary_dim / head_dim}
    config["rope_parameters"].update(partial)
    long, short = (config_tensors.get(f"rope_factors_{k}.weight") for k in ("long", "short"))
    if long is None and short is None:
        return
    half = rotary_dim // 2
    factors = {}
    for kind, values in (("long", long), ("short", short)):
        values = None if values is None else np.asarray(values, dtype=np.float32).reshape(-1)
        if values is None or values.shape != (half,) or not np.all(np.isfinite(values)
                                                                   & (values > 0)):
            raise CheckpointError(meta.path, f"tensor rope_factors_{kind}.weight must hold "
                                             f"{half} positive factors (one per rotary "
                                             "frequency) next to its long/short twin")
        factors[f"{kind}_factor"] = [float(f) for f in values]
    rope = {"rope_type": "longrope", "rope_theta": config["rope_parameters"]["rope_theta"],
            **factors, **partial}
    # llama.cpp's attn_factor multiplies cos and sin as HF's LongRoPE attention factor does;
    # HF derives it from the two context lengths, so only a different value is written.
    scale = config["max_position_embeddings"] / original
    derived = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))
    stated = meta.get("phi3.rope.scaling.attn_factor")
    if stated is not None and not math.isclose(float(stated), derived, rel_tol=1e-6):
        rope["attention_factor"] = meta.positive_float("phi3.rope.scaling.attn_factor")
    config["rope_parameters"] = rope


def _layer_types(meta: Metadata, arch: str, num_layers: int) -> list[str]:
    """Which layers slide: `<arch>.attention.sliding_window_pattern` when stated (a period n:
    every n-th layer is global; or one boolean per layer, true where it slides), else the
    family's period, which llama.cpp and HF both fix: 2 for Gemma 2, 6 for Gemma 3."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != num_layers or not all(isinstance(p, bool) for p in pattern):
            raise CheckpointError(meta.path, f"metadata {arch}.attention.sliding_window_pattern "
                                             f"must hold {num_layers} booleans, one per layer")
        slides = list(pattern)
    else:
        period = {"gemma2": 2, "gemma3": 6}[arch] if pattern is None else meta.positive_int(
            f"{arch}.attention.sliding_window_pattern")
        slides = [bool((i + 1) % period) for i in range(num_layers)]
    return ["sliding_attention" if s else "full_attention" for s in slides]


def _gemma_fields(meta: Metadata, arch: str, config: dict[str, Any]) -> None:
    """Gemma2Config's / Gemma3TextConfig's fields. llama.cpp scales queries by
    1/sqrt(head_dim), except for the 27B models (46 layers for Gemma 2, 62 for Gemma 3) by
    1/sqrt(hidden / heads): that is query_pre_attn_scalar, which the file does not store."""
    del config["mlp_bias"]
    # GGUF names no activation: llama.cpp runs Gemma's MLP with tanh-approximated GELU.
    del config["hidden_act"]
    config["hidden_activation"] = "gelu_pytorch_tanh"
    num_layers = config["num_hidden_layers"]
    big = num_layers == {"gemma2": 46, "gemma3": 62}[arch]
    config["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"]
                                       if big else config["head_dim"])
    # Absent: the window llama.cpp and HF both default to (4096).
    config["sliding_window"] = meta.positive_int(f"{arch}.attention.sliding_window", 4096)
    config["layer_types"] = _layer_types(meta, arch, num_layers)
    # Gemma 2 soft-caps; absent keys take the values llama.cpp and HF default to (50, 30).
    # Gemma 3 does not (None) unless the file says so.
    defaults = {"gemma2": (50.0, 30.0), "gemma3": (None, None)}[arch]
    for key, default in zip(("attn_logit_softcapping", "final_logit_softcapping"), defaults,
                            strict=True):
        value = meta.get(f"{arch}.{key}")
        config[key] = default if value is None else meta.positive_float(f"{arch}.{key}")
    if arch == "gemma3":
        # The global layers use the file's base and scaling; the sliding ones their own base
        # (absent: 10000, HF's rope_local_base_freq default and llama.cpp's fixed value),
        # never scaled.
        local = meta.positive_float("gemma3.rope.freq_base_swa", 10000.0)
        config["rope_parameters"] = {
            "full_attention": config["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    elif config["rope_parameters"]["rope_type"] != "default":
        raise CheckpointError(meta.path, "Gemma 2 has no RoPE scaling; the file states "
                                         f"{config['rope_parameters']['rope_type']!r}")


def build_generation_config(meta: Metadata) -> dict[str, Any]:
    """Stop ids: the file's EOS plus its end-of-turn and end-of-message ids, which llama.cpp
    also ends generation on (Llama 3 instruct files name <|eot_id|> there)."""
    stop_ids = sorted({i for key in ("eos", "eot", "eom")
                       if (i := meta.token_id(f"tokenizer.ggml.{key}_token_id")) is not None})
    gen: dict[str, Any] = {}
    if (bos := meta.token_id("tokenizer.ggml.bos_token_id")) is not None:
        gen["bos_token_id"] = bos
    if stop_ids:
        gen["eos_token_id"] = stop_ids if len(stop_ids) > 1 else stop_ids[0]
    if (pad := meta.token_id("tokenizer.ggml.padding_token_id")) is not None:
        gen["pad_token_id"] = pad
    return gen


def _vocab_size(meta: Metadata, arch: str) -> int:
    if f"{arch}.vocab_size" in meta:
        return meta.positive_int(f"{arch}.vocab_size")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(meta.path, f"neither {arch}.vocab_size nor tokenizer.ggml.tokens "
                                         "says how large the vocabulary is")
    return len(tokens)


def _head_dim(meta: Metadata, arch: str, hidden_size: int, num_heads: int) -> int:
    key_length = meta.get(f"{arch}.attention.key_length")
    if key_length is not None:
        head_dim = meta.positive_int(f"{arch}.attention.key_length")
    elif arch == "phi3" and hidden_size % num_heads == 0:
        # Phi-3 has no head_dim; its rope.dimension_count is the rotary part only (Phi-4-mini).
        head_dim = hidden_size // num_heads
    elif f"{arch}.rope.dimension_count" in meta:
        head_dim = meta.positive_int(f"{arch}.rope.dimension_count")
    elif hidden_size % num_heads == 0:
        head_dim = hidden_size // num_heads
    else:
        raise CheckpointError(meta.path, f"{arch}.embedding_length ({hidden_size}) is not a "
                                         f"multiple of {arch}.attention.head_count "
                                         f"({num_heads}) and no key_length is given")
    value_length = meta.positive_int(f"{arch}.attention.value_length", head_dim)
    if value_length != head_dim:
        raise CheckpointError(meta.path, f"{arch}.attention.value_length ({value_length}) "
                                         f"differs from key_length ({head_dim}); not supported")
    rotary_dim = meta.positive_int(f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim and arch != "phi3":  # Phi-4-mini: _phi3_fields states it
        raise CheckpointError(meta.path, f"{arch}.rope.dimension_count ({rotary_dim}) is not "
                                         f"the head size ({head_dim}): partial rotary "
                                         "embeddings are not supported")
    return head_dim


def _rope_parameters(meta: Metadata, arch: str, head_dim: int,
                     rope_freqs: np.ndarray | None) -> dict[str, Any]:
    theta = meta.positive_float(f"{arch}.rope.freq_base", 10000.0)  # llama.cpp's default
    scaling = meta.str(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = meta.positive_float(f"{arch}.rope.scaling.factor")
        params: dict[str, Any] = {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    elif scaling == "yarn":
        params = _yarn_parameters(meta, arch, theta)
    elif scaling == "none":
        params = {"rope_type": "default", "rope_theta": theta}
    else:
        raise CheckpointError(meta.path, f"metadata {arch}.rope.scaling.type = {scaling!r}: "
                                         "only linear and yarn RoPE scaling (or none) are "
                                         "supported")
    if rope_freqs is not None:
        if scaling != "none":
            raise CheckpointError(meta.path, f"both {arch}.rope.scaling.type = {scaling!r} "
                                             "and a rope_freqs tensor: not supported")
        factors = np.asarray(rope_freqs, dtype=np.float32).reshape(-1)
        if factors.shape != (head_dim // 2,) or not np.all(np.isfinite(factors) & (factors > 0)):
            raise CheckpointError(meta.path, f"tensor rope_freqs.weight must hold "
                                             f"{head_dim // 2} positive factors (one per "
                                             f"rotary frequency), got shape {factors.shape}")
        params = {"rope_type": "freq_factors", "rope_theta": theta,
                  "freq_factors": [float(f) for f in factors]}
    return params


# llama.cpp's YaRN knobs whose meaning differs from HF's rope parameters (its attention
# factors multiply the computed scale, HF's attention_factor replaces it): refused, not guessed.
_YARN_UNSUPPORTED = ("attn_factor", "yarn_attn_factor", "yarn_ext_factor", "yarn_log_multiplier")


def _yarn_parameters(meta: Metadata, arch: str, theta: float) -> dict[str, Any]:
    """HF's yarn rope parameters from llama.cpp's keys: the factor, the pretraining context
    (absent: max_position_embeddings, as in HF) and beta_fast/beta_slow where stated."""
    key = f"{arch}.rope.scaling"
    for name in _YARN_UNSUPPORTED:
        if f"{key}.{name}" in meta.values:
            raise CheckpointError(meta.path, f"metadata {key}.{name}: this YaRN setting is not "
                                             "supported (only the factor, the original context "
                                             "length and beta_fast/beta_slow are)")
    params: dict[str, Any] = {"rope_type": "yarn", "rope_theta": theta,
                              "factor": meta.positive_float(f"{key}.factor")}
    if f"{key}.original_context_length" in meta.values:
        params["original_max_position_embeddings"] = meta.positive_int(
            f"{key}.original_context_length")
    for name in ("beta_fast", "beta_slow"):
        if f"{key}.yarn_{name}" in meta.values:
            params[name] = meta.positive_float(f"{key}.yarn_{name}")
    return params


def tensor_names(reader) -> set[str]:
    return {t.name for t in reader.tensors}


def read_config_tensors(path: Path, reader) -> dict[str, np.ndarray]:
    """The file's CONFIG_TENSORS (RoPE factors), float32, by name."""
    import gguf

    found = {}
    for tensor in reader.tensors:
        if tensor.name in CONFIG_TENSORS:
            if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
                raise CheckpointError(path, f"tensor {tensor.name} has type "
                                            f"{tensor.tensor_type.name}; expected F32")
            found[tensor.name] = np.array(tensor.data, dtype=np.float32)
    return found

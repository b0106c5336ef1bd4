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
  a Mistral one with a 4096-token sliding window the file does not state).
"""

from __future__ import annotations

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
}

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
}


def architecture(meta: Metadata) -> str:
    arch = meta.str("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(meta.path, f"GGUF architecture {arch!r} is not supported; "
                                         f"supported: {', '.join(sorted(ARCHITECTURES))} "
                                         "(Mistral files use 'llama')")
    return arch


def build_config(meta: Metadata, tensor_names: set[str],
                 rope_freqs: np.ndarray | None) -> dict[str, Any]:
    """The HF config.json dict for this file. `rope_freqs` is the file's `rope_freqs.weight`
    tensor (llama.cpp's per-frequency RoPE divisors), if it has one."""
    arch = architecture(meta)
    for key, what in _UNSUPPORTED_KEYS.items():
        value = meta.get(f"{arch}.{key}")
        if value not in (None, 0, 0.0, 1.0):
            raise CheckpointError(meta.path, f"metadata {arch}.{key} = {value!r}: {what} "
                                             "are not supported")
    hf_class, model_type = ARCHITECTURES[arch]
    hidden_size = meta.positive_int(f"{arch}.embedding_length")
    num_heads = meta.positive_int(f"{arch}.attention.head_count")
    head_dim = _head_dim(meta, arch, hidden_size, num_heads)
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
    if arch != "qwen2":  # Qwen2 always has q/k/v biases (and no o bias); its config says nothing
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    if f"{arch}.attention.sliding_window" in meta:
        config["sliding_window"] = meta.positive_int(f"{arch}.attention.sliding_window")
    for name in ("bos", "eos", "pad"):
        key = "padding" if name == "pad" else name
        if (token_id := meta.token_id(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[f"{name}_token_id"] = token_id
    return config


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
    if rotary_dim != head_dim:
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


def read_rope_freqs(path: Path, reader) -> np.ndarray | None:
    """The `rope_freqs.weight` tensor as float32, if the file has one."""
    import gguf

    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
                raise CheckpointError(path, f"tensor rope_freqs.weight has type "
                                            f"{tensor.tensor_type.name}; expected F32")
            return np.array(tensor.data, dtype=np.float32)
    return None

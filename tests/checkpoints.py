"""Tiny random Hugging Face checkpoints, one per supported architecture family, for tests.

Each checkpoint is a real directory as a hub download would give: config.json, model.safetensors,
generation_config.json and the default model's tokenizer files, so the server loads it through
the same path as a real model and HF transformers can serve as the oracle on the same files.

The configs differ where the families differ: grouped-query attention everywhere, llama3 rope
scaling, qkv bias (qwen2), q/k RMSNorm with a head_dim that is not hidden/heads (qwen3), tied
and untied embeddings. `initializer_range` is wider than HF's 0.02 so the greedy argmax is not
decided by float noise between two nearly equal logits.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

ARCHS = ("llama2", "llama3", "mistral", "qwen2", "qwen3")
SEED = 0

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    rms_norm_eps=1e-5,
)

_ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama2": dict(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    ),
    "llama3": dict(
        num_hidden_layers=3,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            # Small, so the scaling changes frequencies that short test prompts exercise.
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
    ),
    "mistral": dict(
        head_dim=16,
        sliding_window=None,  # no window: prompts in tests are shorter than any window anyway
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
    ),
    "qwen2": dict(  # Qwen2 always has q/k/v biases
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        num_hidden_layers=3,
        head_dim=32,  # 4 heads x 32 != hidden 64: head_dim must come from the config
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        tie_word_embeddings=False,
    ),
}


def _classes(arch: str):
    import transformers as hf

    return {
        "llama2": (hf.LlamaConfig, hf.LlamaForCausalLM),
        "llama3": (hf.LlamaConfig, hf.LlamaForCausalLM),
        "mistral": (hf.MistralConfig, hf.MistralForCausalLM),
        "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM),
        "qwen3": (hf.Qwen3Config, hf.Qwen3ForCausalLM),
    }[arch]


@functools.cache
def _tokenizer():
    from checkpoints.tiny_random import build_tokenizer

    return build_tokenizer()


def make_checkpoint(arch: str, path: str | Path, **overrides: Any) -> Path:
    """Build a tiny random `arch` checkpoint in `path` (created) and return it.

    `overrides` replace config fields, e.g. `num_hidden_layers=1` or `tie_word_embeddings=True`.
    The same arguments always give the same weights.
    """
    import torch
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    from checkpoints.tiny_random import special_token_ids, write_tokenizer

    if arch not in _ARCH_CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    hf_logging.disable_progress_bar()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    ids = special_token_ids(tok)
    config_cls, model_cls = _classes(arch)
    kwargs = {**_COMMON, **_ARCH_CONFIGS[arch], **overrides}
    config = config_cls(
        vocab_size=tok.get_vocab_size(),
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
        dtype="float32",
        **kwargs,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = model_cls(config).eval()
    model.save_pretrained(out)
    GenerationConfig(
        bos_token_id=ids["bos_token_id"],
        eos_token_id=[ids["eos_token_id"], ids["im_end_id"]],
        pad_token_id=ids["pad_token_id"],
    ).save_pretrained(out)
    write_tokenizer(tok, out)
    return out

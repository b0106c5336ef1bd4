"""`ModelConfig.layer_windows` and the Gemma fields, read from each family's config.json as
transformers 5.24 reads it (HF's config classes are the oracle), and the refusals, each naming
its field."""

from __future__ import annotations

import json

import pytest

from checkpoints.files import CheckpointError
from checkpoints.rope import RopeSpec, context_length
from executor_svc.loading.model_config import ModelConfig

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def _hf_windows(config_cls: str, d: dict) -> tuple[int, ...]:
    """The window each layer of HF's model uses (its attention's `sliding_window`)."""
    import transformers

    config = getattr(transformers, config_cls)(**d)
    if config_cls == "MistralConfig":  # every layer: MistralAttention reads config directly
        return (config.sliding_window or 0,) * config.num_hidden_layers
    return tuple(config.sliding_window if t == "sliding_attention" and config.sliding_window
                 else 0 for t in config.layer_types)


CASES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=3,
                                                            sliding_window=32)),
    "mistral_no_window": ("MistralConfig", "MistralForCausalLM",
                          dict(num_hidden_layers=2, sliding_window=None)),
    "qwen2_max_window_layers": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_hidden_layers=5, use_sliding_window=True, sliding_window=24, max_window_layers=3)),
    "qwen2_all_layers": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_hidden_layers=2, use_sliding_window=True, sliding_window=24, max_window_layers=0)),
    "qwen2_off": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_hidden_layers=4, use_sliding_window=False, sliding_window=24, max_window_layers=1)),
    "qwen3_layer_types": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma2_alternating": ("Gemma2Config", "Gemma2ForCausalLM",
                           dict(num_hidden_layers=5, sliding_window=16)),
    "gemma3_pattern": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                       dict(num_hidden_layers=7, sliding_window=8, sliding_window_pattern=3)),
    "gemma3_default_pattern": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                               dict(num_hidden_layers=13, sliding_window=8)),
    "gemma3_layer_types": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=2, sliding_window=8,
        layer_types=["full_attention", "sliding_attention"])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_windows_are_the_ones_hf_uses(name):
    config_cls, arch, overrides = CASES[name]
    d = {**BASE, **overrides}
    cfg = ModelConfig.from_dict({**d, "architectures": [arch]})
    assert cfg.layer_windows == _hf_windows(config_cls, d)
    assert len(cfg.layer_windows) == cfg.num_layers


def test_gemma_fields_and_hf_defaults():
    g2 = ModelConfig.from_dict({**BASE, "architectures": ["Gemma2ForCausalLM"],
                                "num_hidden_layers": 2, "max_position_embeddings": 8192})
    # Gemma2Config's defaults when config.json leaves the fields out.
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    assert g2.attention_scale == 256 ** -0.5 and g2.hidden_activation == "gelu_pytorch_tanh"
    assert g2.tie_word_embeddings and g2.layer_windows == (4096, 0)
    assert g2.local_rope is None
    # A written null is no cap (Gemma 3's default).
    g3 = ModelConfig.from_dict({**BASE, "architectures": ["Gemma3ForCausalLM"],
                                "num_hidden_layers": 2, "final_logit_softcapping": None,
                                "sliding_window": 8,
                                "query_pre_attn_scalar": 24})
    assert (g3.attn_logit_softcapping, g3.final_logit_softcapping) == (0.0, 0.0)
    assert g3.attention_scale == 24 ** -0.5
    llama = ModelConfig.from_dict({**BASE, "architectures": ["LlamaForCausalLM"],
                                   "num_hidden_layers": 2, "sliding_window": 8})
    assert llama.attention_scale == 16 ** -0.5 and llama.hidden_activation == "silu"
    # HF's Llama ignores a sliding_window (GGUF-converted Mistral files carry one).
    assert llama.layer_windows == (0, 0) and llama.attn_logit_softcapping == 0.0


def test_gemma3_ropes_old_and_new_configs_agree_with_hf():
    """Older configs: rope_theta (+ rope_scaling) for the global layers, rope_local_base_freq
    for the local ones; transformers 5 writes rope_parameters keyed by layer type."""
    import transformers

    old = {**BASE, "num_hidden_layers": 4, "sliding_window": 8, "sliding_window_pattern": 2,
           "rope_theta": 20000.0, "rope_local_base_freq": 500.0,
           "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    new = transformers.Gemma3TextConfig(**old).to_dict()
    assert set(new["rope_parameters"]) == {"full_attention", "sliding_attention"}
    for d in (old, new):
        cfg = ModelConfig.from_dict({**d, "architectures": ["Gemma3ForCausalLM"]})
        assert cfg.rope == RopeSpec(theta=20000.0, rope_type="linear", params={"factor": 2.0})
        assert cfg.local_rope == RopeSpec(theta=500.0)
        assert cfg.layer_windows == (8, 0, 8, 0)
    # Left out: HF's defaults, 1e6 global and 1e4 local.
    bare = ModelConfig.from_dict({**BASE, "num_hidden_layers": 1, "sliding_window": 8,
                                  "architectures": ["Gemma3ForCausalLM"]})
    assert (bare.rope.theta, bare.local_rope.theta) == (1e6, 1e4)


def test_context_of_a_layer_keyed_rope_is_the_global_layers():
    d = {**BASE, "num_hidden_layers": 2, "architectures": ["Gemma3ForCausalLM"],
         "sliding_window": 8, "rope_parameters": {
             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
             "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                "original_max_position_embeddings": 512}}}
    assert context_length(d) == 2048
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope.rope_type == "yarn" and cfg.local_rope == RopeSpec(theta=10000.0)


@pytest.mark.parametrize("arch, overrides, field", [
    ("Gemma2ForCausalLM", dict(layer_types=["sliding_attention", "chunked_attention"]),
     "layer_types"),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8,
                              layer_types="sliding_attention"), "layer_types"),
    ("Gemma3ForCausalLM", dict(layer_types=["full_attention"]), "layer_types"),
    ("MistralForCausalLM", dict(sliding_window=4096), "sliding_window"),  # context is 512
    ("Gemma2ForCausalLM", dict(sliding_window=1024), "sliding_window"),
    ("MistralForCausalLM", dict(sliding_window=0), "sliding_window"),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=-8,
                              max_window_layers=0), "sliding_window"),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8,
                              max_window_layers=-1), "max_window_layers"),
    ("Gemma3ForCausalLM", dict(sliding_window=8.5), "sliding_window"),
    ("Gemma3ForCausalLM", dict(sliding_window_pattern=0), "sliding_window_pattern"),
    ("Qwen2ForCausalLM", dict(use_sliding_window="yes", sliding_window=8),
     "use_sliding_window"),
    ("Gemma2ForCausalLM", dict(hidden_activation="relu"), "hidden_activation"),
    ("LlamaForCausalLM", dict(hidden_act="gelu"), "hidden_act"),
    ("Gemma2ForCausalLM", dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
    ("Gemma2ForCausalLM", dict(final_logit_softcapping="30"), "final_logit_softcapping"),
    ("Gemma2ForCausalLM", dict(query_pre_attn_scalar=0), "query_pre_attn_scalar"),
    ("Gemma3ForCausalLM", dict(rope_local_base_freq=-1), "rope_local_base_freq"),
    ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True),
     "use_bidirectional_attention"),
])
def test_bad_configs_are_refused_naming_the_field(arch, overrides, field):
    d = {**BASE, "num_hidden_layers": 2, "architectures": [arch], **overrides}
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(d)


def test_refusal_at_start_names_the_file_and_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {**BASE, "num_hidden_layers": 2, "architectures": ["Gemma2ForCausalLM"],
         "layer_types": ["sliding_attention"] * 3}))
    with pytest.raises(CheckpointError, match=r"config\.json.*layer_types has 3 entries"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("window, expected", [(2047, 2047), (262144, 0)])
def test_phi3_window_past_the_context_is_full_attention(window, expected):
    # Phi-3-mini-4k slides over 2047 positions; the 128k configs state 262144 over a 131072
    # context, which HF's mask never reaches: full attention, not a refusal.
    d = {**BASE, "architectures": ["Phi3ForCausalLM"], "num_hidden_layers": 2,
         "max_position_embeddings": 131072, "sliding_window": window}
    assert ModelConfig.from_dict(d).layer_windows == (expected, expected)

"""The model's context, as both services derive it from config.json through `checkpoints.rope`:
the scheduler's limit before an executor connects (`prompts.model_max_len`) is the one the
executor then reports (`loader.effective_max_model_len`, before its own caps)."""

from __future__ import annotations

import json

import pytest

from checkpoints.rope import context_length
from executor_svc.loading.loader import effective_max_model_len
from executor_svc.loading.model_config import ModelConfig
from scheduler_svc.api.prompts import model_max_len

BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
            intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("extra, expected", [
    ({}, 256),
    ({"max_position_embeddings": None}, 2048),  # HF's default when left out
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, 256),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 256}}, 1024),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, 1024),  # original: max pos
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, 512),
    ({"max_position_embeddings": 1024, "original_max_position_embeddings": 256,
      "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 4,
                          "long_factor": [2.0] * 4}}, 1024),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
     256),
], ids=["default", "absent", "linear", "yarn", "yarn-implied-original", "dynamic", "longrope",
        "llama3"])
def test_scheduler_and_executor_agree_on_the_context(tmp_path, extra, expected):
    config = {k: v for k, v in {**BASE, **extra}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert context_length(config) == expected
    assert effective_max_model_len(ModelConfig.from_dict(config), None) == expected
    assert model_max_len(tmp_path, None) == expected
    assert model_max_len(tmp_path, 100) == 100  # the operator's cap


def test_a_rope_the_executor_refuses_leaves_the_scheduler_at_the_stated_context(tmp_path):
    # The executor ends at start on this config (one line naming the field); until then the
    # scheduler serves no model, so its pre-connection limit only needs to be defined.
    config = {**BASE, "rope_parameters": {"rope_type": "yarn"}}  # no factor
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="factor"):
        context_length(config)
    assert model_max_len(tmp_path, None) == 256

"""The model's context, as both services derive it from config.json through `checkpoints.rope`:
the scheduler's limit before an executor connects (`prompts.model_max_len`) is the one the
executor then reports (`loader.effective_max_model_len`, before its own caps)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


_json = st.recursive(st.none() | st.booleans() | st.integers(-2, 10**6) | st.floats()
                     | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
_number = st.integers(-4, 10**7) | st.floats(allow_nan=True, allow_infinity=True)


@settings(max_examples=300, deadline=None)
@given(rope=st.one_of(_json, st.fixed_dictionaries(
    {"rope_type": st.sampled_from(["yarn", "longrope", "dynamic", "linear", "llama3",
                                   "default", "mrope", None])},
    optional={"factor": _number | _json, "rope_theta": _number,
              "original_max_position_embeddings": _number, "beta_fast": _number,
              "beta_slow": _number, "mscale": _number, "attention_factor": _number,
              "truncate": _json, "short_factor": st.lists(_number, max_size=6) | _json,
              "long_factor": st.lists(_number, max_size=6), "low_freq_factor": _number,
              "high_freq_factor": _number})),
       max_pos=_number | st.none())
def test_any_rope_config_gives_a_context_or_a_sentence(tmp_path_factory, rope, max_pos):
    """Whatever a config.json states as RoPE, the executor gets a context length or a
    ValueError naming a field, and the scheduler's limit is always a positive number."""
    config = {**BASE, "rope_parameters": rope, "max_position_embeddings": max_pos}
    try:
        length = context_length(config)
    except ValueError as e:
        assert any(w in str(e) for w in ("rope", "factor", "max_position_embeddings",
                                         "original_max_position_embeddings", "beta", "mscale",
                                         "truncate")), e
    else:
        assert isinstance(length, int) and length >= 1
    path = tmp_path_factory.mktemp("cfg")
    (path / "config.json").write_text(json.dumps(config))
    limit = model_max_len(path, None)
    assert isinstance(limit, int) and limit >= 1

"""Phi-3 specifics against HF transformers: LongRoPE past the original context, and the config
fields Phi-3 checkpoints spell their own way (the common cases run with the other families in
test_models.py and parallel/test_tp_model.py, through the harness's "phi3").

Past the original context HF's Phi-3 `generate` re-encodes the whole sequence with the long
factors (Phi3ForCausalLM.prepare_inputs_for_generation drops the cache once the sequence
passes original_max_position_embeddings; a prompt already past it is prefilled with the long
factors throughout). A paged engine cannot re-encode, and Folio rotates each position by its
own rule (executor_svc/models/rope.py), so here the oracle is HF's Phi-3 model driven one
token at a time over its cache, where HF's rotary embedding follows exactly that rule.
"""

from __future__ import annotations

import pytest
import torch

from executor_svc.loading.loader import effective_max_model_len
from executor_svc.loading.model_config import ModelConfig
from tests.executor.harness import PlanDriver, make_hf_model, make_runner, save_checkpoint

ORIGINAL = 32


def hf_stepwise_greedy(hf_model, prompt: list[int], num_new: int) -> list[int]:
    """Greedy ids from HF's model fed one token per forward call over a DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_model.config)
    tokens, generated = list(prompt), []
    with torch.no_grad():
        for pos in range(len(prompt) + num_new - 1):
            out = hf_model(input_ids=torch.tensor([[tokens[pos]]]), past_key_values=cache,
                           position_ids=torch.tensor([[pos]]), use_cache=True)
            if pos >= len(prompt) - 1:
                generated.append(int(out.logits[0, -1].argmax()))
                tokens.append(generated[-1])
    return generated


@pytest.fixture(scope="module")
def phi3_long(tmp_path_factory):
    hf_model = make_hf_model("phi3", original_max_position_embeddings=ORIGINAL)
    return hf_model, save_checkpoint(hf_model, tmp_path_factory.mktemp("phi3_long"))


@pytest.fixture(scope="module")
def phi4_mini(tmp_path_factory):
    """Phi-4-mini's shape: RoPE on the first 3/4 of each head (here 24 of 32 dimensions,
    half = 12 frequencies, one AVX2 vector and a tail), LongRoPE factors for those 12."""
    rotary_half = 12
    hf_model = make_hf_model(
        "phi3", hidden_size=128, original_max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75,
                         "short_factor": [1.0 + 0.05 * i for i in range(rotary_half)],
                         "long_factor": [1.0 + 0.6 * i for i in range(rotary_half)]})
    return hf_model, save_checkpoint(hf_model, tmp_path_factory.mktemp("phi4_mini"))


@pytest.mark.parametrize("prompt_len", [20, 45])  # crosses ORIGINAL while decoding / prompt past
@pytest.mark.parametrize("model", ["phi3_long", "phi4_mini"])
def test_longrope_past_the_original_context_matches_hf_step_by_step(model, prompt_len, request):
    hf_model, model_dir = request.getfixturevalue(model)
    prompt = [(7 * i + 3) % 300 for i in range(prompt_len)]
    num_new = max(ORIGINAL - prompt_len, 0) + 12
    runner = make_runner(model_dir)
    assert runner.max_model_len == 256 and prompt_len + num_new > ORIGINAL
    driver = PlanDriver(seed=5)
    first = min(prompt_len, 13)  # a chunked prefill
    out = runner.execute(driver.plan(new_reqs=[driver.new("r", prompt, first)]))
    if first < prompt_len:
        out = runner.execute(driver.plan(cached_reqs=[driver.cached("r", prompt_len - first)]))
    driver.record(out.sampled)
    generated = [ids for _, sampled in out.sampled for ids in sampled]
    while len(generated) < num_new:
        out = runner.execute(driver.plan(cached_reqs=driver.decode_all(["r"])))
        driver.record(out.sampled)
        generated.extend(ids for _, sampled in out.sampled for ids in sampled)
    assert generated[:num_new] == hf_stepwise_greedy(hf_model, prompt, num_new)


def _phi3_config(**fields) -> dict:
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 300,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4, "max_position_embeddings": 4 * ORIGINAL,
            "original_max_position_embeddings": ORIGINAL, **fields}


@pytest.mark.parametrize("old_name", ["su", "yarn", "longrope"])
def test_phi3_rope_scaling_names_read_as_longrope(old_name):
    # Phi-3-*-128k configs: rope_scaling with "type", short/long factors, no factor.
    cfg = ModelConfig.from_dict(_phi3_config(rope_scaling={
        "type": old_name, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}))
    assert cfg.rope.rope_type == "longrope"
    assert cfg.rope.params["original_max_position_embeddings"] == ORIGINAL
    assert cfg.rope.params["factor"] == 4.0


@pytest.mark.parametrize("where", ["top", "rope"])
def test_partial_rotary_factor_becomes_rotary_dim(where):
    # Phi-4-mini rotates 3/4 of each head (here 12 of 16); LongRoPE has a factor per rotated
    # pair. transformers 5 writes the field into rope_parameters, older configs at the top.
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}
    fields = {"partial_rotary_factor": 0.75}
    if where == "rope":
        rope, fields = {**rope, **fields}, {}
    cfg = ModelConfig.from_dict(_phi3_config(rope_parameters=rope, **fields))
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope.partial_rotary_factor) == (16, 12, 0.75)
    assert "partial_rotary_factor" not in cfg.rope.params
    # 1.0 (what HF writes into every Phi-3 config's rope_parameters) is the whole head.
    assert ModelConfig.from_dict(_phi3_config(partial_rotary_factor=1.0)).rotary_dim == 16
    assert ModelConfig.from_dict(_phi3_config()).rotary_dim == 16
    # Both given: rope_parameters' wins, as HF's standardisation keeps it.
    cfg = ModelConfig.from_dict(_phi3_config(rope_parameters={
        "rope_type": "default", "partial_rotary_factor": 0.5}, partial_rotary_factor=0.25))
    assert cfg.rotary_dim == 8


def test_longrope_factors_are_counted_against_rotary_dim():
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    with pytest.raises(ValueError, match=r"rope short_factor has 8 entries; head_dim 16 "
                                         r"\(partial_rotary_factor 0.75 rotates 12 of its "
                                         r"dimensions\) needs 6"):
        ModelConfig.from_dict(_phi3_config(rope_parameters=rope, partial_rotary_factor=0.75))


@pytest.mark.parametrize("factor, rotary_dim", [(0.6875, 11), (0.05, 0)])  # odd / zero
@pytest.mark.parametrize("where", ["top", "rope"])
def test_partial_rotary_factor_giving_an_odd_or_no_rotary_dim_is_refused(factor, rotary_dim,
                                                                          where):
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    fields = {"partial_rotary_factor": factor}
    if where == "rope":
        rope, fields = {**rope, **fields}, {}
    with pytest.raises(ValueError, match=rf"partial_rotary_factor {factor} rotates {rotary_dim} "
                                         r"of head_dim 16's dimensions: RoPE needs an even, "
                                         "non-zero number of them"):
        ModelConfig.from_dict(_phi3_config(rope_parameters=rope, **fields))


@pytest.mark.parametrize("factor", [0, -0.5, 1.5, "0.75", True])
def test_partial_rotary_factor_out_of_range_is_refused_naming_the_field(factor):
    with pytest.raises(ValueError, match="partial_rotary_factor must be"):
        ModelConfig.from_dict(_phi3_config(rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}))


def test_sliding_window_is_every_layer_and_does_not_cap_the_context():
    # Phi-3-mini-4k: sliding_window 2047 below its 4096 positions, on every layer; the window
    # is honoured by attention, so max_model_len keeps the model's context.
    cfg = ModelConfig.from_dict(_phi3_config(sliding_window=100))
    assert set(cfg.layer_windows) == {100}
    assert effective_max_model_len(cfg, None) == cfg.max_position_embeddings
    assert set(ModelConfig.from_dict(_phi3_config(sliding_window=None)).layer_windows) == {0}


def test_fused_tensor_of_the_wrong_shape_is_refused_naming_it(tmp_path):
    from safetensors.numpy import load_file, save_file

    from checkpoints.files import CheckpointError

    model_dir = save_checkpoint(make_hf_model("phi3"), tmp_path / "phi3")
    weights = load_file(str(model_dir / "model.safetensors"))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    weights[name] = weights[name][:-16]  # one KV head's rows short
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"checkpoint tensor {name} has shape "
                                              r"\(112, 64\), the model built from config.json "
                                              r"expects \(128, 64\)"):
        make_runner(model_dir)

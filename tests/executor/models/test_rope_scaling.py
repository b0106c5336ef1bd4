"""YaRN, LongRoPE and dynamic NTK against HF's own rotary embedding and models.

HF's `LlamaRotaryEmbedding` is the oracle for the tables: called as HF's decode step calls it
(one position at a time, in increasing order), it picks the frequencies Folio fixes per
position (see executor_svc/models/rope.py).
"""

from __future__ import annotations

import pytest
import torch

from executor_svc.loading.loader import effective_max_model_len
from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.rope import build_cos_sin_cache
from tests.executor.harness import (
    PlanDriver,
    hf_greedy,
    make_hf_model,
    make_runner,
    save_checkpoint,
)

HEAD_DIM = 16
HALF = HEAD_DIM // 2
ORIGINAL = 32  # the pretraining context in every config below

# name -> (rope_parameters, top-level config overrides)
CASES: dict[str, tuple[dict, dict]] = {
    "yarn": (dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                  original_max_position_embeddings=ORIGINAL),
             dict(max_position_embeddings=ORIGINAL)),
    "yarn_mscale": (dict(rope_type="yarn", rope_theta=1e6, factor=8.0, beta_fast=16.0,
                         beta_slow=2.0, mscale=0.707, mscale_all_dim=1.0, truncate=False,
                         original_max_position_embeddings=ORIGINAL),
                    dict(max_position_embeddings=ORIGINAL * 8)),
    # Phi-3 style: original_max_position_embeddings at the top level, no factor.
    "longrope": (dict(rope_type="longrope", rope_theta=10000.0,
                      short_factor=[1.0 + 0.05 * i for i in range(HALF)],
                      long_factor=[1.0 + 0.7 * i for i in range(HALF)]),
                 dict(max_position_embeddings=ORIGINAL * 4,
                      original_max_position_embeddings=ORIGINAL)),
    "dynamic": (dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
                dict(max_position_embeddings=ORIGINAL)),
}


def _configs(case: str):
    import transformers

    rope_parameters, top = CASES[case]
    hf_cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                      rope_parameters=dict(rope_parameters), **top)
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 300,
                                 "hidden_size": 64, "intermediate_size": 128,
                                 "num_hidden_layers": 1, "num_attention_heads": 4,
                                 "rope_parameters": dict(rope_parameters), **top})
    return hf_cfg, cfg


@pytest.mark.parametrize("case", list(CASES))
def test_cos_sin_match_hf_rotary_embedding(case):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg, cfg = _configs(case)
    max_len = cfg.rope.max_position(cfg.max_position_embeddings)
    assert max_len > ORIGINAL  # positions past the original context are covered
    table = build_cos_sin_cache(cfg.rope, HEAD_DIM, max_len)  # [max_len, HEAD_DIM]
    hf_rope = LlamaRotaryEmbedding(hf_cfg)
    x = torch.zeros(1, 1, HEAD_DIM)
    for pos in range(max_len):  # increasing, as HF decodes
        cos, sin = hf_rope(x, torch.tensor([[pos]]))  # [1, 1, HEAD_DIM], halves repeated
        expected = torch.cat([cos[0, 0, :HALF], sin[0, 0, :HALF]])
        torch.testing.assert_close(table[pos], expected, atol=1e-6, rtol=0, msg=f"pos {pos}")


def test_scaled_context_sets_max_model_len():
    # YaRN: original * factor; LongRoPE: the stated max_position_embeddings; dynamic: * factor.
    lens = {case: effective_max_model_len(_configs(case)[1], None) for case in CASES}
    assert lens == {"yarn": ORIGINAL * 4, "yarn_mscale": ORIGINAL * 8,
                    "longrope": ORIGINAL * 4, "dynamic": ORIGINAL * 2}
    assert effective_max_model_len(_configs("yarn")[1], 50) == 50


@pytest.mark.parametrize("case", ["yarn", "longrope", "dynamic"])
def test_greedy_past_the_original_context_matches_hf(case, tmp_path):
    rope_parameters, top = CASES[case]
    hf_model = make_hf_model("llama2", rope_parameters=dict(rope_parameters), **top)
    runner = make_runner(save_checkpoint(hf_model, tmp_path / case))
    prompt = [5, 17, 42, 99, 7, 250, 3, 11, 12, 13, 200, 1, 150, 33, 87, 45, 66, 71, 299, 8]
    num_new = 2 * ORIGINAL - len(prompt)  # generation runs well past the original context
    assert runner.max_model_len >= len(prompt) + num_new
    driver = PlanDriver(seed=4)
    generated: list[int] = []
    plan = driver.plan(new_reqs=[driver.new("r", prompt, len(prompt))])
    while len(generated) < num_new:
        out = runner.execute(plan)
        driver.record(out.sampled)
        generated.extend(ids for _, sampled in out.sampled for ids in sampled)
        plan = driver.plan(cached_reqs=driver.decode_all(["r"]))
    assert generated[:num_new] == hf_greedy(hf_model, prompt, num_new)


@pytest.mark.parametrize(("rope_parameters", "top", "message"), [
    (dict(rope_type="yarn", original_max_position_embeddings=32), {}, "needs 'factor'"),
    (dict(rope_type="yarn", factor=4.0, beta_fast="32"), {}, "beta_fast must be a positive"),
    (dict(rope_type="yarn", factor=4.0, truncate="no"), {}, "truncate must be true or false"),
    (dict(rope_type="longrope", short_factor=[1.0] * HALF), {}, "needs 'long_factor'"),
    (dict(rope_type="longrope", short_factor=[1.0] * (HALF - 1), long_factor=[2.0] * HALF), {},
     f"short_factor has {HALF - 1} entries; head_dim {HEAD_DIM} needs {HALF}"),
    (dict(rope_type="dynamic"), {}, "needs 'factor'"),
])
def test_bad_scaling_config_is_refused_naming_the_field(rope_parameters, top, message):
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
         "rope_parameters": rope_parameters, **top}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(d)


def test_other_rope_types_are_refused_when_the_model_is_built():
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 300,
                                 "hidden_size": 64, "intermediate_size": 128,
                                 "num_hidden_layers": 1, "num_attention_heads": 4,
                                 "rope_parameters": {"rope_type": "mrope"}})
    with pytest.raises(ValueError, match="RoPE scaling type 'mrope' is not supported"):
        build_cos_sin_cache(cfg.rope, HEAD_DIM, 8)

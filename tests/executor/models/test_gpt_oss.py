"""gpt-oss specifics (greedy and long-prompt logits against HF run in test_models.py and
test_windowed_models.py, TP in tests/executor/parallel/test_tp_gpt_oss.py): the sinks matter,
the router is HF's (top-k of the biased logits, then a softmax over the k), the experts'
interleaved gate/up tensors land de-interleaved, bf16 weights serve, the config's defaults
are HF's, and malformed checkpoints and configs are refused with one line naming the tensor
or field. MXFP4 experts: test_gpt_oss_mxfp4.py."""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import pytest
import torch

from checkpoints.files import CheckpointError
from executor_svc.loading.loader import effective_max_model_len, load_model
from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.gpt_oss import GptOssExperts, GptOssRouter
from tests.executor.harness import PlanDriver, make_runner, plain_expert_weights
from tests.executor.models.test_moe import _edit_config, _edit_tensors

CPU = torch.device("cpu")
NUM_BLOCKS = 240
_rng = random.Random(11)
# Past the window (16) and YaRN's original context (64).
PROMPTS = [[_rng.randrange(300) for _ in range(n)] for n in (131, 70, 9)]


def _copy(model_dir: Path, dest: Path) -> Path:
    shutil.copytree(model_dir, dest)
    return dest


def _prefill_logits(runner) -> torch.Tensor:
    driver = PlanDriver(num_blocks=NUM_BLOCKS, seed=1,
                        num_kv_groups=runner.kv_cache.layout.num_groups)
    new_reqs = [driver.new(f"r{i}", p, len(p)) for i, p in enumerate(PROMPTS)]
    inputs = runner.prepare(runner.apply(driver.plan(new_reqs=new_reqs)))
    batch = dataclasses.replace(inputs.batch, logits_indices=torch.arange(
        inputs.batch.num_tokens))
    with torch.inference_mode():
        return runner.model(inputs.input_ids, inputs.positions, batch)


def _hf_logits(hf_model) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([hf_model(torch.tensor([p])).logits[0] for p in PROMPTS])


def test_kv_groups_and_windows(checkpoint_cache):
    _, model_dir = checkpoint_cache("gpt_oss")
    runner = make_runner(model_dir, num_blocks=NUM_BLOCKS)
    assert [a.window for a in runner.model.attention_layers()] == [16, 0, 16, 0]
    assert runner.kv_cache.layout.num_groups == 2  # the sliding layers, the full ones
    assert runner.max_model_len == 256  # YaRN: 4 x the original 64


def test_sinks_matter_and_load_as_fp32(checkpoint_cache):
    hf_model, model_dir = checkpoint_cache("gpt_oss")
    expected = _hf_logits(hf_model)
    runner = make_runner(model_dir, num_blocks=NUM_BLOCKS)
    attn = runner.model.attention_layers()
    for layer, hf_layer in zip(attn, hf_model.model.layers, strict=True):
        assert layer.sinks.dtype == torch.float32
        assert torch.equal(layer.sinks, hf_layer.self_attn.sinks.detach())
    torch.testing.assert_close(_prefill_logits(runner), expected, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        for layer in attn:
            layer.sinks.zero_()
    assert (_prefill_logits(runner) - expected).abs().max() > 1e-2


def test_rope_table_matches_gpt_oss_rotary_embedding():
    """gpt-oss's YaRN (theta 150000, factor 32, beta 32/1, truncate false: the correction
    range is not rounded) at head_dim 64 against HF's GptOssRotaryEmbedding, every position
    of the scaled context (an original context of 64 here rather than 4096)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from executor_svc.models.rope import build_cos_sin_cache

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}
    fields = {**_CONFIG, "head_dim": 64, "max_position_embeddings": 64 * 32,
              "rope_parameters": rope}
    cfg = ModelConfig.from_dict(fields)
    max_len = cfg.rope.max_position(cfg.max_position_embeddings)
    assert max_len == 2048
    table = build_cos_sin_cache(cfg.rope, cfg.rotary_dim, max_len)
    hf_cfg = GptOssConfig(**{k: v for k, v in fields.items() if k != "architectures"})
    cos, sin = GptOssRotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32),
                                             torch.arange(max_len)[None])
    torch.testing.assert_close(table, torch.cat([cos[0], sin[0]], dim=-1), atol=1e-6, rtol=0)


def test_router_matches_hf():
    """Top-k of the biased logits, then a softmax over those k, ties as torch.topk breaks
    them (experts 1-3 tie on the first rows)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    fields = dict(vocab_size=16, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=2,
                  num_local_experts=4, num_experts_per_tok=2)
    cfg = ModelConfig.from_dict({"architectures": ["GptOssForCausalLM"], **fields})
    router = GptOssRouter(cfg, torch.float32)
    hf_router = GptOssTopKRouter(GptOssConfig(**fields))
    weight = torch.tensor([[0.0] * 4, [1.0] * 4, [1.0] * 4, [1.0] * 4])
    bias = torch.tensor([0.5, 0.0, 0.0, 0.0])
    x = torch.cat([torch.ones(3, 4), torch.randn(5, 4)])
    with torch.no_grad():
        for r in (router, hf_router):
            r.weight.copy_(weight)
            r.bias.copy_(bias)
        _, hf_weights, hf_ids = hf_router(x)
    weights, ids = router.route(x)
    assert ids.tolist() == hf_ids.tolist()
    assert torch.equal(weights, hf_weights)


def test_experts_are_deinterleaved_at_load(checkpoint_cache):
    hf_model, model_dir = checkpoint_cache("gpt_oss")
    runner = make_runner(model_dir, num_blocks=NUM_BLOCKS)
    experts = runner.model.model.layers[1].mlp.experts
    hf = hf_model.model.layers[1].mlp.experts
    assert isinstance(experts, GptOssExperts)
    inter = hf.intermediate_size
    w13, w2 = plain_expert_weights(experts)
    gate_up = hf.gate_up_proj.detach()  # [E, hidden, 2I], gate/up interleaved
    assert torch.equal(w13[:, :inter], gate_up[..., 0::2].transpose(1, 2))
    assert torch.equal(w13[:, inter:], gate_up[..., 1::2].transpose(1, 2))
    bias = hf.gate_up_proj_bias.detach()
    assert torch.equal(experts.w13_bias, torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1))
    assert torch.equal(w2, hf.down_proj.detach().transpose(1, 2))
    assert torch.equal(experts.w2_bias, hf.down_proj_bias.detach())
    # The checkpoint-layout copies are gone once rearranged.
    assert not hasattr(experts, "gate_up_proj")


def test_bf16_weights_serve(checkpoint_cache):
    """bf16: the sinks still fp32; the logits near the fp32 oracle's."""
    hf_model, model_dir = checkpoint_cache("gpt_oss")
    expected = _hf_logits(hf_model)
    cfg = ModelConfig.from_dir(model_dir)
    max_len = effective_max_model_len(cfg, None)
    model = load_model(model_dir, dtype=torch.bfloat16, device=CPU, max_model_len=max_len,
                       cfg=cfg)
    assert all(a.sinks.dtype == torch.float32 for a in model.attention_layers())
    experts = model.model.layers[0].mlp.experts
    assert getattr(experts, "packed", experts).w13.dtype == torch.bfloat16
    from executor_svc.kv.kv_cache import KVCache
    from executor_svc.step.runner import ModelRunner
    from tests.executor.harness import BLOCK_SIZE

    kv_cache = KVCache.allocate(cfg, NUM_BLOCKS, BLOCK_SIZE, torch.bfloat16, CPU)
    kv_cache.bind(model)
    runner = ModelRunner(model, kv_cache, BLOCK_SIZE, max_len, cfg.vocab_size, CPU, None)
    got = _prefill_logits(runner)
    assert got.dtype == torch.float32
    # bf16 rounding may flip a close expert choice on a few tokens: judged on the mean.
    err = (got - expected).abs().mean() / expected.abs().mean()
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean()
    print(f"bf16: mean relative error {err:.4f}, argmax agreement {agree:.3f}")
    assert err < 0.05 and agree > 0.9, (err, agree)


_CONFIG = dict(architectures=["GptOssForCausalLM"], vocab_size=300, hidden_size=64,
               intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)


def test_config_defaults_are_hfs():
    """A config.json that leaves out head_dim, the windows, the RoPE, attention_bias and the
    SwiGLU numbers gets GptOssConfig's."""
    from transformers import GptOssConfig

    cfg = ModelConfig.from_dict(_CONFIG)
    hf = GptOssConfig(**{k: v for k, v in _CONFIG.items() if k != "architectures"})
    assert cfg.layer_windows == tuple(hf.sliding_window if t == "sliding_attention" else 0
                                      for t in hf.layer_types) == (128, 0, 128, 0)
    assert (cfg.head_dim, cfg.attention_bias, cfg.rms_norm_eps) == (64, True, 1e-5)
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (hf.swiglu_limit, hf.swiglu_alpha)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.theta == 150_000.0
    hf_rope = dict(hf.rope_parameters)
    for key in ("factor", "beta_fast", "beta_slow", "truncate",
                "original_max_position_embeddings"):
        assert cfg.rope.params[key] == hf_rope[key], key
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    # The names openai's config.json uses: rope_scaling, rope_theta at the top level.
    real = ModelConfig.from_dict({**_CONFIG, "rope_theta": 150000, "swiglu_limit": 5.0,
                                  "rope_scaling": {"rope_type": "yarn", "factor": 32.0,
                                                   "beta_fast": 32.0, "beta_slow": 1.0,
                                                   "truncate": False,
                                                   "original_max_position_embeddings": 4096}})
    assert real.rope.params["truncate"] is False and real.swiglu_limit == 5.0
    assert real.rope.max_position(real.max_position_embeddings) == 131072


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_types=["sliding_attention", "full_attention", "chunked_attention",
                       "full_attention"]),
     r"layer_types has an unknown entry 'chunked_attention'"),
    (dict(layer_types=["sliding_attention", "full_attention"]),
     r"layer_types has 2 entries; num_hidden_layers is 4"),
    (dict(num_local_experts=None), r"lacks the field 'num_local_experts'"),
    (dict(num_experts_per_tok=5), r"num_experts_per_tok \(5\) is larger than the number of "
                                  r"experts \(4\)"),
    (dict(swiglu_limit=-1.0), r"swiglu_limit must be a positive number"),
    (dict(sliding_window=0), r"sliding_window must be a positive integer"),
])
def test_bad_config_fields_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**_CONFIG, **overrides})


@pytest.mark.parametrize("missing", ["model.layers.2.self_attn.sinks",
                                     "model.layers.1.mlp.experts.gate_up_proj_bias",
                                     "model.layers.0.mlp.router.bias"])
def test_missing_tensor_is_named(missing, checkpoint_cache, tmp_path):
    _, model_dir = checkpoint_cache("gpt_oss")
    broken = _copy(model_dir, tmp_path / "broken")
    _edit_tensors(broken, lambda t: t.pop(missing))
    with pytest.raises(CheckpointError, match=r"lacks tensors for 1 parameter\(s\) .*"
                                              + missing.replace(".", r"\.")):
        load_model(broken, dtype=torch.float32, device=CPU, max_model_len=64)


def test_per_expert_tensors_are_refused(checkpoint_cache, tmp_path):
    """gpt-oss's experts exist only as the 3-D tensors; another layout is named."""
    _, model_dir = checkpoint_cache("gpt_oss")
    broken = _copy(model_dir, tmp_path / "broken")

    def split(t):
        t["model.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(128, 64)

    _edit_tensors(broken, split)
    with pytest.raises(CheckpointError, match=r"no matching parameter in GptOssForCausalLM: "
                                              r"model\.layers\.0\.mlp\.experts\.0\.gate_proj"):
        load_model(broken, dtype=torch.float32, device=CPU, max_model_len=64)


def test_wrong_expert_count_is_named(checkpoint_cache, tmp_path):
    _, model_dir = checkpoint_cache("gpt_oss")
    broken = _copy(model_dir, tmp_path / "broken")
    _edit_config(broken, num_local_experts=5, num_experts_per_tok=2)
    with pytest.raises(CheckpointError, match=r"has shape \(4, .*expects \(5, "):
        load_model(broken, dtype=torch.float32, device=CPU, max_model_len=64)



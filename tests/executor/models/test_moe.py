"""Mixture-of-experts specifics (the families themselves run against HF in test_models.py and
test_tp_model.py): the stacked 3-D expert layout of transformers 5's modules loads to the same
model as the per-expert tensors save_pretrained writes; the router's ties; malformed
checkpoints and configs refused with one line naming the tensor or field. Quantized experts:
tests/executor/quantization/test_quantized_experts.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints.files import CheckpointError
from executor_svc.loading.loader import load_model
from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.moe import TopKRouter
from tests.executor.harness import PlanDriver, make_runner

PROMPTS = [[5, 17, 42, 99, 7, 250, 3], [200, 1, 150, 33, 87, 45, 66, 71, 299, 8, 120, 9]]
CPU = torch.device("cpu")


def _copy(model_dir: Path, dest: Path) -> Path:
    shutil.copytree(model_dir, dest)
    return dest


def _edit_tensors(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(model_dir: Path, **fields) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _stack_experts(tensors: dict[str, torch.Tensor]) -> None:
    """Per-expert tensors -> transformers 5's stacked experts.gate_up_proj [E, 2I, hidden]
    (gate rows first) and experts.down_proj [E, hidden, I]."""
    prefixes = sorted({k.split(".experts.")[0] for k in tensors if ".experts." in k})
    for prefix in prefixes:
        count = len([k for k in tensors if k.startswith(f"{prefix}.experts.")
                     and k.endswith(".down_proj.weight")])
        gate_up = [torch.cat([tensors.pop(f"{prefix}.experts.{e}.gate_proj.weight"),
                              tensors.pop(f"{prefix}.experts.{e}.up_proj.weight")])
                   for e in range(count)]
        down = [tensors.pop(f"{prefix}.experts.{e}.down_proj.weight") for e in range(count)]
        tensors[f"{prefix}.experts.gate_up_proj"] = torch.stack(gate_up).contiguous()
        tensors[f"{prefix}.experts.down_proj"] = torch.stack(down).contiguous()


def _prefill_logits(model_dir: Path) -> torch.Tensor:
    runner = make_runner(model_dir)
    driver = PlanDriver(seed=1, num_kv_groups=runner.kv_cache.layout.num_groups)
    new_reqs = [driver.new(f"r{i}", p, len(p)) for i, p in enumerate(PROMPTS)]
    inputs = runner.prepare(runner.apply(driver.plan(new_reqs=new_reqs)))
    batch = dataclasses.replace(inputs.batch, logits_indices=torch.arange(
        inputs.batch.num_tokens))
    with torch.inference_mode():
        return runner.model(inputs.input_ids, inputs.positions, batch)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_stacked_expert_tensors_load_like_per_expert_ones(arch, checkpoint_cache, tmp_path):
    hf_model, model_dir = checkpoint_cache(arch)
    stacked = _copy(model_dir, tmp_path / "stacked")
    _edit_tensors(stacked, _stack_experts)
    got = _prefill_logits(stacked)
    start = 0
    for prompt in PROMPTS:
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(got[start:start + len(prompt)], expected, atol=1e-4,
                                   rtol=1e-4)
        start += len(prompt)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_ties_are_broken_as_hf_breaks_them(norm_topk_prob):
    """Ties (experts 1-3 here, and exact ties between rows) go where HF's router sends them:
    both call torch.topk on the same fp32 probabilities."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    fields = dict(vocab_size=16, hidden_size=4, intermediate_size=8, moe_intermediate_size=4,
                  num_hidden_layers=1, num_attention_heads=2, num_experts=4,
                  num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
    cfg = ModelConfig.from_dict({"architectures": ["Qwen3MoeForCausalLM"], **fields})
    router = TopKRouter(cfg, torch.float32, round_weights=True)
    hf_router = Qwen3MoeTopKRouter(Qwen3MoeConfig(**fields))
    weight = torch.tensor([[0.0] * 4, [1.0] * 4, [1.0] * 4, [1.0] * 4])
    x = torch.cat([torch.ones(3, 4), torch.randn(5, 4)])
    with torch.no_grad():
        router.weight.copy_(weight)
        hf_router.weight.copy_(weight)
        _, hf_weights, hf_ids = hf_router(x)
    weights, ids = router.route(x)
    assert ids.tolist() == hf_ids.tolist()
    assert torch.equal(weights, hf_weights.float())


@pytest.mark.parametrize("arch, missing", [
    ("qwen2_moe", "model.layers.1.mlp.experts.3.up_proj.weight"),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.7.w2.weight"),
])
def test_missing_expert_tensor_is_named(arch, missing, checkpoint_cache, tmp_path):
    _, model_dir = checkpoint_cache(arch)
    broken = _copy(model_dir, tmp_path / "broken")
    _edit_tensors(broken, lambda t: t.pop(missing))
    with pytest.raises(CheckpointError, match=r"lacks tensors for 1 parameter\(s\) .*"
                                              + missing.replace(".", r"\.")):
        load_model(broken, dtype=torch.float32, device=CPU, max_model_len=64)


def test_more_experts_in_the_checkpoint_than_the_config_is_refused(checkpoint_cache,
                                                                   tmp_path):
    _, model_dir = checkpoint_cache("qwen3_moe")
    broken = _copy(model_dir, tmp_path / "broken")
    _edit_config(broken, num_experts=6, num_local_experts=6)
    with pytest.raises(CheckpointError, match=r"checkpoint tensor model\.layers\.0\.mlp\.experts"
                                              r"\.6\.\w+\.weight: expert 6 is past the 6 "
                                              r"experts config\.json states"):
        load_model(broken, dtype=torch.float32, device=CPU, max_model_len=64)


def test_fewer_experts_in_the_checkpoint_than_the_config_is_refused(checkpoint_cache,
                                                                    tmp_path):
    _, model_dir = checkpoint_cache("mixtral")
    broken = _copy(model_dir, tmp_path / "broken")
    _edit_config(broken, num_local_experts=9)
    # The router's rows are checked first: one per expert.
    with pytest.raises(CheckpointError, match=r"checkpoint tensor model\.layers\.0\."
                                              r"block_sparse_moe\.gate\.weight has shape "
                                              r"\(8, 64\), the model built from config\.json "
                                              r"expects \(9, 64\)"):
        load_model(broken, dtype=torch.float32, device=CPU, max_model_len=64)


def test_stacked_experts_of_the_wrong_count_are_refused(checkpoint_cache, tmp_path):
    _, model_dir = checkpoint_cache("qwen2_moe")
    broken = _copy(model_dir, tmp_path / "broken")
    _edit_tensors(broken, _stack_experts)
    _edit_config(broken, num_experts=5)
    with pytest.raises(CheckpointError, match=r"experts\.(gate_up_proj|down_proj) has shape "
                                              r"\(6, 64, (64|32)\), the model built from "
                                              r"config\.json expects \(5, 64, (64|32)\)"):
        load_model(broken, dtype=torch.float32, device=CPU, max_model_len=64)


_BASE = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=300, hidden_size=64,
             intermediate_size=128, moe_intermediate_size=32,
             shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("overrides, message", [
    (dict(num_experts=None), r"lacks the field 'num_experts'"),
    (dict(architectures=["MixtralForCausalLM"], num_experts=None),
     r"lacks the field 'num_local_experts'"),
    (dict(num_experts=0), r"num_experts must be a positive integer, got 0"),
    (dict(num_local_experts=8), r"num_experts \(4\) and num_local_experts \(8\) disagree"),
    (dict(num_experts_per_tok=5), r"num_experts_per_tok \(5\) is larger than the number of "
                                  r"experts \(4\)"),
    (dict(moe_intermediate_size="32"), r"moe_intermediate_size must be a positive integer"),
    (dict(shared_expert_intermediate_size=None),
     r"lacks the field 'shared_expert_intermediate_size'"),
    (dict(norm_topk_prob="yes"), r"norm_topk_prob must be true or false"),
    (dict(decoder_sparse_step=0), r"decoder_sparse_step must be a positive integer"),
    (dict(mlp_only_layers=[2]), r"mlp_only_layers must be a list of layer indices in \[0, 2\)"),
    (dict(scoring_func="sigmoid"), r"scoring_func 'sigmoid' is not supported"),
    (dict(topk_method="group_limited_greedy"),
     r"topk_method 'group_limited_greedy' is not supported"),
    (dict(use_sliding_window=True), r"use_sliding_window is set"),
])
def test_bad_moe_config_fields_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**_BASE, **overrides})


def test_moe_config_fields():
    cfg = ModelConfig.from_dict({**_BASE, "num_hidden_layers": 4, "decoder_sparse_step": 2,
                                 "mlp_only_layers": [3], "router_aux_loss_coef": 0.5})
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size, cfg.norm_topk_prob) == (4, 2, 32, 48, False)
    assert cfg.attention_bias  # Qwen2-MoE's qkv_bias defaults to true
    mixtral = ModelConfig.from_dict({**_BASE, "architectures": ["MixtralForCausalLM"],
                                     "num_experts": None, "num_local_experts": 8})
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob,
            mixtral.shared_expert_intermediate_size) == (8, 128, True, 0)
    assert not ModelConfig.from_dict({**_BASE, "architectures": ["LlamaForCausalLM"]}).num_experts


def test_tensor_parallel_must_divide_the_expert_sizes():
    from executor_svc.loading.model_config import check_tensor_parallel

    cfg = ModelConfig.from_dict({**_BASE, "moe_intermediate_size": 30})
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 does not divide "
                                         r"moe_intermediate_size 30 \(30 % 4 = 2\)"):
        check_tensor_parallel(cfg, 4)


@pytest.mark.parametrize("arch, overrides", [
    # Layers 1 and 3 of 4 are MoE (decoder_sparse_step 2), renormalised top-2.
    ("qwen2_moe", dict(num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=True)),
    ("qwen2_moe", dict(qkv_bias=False)),
    ("mixtral", dict(sliding_window=8)),  # the prompts cross the window
    ("qwen3_moe", dict(num_experts_per_tok=1, mlp_only_layers=[])),
], ids=["qwen2_moe-sparse-step", "qwen2_moe-no-qkv-bias", "mixtral-window", "qwen3_moe-top1"])
def test_moe_variants_match_hf(arch, overrides, tmp_path):
    from tests.executor.harness import make_hf_model, save_checkpoint

    hf_model = make_hf_model(arch, **overrides)
    got = _prefill_logits(save_checkpoint(hf_model, tmp_path / "ckpt"))
    start = 0
    for prompt in PROMPTS:
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(got[start:start + len(prompt)], expected, atol=1e-4,
                                   rtol=1e-4)
        start += len(prompt)


def test_model_loaded_line_counts_the_experts_bytes(checkpoint_cache):
    from structlog.testing import capture_logs

    from executor_svc.models.moe import FusedMoE

    _, model_dir = checkpoint_cache("mixtral")
    with capture_logs() as logs:
        model = load_model(model_dir, dtype=torch.float32, device="cpu", max_model_len=64,
                           cfg=ModelConfig.from_dir(model_dir))
    line = next(entry for entry in logs if entry["event"] == "model loaded")
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    # Every expert's three fp32 matrices once (the CPU backend's slabs replace the plain
    # weights; they pad each projection's output features to a multiple of 16).
    plain = sum(4 * m.num_experts * 3 * m.intermediate_size * m.hidden_size for m in experts)
    padded = sum(4 * m.num_experts * (2 * -(-m.intermediate_size // 16) * 16 * m.hidden_size
                                      + -(-m.hidden_size // 16) * 16 * m.intermediate_size)
                 for m in experts)
    assert experts and plain <= line["expert_bytes"] <= padded
    assert line["expert_bytes"] < line["weight_bytes"]

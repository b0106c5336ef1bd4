"""The fused MoE MLP's torch twin against the float64 reference: SwiGLU and gpt-oss's clamped
activation, with and without expert biases, experts that get no token, all tokens on one
expert, fp32 and bf16."""

import pytest
import torch

from kernels import twins
from tests.kernels.moe_reference import random_experts, random_routing, reference_moe

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("activation, bias", [("silu", False), ("swigluoai", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, only", [(1, None), (13, None), (9, 2)])
def test_twin_matches_reference(activation, bias, dtype, num_tokens, only):
    weights = random_experts(8, 32, 24, dtype, bias=bias, seed=1)
    topk_weights, topk_ids = random_routing(num_tokens, 8, 2, seed=2, only=only)
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    options = dict(activation=activation, swiglu_limit=1.5)  # a limit that clamps
    out = twins.fused_moe(x, weights["w13"], weights["w2"], topk_weights, topk_ids,
                          **{k: v for k, v in weights.items() if k.endswith("bias")}, **options)
    assert out.dtype == dtype and out.shape == x.shape
    expected = reference_moe(x, weights["w13"], weights["w2"], topk_weights, topk_ids,
                             **{k: v for k, v in weights.items() if k.endswith("bias")},
                             **options)
    torch.testing.assert_close(out.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    if num_tokens < 8:
        assert len(topk_ids.unique()) < 8  # some expert got no token

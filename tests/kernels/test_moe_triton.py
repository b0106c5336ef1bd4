"""fused_moe's Triton kernels (kernels/moe.py; the interpreter on CPU) against the twin and the
float64 reference: experts with no token, every token on one expert (several blocks of one
expert), k = 1 and 2, fp32 and fp16, biases and gpt-oss's activation, odd shapes; the align
step's layout; batch invariance. A `gpu` test at Qwen3-30B-A3B's size."""

import pytest
import torch

from kernels import twins
from tests.kernels.moe_reference import random_experts, random_routing, reference_moe

# (experts, hidden, intermediate, top_k, tokens, only): one token, idle experts, k = 1, all
# tokens on one expert (past one BLOCK_M block), sizes off the tiles (hidden 40 / 72,
# intermediate 24 / 40), a pair count that is not a multiple of BLOCK_M.
CASES = [(8, 32, 24, 2, 1, None), (8, 40, 24, 2, 13, None), (4, 32, 16, 1, 7, None),
         (6, 72, 40, 2, 37, 3), (16, 64, 32, 2, 5, None), (3, 40, 24, 1, 20, 0)]


def _case(case, dtype, bias, device, seed=0):
    num_experts, hidden, intermediate, top_k, num_tokens, only = case
    weights = random_experts(num_experts, hidden, intermediate, dtype, bias=bias, seed=seed)
    topk_weights, topk_ids = random_routing(num_tokens, num_experts, top_k, seed=seed + 1,
                                            only=only)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed + 2))
    weights = {k: v.to(device) for k, v in weights.items()}
    return x.to(dtype).to(device), weights, topk_weights.to(device), topk_ids.to(device)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("activation, bias", [("silu", False), ("swigluoai", True),
                                              ("silu", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_against_twin_and_reference(triton_ops, device, tolerance, case, activation,
                                           bias, dtype):
    x, weights, topk_weights, topk_ids = _case(case, dtype, bias, device, seed=3)
    options = dict(activation=activation, swiglu_limit=1.5,
                   **{k: v for k, v in weights.items() if k.endswith("bias")})
    out = triton_ops.fused_moe(x, weights["w13"], weights["w2"], topk_weights, topk_ids,
                               **options)
    assert out.dtype == dtype and out.shape == x.shape
    twin = twins.fused_moe(x, weights["w13"], weights["w2"], topk_weights, topk_ids, **options)
    tol = tolerance[dtype]
    torch.testing.assert_close(out.float(), twin.float(), atol=tol, rtol=tol)
    expected = reference_moe(x.cpu(), *(weights[k].cpu() for k in ("w13", "w2")),
                             topk_weights.cpu(), topk_ids.cpu(),
                             **{k: v.cpu() for k, v in options.items()
                                if isinstance(v, torch.Tensor)},
                             activation=activation, swiglu_limit=1.5)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2 * tol, rtol=2 * tol)


def test_align_blocks_layout(triton_ops):
    from kernels import moe

    topk_ids = torch.tensor([[2, 0], [2, 3], [0, 2]] + [[3, 2]] * 15)  # expert 1 idle
    sorted_ids, block_expert = moe.align_blocks(topk_ids, 5, block_m=16)
    num_pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1)
    used = block_expert < 5
    # Every pair exactly once; each block holds its expert's pairs only, in pair order.
    assert sorted(p for p in sorted_ids.tolist() if p < num_pairs) == list(range(num_pairs))
    for b, expert in enumerate(block_expert.tolist()):
        rows = sorted_ids[b * 16:(b + 1) * 16]
        rows = rows[rows < num_pairs]
        if expert == 5:
            assert len(rows) == 0
        else:
            assert (flat[rows.long()] == expert).all() and len(rows) > 0
            assert rows.tolist() == sorted(rows.tolist())
    assert block_expert[used].tolist() == [0, 2, 2, 3]  # 2, 18 and 16 pairs
    assert (block_expert[~used] == 5).all() and not used[used.sum():].any()


def test_triton_is_batch_invariant(triton_ops, device):
    """A token's output alone equals its row in the batch (where each expert's blocks hold
    other tokens and padding)."""
    case = (6, 40, 24, 2, 21, 1)
    x, weights, topk_weights, topk_ids = _case(case, torch.float32, True, device, seed=8)
    biases = {k: v for k, v in weights.items() if k.endswith("bias")}
    together = triton_ops.fused_moe(x, weights["w13"], weights["w2"], topk_weights, topk_ids,
                                    **biases)
    for t in (0, 5, 20):
        alone = triton_ops.fused_moe(x[t:t + 1], weights["w13"], weights["w2"],
                                     topk_weights[t:t + 1], topk_ids[t:t + 1], **biases)
        assert torch.equal(alone, together[t:t + 1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens", [1, 32, 512])
def test_triton_qwen3_moe_size_gpu(num_tokens):
    """Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768, top-8) in bf16 against the twin."""
    from kernels import triton_ops

    device = torch.device("cuda")
    x, weights, topk_weights, topk_ids = _case((128, 2048, 768, 8, num_tokens, None),
                                               torch.bfloat16, False, device, seed=11)
    out = triton_ops.fused_moe(x, weights["w13"], weights["w2"], topk_weights, topk_ids)
    twin = twins.fused_moe(x, weights["w13"], weights["w2"], topk_weights, topk_ids)
    torch.testing.assert_close(out.float(), twin.float(), atol=3e-2, rtol=3e-2)


def test_triton_int32_ids_and_strided_x(triton_ops, device, tolerance):
    x, weights, topk_weights, topk_ids = _case((8, 32, 24, 2, 6, None), torch.float32, True,
                                               device, seed=12)
    wide = torch.randn(6, 50, device=device)
    wide[:, 3:35] = x
    biases = {k: v for k, v in weights.items() if k.endswith("bias")}
    out = triton_ops.fused_moe(wide[:, 3:35], weights["w13"], weights["w2"], topk_weights,
                               topk_ids.int(), **biases)
    twin = twins.fused_moe(x, weights["w13"], weights["w2"], topk_weights, topk_ids, **biases)
    torch.testing.assert_close(out, twin, atol=tolerance[torch.float32],
                               rtol=tolerance[torch.float32])

"""The fused MoE MLP's torch twin against the float64 reference: SwiGLU and gpt-oss's clamped
activation, with and without expert biases, experts that get no token, all tokens on one
expert, fp32 and bf16. Then the CPU backend's paths (the fused kernel of
kernels/csrc/fused_moe.cpp on packed experts, the torch grouped path on packed and on plain
weights) against both, the packing's round trip, and the fused kernel's batch and thread
invariance; tests/kernels/test_isa.py reruns this file on the AVX2 build."""

import pytest
import torch

from kernels import cpu, twins
from kernels.cpu import moe as moe_backend
from tests.kernels.moe_reference import random_experts, random_routing, reference_moe

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


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


# The CPU backend (kernels/cpu/): on packed experts the fused kernel
# (kernels/csrc/fused_moe.cpp) for decode batches and the torch grouped path (larger batches,
# or no extension); on plain weights the grouped path. Each against the twin and the reference.
CPU_PATHS = ["fused", "packed-grouped", "plain"]


def _on_packed(x, w13, w2, topk_weights, topk_ids, **options):
    return cpu.fused_moe_packed(x, cpu.pack_moe_weights(w13, w2), topk_weights, topk_ids,
                                **options)


@pytest.fixture(params=CPU_PATHS)
def cpu_moe(request, monkeypatch):
    """kernels.cpu's fused_moe (plain weights) or fused_moe_packed forced down one path; both
    take plain weights here (the packed path packs them first)."""
    if request.param == "fused":
        if cpu.fused_kernels() is None:
            pytest.skip("the fused CPU kernels did not build here")
        monkeypatch.setattr(moe_backend, "_fused_moe_takes", lambda *args: True)
    elif request.param == "packed-grouped":
        monkeypatch.setattr(moe_backend, "fused_kernels", lambda: None)
    return cpu.fused_moe if request.param == "plain" else _on_packed


@pytest.mark.parametrize("hidden, intermediate", [(32, 16), (40, 24), (72, 40)])
def test_packing_round_trips(hidden, intermediate):
    """Every expert unpacked from its slabs is its plain weights again (padding dropped)."""
    weights = random_experts(5, hidden, intermediate, torch.bfloat16, bias=False, seed=11)
    packed = cpu.pack_moe_weights(weights["w13"], weights["w2"])
    assert packed.w13.shape == (5, 2 * -(-intermediate // 16), hidden, 16)
    assert packed.w2.shape == (5, -(-hidden // 16), intermediate, 16)
    for e in range(5):
        w13, w2 = packed.expert(e)
        assert torch.equal(w13, weights["w13"][e]) and torch.equal(w2, weights["w2"][e])


def _case(num_experts, hidden, intermediate, top_k, num_tokens, dtype, bias, only=None, seed=0):
    weights = random_experts(num_experts, hidden, intermediate, dtype, bias=bias, seed=seed)
    topk_weights, topk_ids = random_routing(num_tokens, num_experts, top_k, seed=seed + 1,
                                            only=only)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed + 2))
    return x.to(dtype), weights, topk_weights, topk_ids


def _biases(weights):
    return {k: v for k, v in weights.items() if k.endswith("bias")}


# (experts, hidden, intermediate, top_k, tokens, only): decode rows, a tail past the vector
# width in both dot products (hidden 40, intermediate 24), experts with no token, every token
# on one expert, k = 1, a batch past the kernel's 4-pair chunks.
CPU_CASES = [(8, 32, 24, 2, 1, None), (8, 40, 24, 2, 13, None), (8, 48, 40, 2, 9, 2),
             (4, 64, 32, 1, 5, None), (16, 40, 56, 4, 3, None), (6, 32, 16, 3, 70, 5)]


@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("activation, bias", [("silu", False), ("swigluoai", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_matches_twin_and_reference(cpu_moe, case, activation, bias, dtype):
    num_experts, hidden, intermediate, top_k, num_tokens, only = case
    x, weights, topk_weights, topk_ids = _case(num_experts, hidden, intermediate, top_k,
                                               num_tokens, dtype, bias, only, seed=4)
    options = dict(activation=activation, swiglu_limit=1.5, **_biases(weights))
    out = cpu_moe(x, weights["w13"], weights["w2"], topk_weights, topk_ids, **options)
    assert out.dtype == dtype and out.shape == x.shape
    twin = twins.fused_moe(x, weights["w13"], weights["w2"], topk_weights, topk_ids, **options)
    expected = reference_moe(x, weights["w13"], weights["w2"], topk_weights, topk_ids,
                             **options)
    if dtype == torch.float32:
        torch.testing.assert_close(out, twin, atol=1e-5, rtol=1e-5)
    else:  # the fp32 sums rounded once, as the twin's: at most an ulp or so apart
        torch.testing.assert_close(out.float(), twin.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    if only is not None:
        assert (topk_ids[:, 0] == only).all()
    if num_tokens * top_k < num_experts:
        assert len(topk_ids.unique()) < num_experts  # some expert got no token


def test_cpu_int32_ids_and_strided_x(cpu_moe):
    """Routing ids as int32 (what a top-k on the device may give) and x a strided row view."""
    x, weights, topk_weights, topk_ids = _case(8, 32, 24, 2, 6, torch.float32, True, seed=7)
    wide = torch.randn(6, 50)
    wide[:, 3:35] = x
    out = cpu_moe(wide[:, 3:35], weights["w13"], weights["w2"], topk_weights, topk_ids.int(),
                  **_biases(weights))
    twin = twins.fused_moe(x, weights["w13"], weights["w2"], topk_weights, topk_ids,
                           **_biases(weights))
    torch.testing.assert_close(out, twin, atol=1e-5, rtol=1e-5)


def test_packed_steps_take_the_fused_kernel(monkeypatch):
    """fp32 math: always; native bf16: up to FUSED_MOE_BF16_PAIRS pairs per expert."""
    if cpu.fused_kernels() is None:
        pytest.skip("the fused CPU kernels did not build here")
    called = []
    monkeypatch.setattr(moe_backend, "_fused_moe_grouped", lambda *a: called.append(a))
    monkeypatch.setattr(moe_backend, "FUSED_MOE_BF16_PAIRS", 4)
    monkeypatch.setattr(moe_backend, "compute_dtype", lambda dtype: torch.bfloat16)  # native bf16
    for num_tokens, top_k, num_experts, fused in [
            (16, 2, 8, True), (17, 2, 8, False), (1, 8, 128, True), (64, 2, 64, True),
            (65, 2, 32, False)]:
        called.clear()
        x, weights, topk_weights, topk_ids = _case(num_experts, 32, 16, top_k, num_tokens,
                                                   torch.bfloat16, False)
        _on_packed(x, weights["w13"], weights["w2"], topk_weights, topk_ids)
        assert bool(called) != fused, (num_tokens, top_k, num_experts)
    monkeypatch.setattr(moe_backend, "compute_dtype", lambda dtype: torch.float32)  # fp32 math
    called.clear()
    x, weights, topk_weights, topk_ids = _case(8, 32, 16, 2, 200, torch.bfloat16, False)
    _on_packed(x, weights["w13"], weights["w2"], topk_weights, topk_ids)
    assert not called  # 50 pairs per expert: the fused kernel all the same
    cpu.fused_moe(x, weights["w13"], weights["w2"], topk_weights, topk_ids)
    assert called  # plain weights: the grouped path


def _fused(x, weights, topk_weights, topk_ids, activation="silu"):
    """The fused kernel itself, whatever fused_moe_packed would choose."""
    packed = cpu.pack_moe_weights(weights["w13"], weights["w2"])
    return cpu.fused_kernels().fused_moe_packed(
        x, packed.w13, packed.w2, topk_weights, topk_ids, weights.get("w13_bias"),
        weights.get("w2_bias"), ("silu", "swigluoai").index(activation), 7.0, 1.702,
        packed.intermediate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_cpu_fused_is_batch_and_thread_invariant(dtype, activation):
    """A token's output is computed from its own row only: alone or among others (which
    change how many pairs each expert gets), on one thread or two, the bits are the same."""
    if cpu.fused_kernels() is None:
        pytest.skip("the fused CPU kernels did not build here")
    x, weights, topk_weights, topk_ids = _case(8, 72, 40, 3, 11, dtype, True, only=1, seed=9)
    together = _fused(x, weights, topk_weights, topk_ids, activation)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = _fused(x, weights, topk_weights, topk_ids, activation)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)
    for t in range(x.shape[0]):
        alone = _fused(x[t:t + 1], weights, topk_weights[t:t + 1], topk_ids[t:t + 1], activation)
        assert torch.equal(alone, together[t:t + 1])
    rows = [3, 0, 7]
    some = _fused(x[rows], weights, topk_weights[rows], topk_ids[rows], activation)
    assert torch.equal(some, together[rows])


def test_cpu_fused_refuses_out_of_range_ids():
    ops = cpu.fused_kernels()
    if ops is None:
        pytest.skip("the fused CPU kernels did not build here")
    x, weights, topk_weights, topk_ids = _case(4, 32, 16, 2, 3, torch.float32, False)
    topk_ids[1, 1] = 4
    with pytest.raises(RuntimeError, match="out of range"):
        _fused(x, weights, topk_weights, topk_ids)
    packed = cpu.pack_moe_weights(weights["w13"], weights["w2"])
    with pytest.raises(RuntimeError, match="must be"):  # I that does not match the slabs
        ops.fused_moe_packed(x, packed.w13, packed.w2, topk_weights, topk_ids.clamp(max=3),
                             None, None, 0, 7.0, 1.702, 40)

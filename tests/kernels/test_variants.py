"""The warm-up's variant list covers every launch the attention launcher can make."""

import pytest
import torch

from kernels.attention import plan_launches
from kernels.variants import attention_variants, config_key


def launched_configs(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                     max_query_len: int) -> set[tuple[tuple[str, object], ...]]:
    """The configs a step with this max_query_len launches (one token per query position)."""
    return {config_key(c) for c, _ in plan_launches(dtype, num_heads, num_kv_heads, head_dim,
                                                    max_query_len, 1, max_query_len)}


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", [
    (torch.bfloat16, 32, 8, 128), (torch.float16, 14, 2, 64), (torch.float32, 4, 2, 16),
    (torch.bfloat16, 8, 8, 80)])
@pytest.mark.parametrize("budget", [8, 2048])
def test_every_max_query_len_maps_onto_a_warmed_variant(dtype, heads, kv_heads, head_dim, budget):
    variants = attention_variants(dtype, heads, kv_heads, head_dim, budget)
    configs = {v.config for v in variants}
    assert {(v.config, v.split) for v in variants} == {(c, s) for c in configs
                                                        for s in (False, True)}
    launched = set()
    for q in range(1, budget + 1):
        launched |= launched_configs(dtype, heads, kv_heads, head_dim, q)
    assert launched == configs, "a launch the warm-up misses, or a variant no step launches"
    for v in variants:  # each variant's own max_query_len brings its launch in
        assert v.config in launched_configs(dtype, heads, kv_heads, head_dim, v.max_query_len)


@pytest.mark.parametrize("num_splits", [1, 3, 16, 17, 40])
def test_merge_splits_matches_a_float64_merge(device, num_splits):
    """The merge walks its splits in blocks: counts past one block, empty splits (lse -inf,
    partial garbage) weigh nothing, a row with no split at all gets zeros."""
    pytest.importorskip("triton")
    from kernels.attention_reduce import merge_splits

    gen = torch.Generator().manual_seed(num_splits)
    tokens, heads, dim = 3, 2, 40
    partial = torch.randn(tokens, heads, num_splits, dim, generator=gen)
    lse = torch.randn(tokens, heads, num_splits, generator=gen) * 4
    lse[0, 0, ::2] = float("-inf")  # empty splits
    partial[0, 0, ::2] = float("nan")  # never read
    lse[1, 1] = float("-inf")  # no key anywhere: zeros
    out = torch.full((tokens, heads, dim), float("nan"), device=device)
    merge_splits(partial.to(device), lse.to(device), out)
    w = torch.exp2(lse.double() - lse.double().amax(-1, keepdim=True).nan_to_num(0, 0, 0))
    w = torch.where(lse == float("-inf"), 0.0, w)
    total = w.sum(-1, keepdim=True)
    p = torch.where((lse == float("-inf"))[..., None], 0.0, partial.double())
    expected = (p * w[..., None]).sum(-2) / torch.where(total == 0, 1.0, total)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)


def test_merge_compiles_once_for_every_split_count(monkeypatch):
    """The merge's constexprs do not depend on the split count (one compile per model)."""
    pytest.importorskip("triton")
    from kernels import attention_reduce

    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **constexprs: seen.append(constexprs)

    monkeypatch.setattr(attention_reduce, "_merge_splits_kernel", Recorder())
    for splits in (2, 5, 33, 64):
        attention_reduce.merge_splits(torch.zeros(1, 2, splits, 64), torch.zeros(1, 2, splits),
                                      torch.zeros(1, 2, 64))
    assert all(c == seen[0] for c in seen) and "SPLITS_BLOCK" in seen[0]

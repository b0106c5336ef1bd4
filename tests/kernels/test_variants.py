"""The warm-up's variant list covers every launch the attention launcher can make."""

import pytest
import torch

from kernels.variants import attention_variants, launched_configs


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

"""The warm-up's variant list covers every config the attention launcher can pick."""

import pytest
import torch

from kernels.attention import launch_config
from kernels.variants import attention_variants


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", [
    (torch.bfloat16, 32, 8, 128), (torch.float16, 14, 2, 64), (torch.float32, 4, 2, 16),
    (torch.bfloat16, 8, 8, 80)])
def test_every_max_query_len_maps_onto_a_warmed_variant(dtype, heads, kv_heads, head_dim):
    budget = 2048
    variants = attention_variants(dtype, heads, kv_heads, head_dim, budget)
    configs = {v.config for v in variants}
    assert {(v.config, v.split) for v in variants} == {(c, s) for c in configs
                                                        for s in (False, True)}
    for q in range(1, budget + 1):
        assert tuple(sorted(launch_config(dtype, heads, kv_heads, head_dim, q).items())) in configs
    for v in variants:  # each variant's own max_query_len selects it
        assert tuple(sorted(launch_config(dtype, heads, kv_heads, head_dim,
                                          v.max_query_len).items())) == v.config

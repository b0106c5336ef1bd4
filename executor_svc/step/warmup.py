"""Compile every attention kernel variant at start-up (CUDA), so no request pays for a JIT.

Each variant of kernels/variants.py runs once on a one-sequence batch over the model's bound
KV cache (block 0, one key), with the grid sized by the variant's max_query_len, the split
forced on or off and the model's softcap/sinks flags; a progress bar shows the compiles. The
other kernels (store_kv, rms_norm, rotary, silu_and_mul) have one variant per model, compiled by
the first forward.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from executor_svc.kv.kv_cache import LayerKV
from kernels.attention import paged_attention
from kernels.variants import attention_variants


def warm_attention(layer: LayerKV, num_heads: int, max_num_batched_tokens: int,
                   show_progress: bool = True, *, dtype: torch.dtype,
                   softcap: bool = False, sinks: bool = False) -> int:
    """Launch every variant once; returns how many. layer: one layer's cache (a quantized
    one with its scales); dtype: the model's (q's); softcap, sinks: whether the model caps
    its scores / has attention sinks (a sliding window is a runtime value and needs no
    variant)."""
    k_cache, v_cache, k_scale, v_scale = layer
    _, _, num_kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    variants = attention_variants(dtype, num_heads, num_kv_heads, head_dim, max_num_batched_tokens,
                                  softcap=softcap, sinks=sinks)  # fmt: skip
    sink_logits = torch.zeros(num_heads, dtype=torch.float32, device=device)
    q = torch.zeros((1, num_heads, head_dim), dtype=dtype, device=device)
    block_tables = torch.zeros((1, 1), dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
    for v in tqdm(variants, desc="compiling attention kernels", disable=not show_progress):
        paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                        v.max_query_len, 1, 1.0, num_splits=2 if v.split else 1,
                        softcap=1.0 if v.softcap else 0.0, sinks=sink_logits if v.sinks else None,
                        k_scale=k_scale, v_scale=v_scale)
    return len(variants)

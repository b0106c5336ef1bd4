"""The attention kernel's compiled variants for one model: what a warm-up compiles.

A variant is the launcher's `launch_config` (constexprs and launch options) plus whether it
splits the key range. The config depends on the step only through `max_query_len`, in powers of
two (BLOCK_M saturates at the largest tile), so the variants of a model are those of
max_query_len = 1, 2, 4, ... up to the step's token budget, each with and without a split.
Enumerating from `launch_config` itself keeps this list and the launcher from drifting apart;
tests/kernels/test_variants.py checks every max_query_len maps onto the list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.attention import launch_config


@dataclass(frozen=True)
class AttentionVariant:
    max_query_len: int  # the smallest that selects this config
    split: bool
    config: tuple[tuple[str, object], ...]  # launch_config's items, sorted


def attention_variants(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                       max_num_batched_tokens: int) -> list[AttentionVariant]:
    seen: dict[tuple, int] = {}
    q = 1
    while True:
        key = tuple(sorted(launch_config(dtype, num_heads, num_kv_heads, head_dim, q).items()))
        seen.setdefault(key, q)
        if q >= max_num_batched_tokens:
            break
        q = min(2 * q, triton.next_power_of_2(max_num_batched_tokens))
    return [AttentionVariant(q, split, key) for key, q in seen.items() for split in (False, True)]

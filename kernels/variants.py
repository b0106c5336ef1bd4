"""The attention kernel's compiled variants for one model: what a warm-up compiles.

A launch of the attention kernel is the short one (one 16-row block per sequence) or the long
one (the flattened grid of wide query blocks), each with or without splitting the key range;
every per-step value and the sliding window are `do_not_specialize`, so these four (two when the
token budget never exceeds the short launch's rows) are all the kernel's compiles for a model.
A model's logit soft-capping and attention sinks are compile-time flags of every one of them
(the same for all its layers; sinks of split launches are added by the merge, which then
compiles with them). They are built from the launcher's own `launch_config`;
tests/kernels/test_variants.py checks that the launches `plan_launches` makes for every
max_query_len are exactly this list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import launch_config


@dataclass(frozen=True)
class AttentionVariant:
    max_query_len: int  # the smallest that brings this launch into a step
    split: bool
    config: tuple[tuple[str, object], ...]  # launch_config's items, sorted
    softcap: bool = False  # the model caps its scores (any softcap > 0 compiles the same)
    sinks: bool = False  # the model has attention sinks


def config_key(config: dict) -> tuple[tuple[str, object], ...]:
    return tuple(sorted(config.items()))


def attention_variants(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                       max_num_batched_tokens: int, *, softcap: bool = False,
                       sinks: bool = False) -> list[AttentionVariant]:
    short = launch_config(dtype, num_heads, num_kv_heads, head_dim, long=False)
    firsts = {config_key(short): 1}
    if max_num_batched_tokens > short["BLOCK_Q"]:
        long = launch_config(dtype, num_heads, num_kv_heads, head_dim, long=True)
        firsts.setdefault(config_key(long), short["BLOCK_Q"] + 1)
    return [AttentionVariant(q, split, key, softcap, sinks)
            for key, q in firsts.items() for split in (False, True)]  # fmt: skip

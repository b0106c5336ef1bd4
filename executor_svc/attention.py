"""Attention backends: where a layer's new K/V are stored and how paged attention runs.

A model layer owns its slice of the KV cache (bound once at start-up by `bind_kv_cache`) and calls
its backend with this step's q/k/v and the batch metadata. The `kernels` ops dispatch on the
tensors' device: Triton on CUDA, the torch twins on the CPU, so one backend serves both today;
the interface leaves room for others (e.g. a FlashAttention-based one).
"""

from __future__ import annotations

from typing import Protocol

import torch

from executor_svc.batch import BatchMetadata
from kernels import paged_attention, store_kv


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, batch: BatchMetadata,
                scale: float) -> torch.Tensor: ...


class PagedKernelsBackend:
    """store_kv then paged_attention, both from `kernels`."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, batch: BatchMetadata,
                scale: float) -> torch.Tensor:
        # q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim]
        store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        return paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                               batch.query_start_loc, batch.max_query_len, batch.max_seq_len,
                               scale)  # [num_tokens, num_heads, head_dim]


def default_backend() -> AttentionBackend:
    return PagedKernelsBackend()

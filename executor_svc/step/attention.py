"""Attention backends: where a layer's new K/V are stored and how paged attention runs.

A model layer owns its slice of the KV cache (bound once at start-up by `bind_kv_cache`) and calls
its backend with this step's q/k/v and the batch metadata. The `kernels` ops dispatch on the
tensors' device: Triton on CUDA, kernels/cpu/ on the CPU (the twins with FOLIO_KERNELS=torch).

On the CPU backend the per-step bookkeeping (which rows decode, their gather index and length
mask) is built once per step and KV group, by the group's first layer, and reused by the
others: one backend instance serves every layer of a model (the loader builds one), and it
remembers, per group, the plan of the last batch it saw. `BatchMetadata` is frozen and built
fresh every step (its per-group views once per step), so identity is the step's key.
"""

from __future__ import annotations

from typing import Protocol

import torch

from executor_svc.step.batch import BatchMetadata
from kernels import cpu, cpu_backend_active, paged_attention, store_kv


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, batch: BatchMetadata,
                scale: float, *, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor: ...


class PagedKernelsBackend:
    """store_kv then paged_attention, both from `kernels`."""

    def __init__(self) -> None:
        # Invariant: _plans[g] = (batch, plan built from it) for KV group g; the batch object
        # itself is kept alive here so its id cannot be reused by a later step's batch.
        self._plans: dict[int, tuple[BatchMetadata, cpu.AttentionPlan]] = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, batch: BatchMetadata,
                scale: float, *, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
        # q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim];
        # k_scale, v_scale: a quantized cache's [num_blocks, block_size, num_kv_heads] fp32.
        store_kv(k, v, k_cache, v_cache, batch.slot_mapping, k_scale, v_scale)
        variant = dict(window=window, softcap=softcap, sinks=sinks, k_scale=k_scale,
                       v_scale=v_scale)
        if cpu_backend_active(q):  # every variant; one plan serves layers of any window
            plan = self._cpu_plan(batch, k_cache.shape[1])
            return cpu.paged_attention_planned(q, k, v, k_cache, v_cache, plan, scale, **variant)
        return paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                               batch.query_start_loc, batch.max_query_len, batch.max_seq_len,
                               scale, **variant)  # [num_tokens, num_heads, head_dim]

    def _cpu_plan(self, batch: BatchMetadata, block_size: int) -> cpu.AttentionPlan:
        cached = self._plans.get(batch.kv_group)
        if cached is None or cached[0] is not batch:
            plan = cpu.plan_attention(batch.block_tables, batch.seq_lens,
                                      batch.query_start_loc, block_size)
            self._plans[batch.kv_group] = cached = (batch, plan)
        return cached[1]


def default_backend() -> AttentionBackend:
    return PagedKernelsBackend()

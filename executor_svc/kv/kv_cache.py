"""The paged KV cache: k and v tensors of blocks the scheduler hands out, one pair per slot of
the model's KV layout (kv/groups.py: one per layer when all layers attend alike, else one per
layer of a group, each shared by the layers at that place in every group).

Layout per slot (both k and v)::

    [num_blocks, block_size, num_kv_heads, head_dim]
      block 0: | tok 0 | tok 1 | ... | tok block_size-1 |
      block 1: | ...                                    |

A token's slot is ``block_id * block_size + offset``. The executor never chooses blocks: every
block id it touches comes from the scheduler's plan.

Tensor parallel: each rank's cache holds only its own KV heads (``local_kv_heads``: num_kv_heads
/ tp, or one replicated head), so ``num_kv_heads`` above is per rank and `bytes_per_block` is one
rank's bytes; block ids mean the same blocks on every rank (one plan drives them all).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import structlog
import torch

from executor_svc.kv.groups import KVLayout, kv_layout
from executor_svc.loading.model_config import ModelConfig, local_kv_heads
from executor_svc.parallel.distributed import tp_size

log = structlog.get_logger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB when --kv-cache-memory is not given on the CPU


def to_device(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on `device` without blocking the host: through pinned memory with a
    non_blocking copy on CUDA (torch's pinned allocator keeps the buffer until the copy is
    done), the array's own memory on the CPU."""
    t = torch.from_numpy(np.ascontiguousarray(host))
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def model_kv_layout(cfg: ModelConfig) -> KVLayout:
    return kv_layout(cfg.layer_windows)


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V, every slot (layer of a group), one block: this rank's KV heads (all of them
    with one rank)."""
    elem = torch.empty((), dtype=dtype).element_size()
    num_kv_heads = local_kv_heads(cfg, tp_size())
    slots = model_kv_layout(cfg).group_size
    return 2 * slots * block_size * num_kv_heads * cfg.head_dim * elem


def num_blocks_for(cfg: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                   num_kv_blocks: int | None, kv_cache_memory: int | None,
                   profiled_budget: int | None = None, extra_bytes_per_block: int = 0) -> int:
    """How many blocks to allocate: the explicit count, else what the memory budget holds:
    --kv-cache-memory, else on CUDA what the profiling step left (memory.py), else 1 GiB.
    `extra_bytes_per_block`: another cache with the same blocks (a draft model's) shares it."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    per_block = bytes_per_block(cfg, block_size, dtype) + extra_bytes_per_block
    if kv_cache_memory is not None:
        budget = kv_cache_memory
    elif device.type == "cuda":
        assert profiled_budget is not None, "CUDA sizing needs the profiling step's budget"
        budget = profiled_budget
    else:
        budget = CPU_DEFAULT_KV_BYTES
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"the KV cache budget of {budget} bytes holds no block of "
                         f"{per_block} bytes; raise --kv-cache-memory or set --num-kv-blocks")
    return num_blocks


@dataclass
class KVCache:
    """Invariant: all tensors share one shape; block ids index dim 0 of every one of them."""

    k_caches: list[torch.Tensor]  # per slot [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor]
    layout: KVLayout | None = None  # None: one full-attention group, a slot per layer

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = kv_layout((0,) * len(self.k_caches))
        assert self.layout.group_size == len(self.k_caches) == len(self.v_caches)

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> KVCache:
        layout = model_kv_layout(cfg)
        shape = (num_blocks, block_size, local_kv_heads(cfg, tp_size()), cfg.head_dim)
        # Zeros, not empty: a stale NaN in an unused slot must never reach a masked softmax.
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.group_size)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.group_size)]
        log.info("KV cache allocated", num_blocks=num_blocks, block_size=block_size,
                 bytes=num_blocks * bytes_per_block(cfg, block_size, dtype),
                 kv_groups=layout.num_groups, windows=list(layout.windows))
        return cls(k, v, layout)

    @property
    def num_blocks(self) -> int:
        return self.k_caches[0].shape[0]

    def bind(self, model) -> None:
        """Give each of the model's layers its tensors and KV group (`bind_kv_cache`)."""
        assert self.layout is not None
        model.bind_kv_cache(self.per_layer(), self.layout.layer_group)

    def per_layer(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (k_cache, v_cache): its slot's tensors."""
        assert self.layout is not None
        return [(self.k_caches[s], self.v_caches[s]) for s in self.layout.layer_slot]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst becomes a copy of block src, in every layer."""
        if not pairs:
            return
        device = self.k_caches[0].device
        src = to_device(np.array([s for s, _ in pairs], np.int64), device)
        dst = to_device(np.array([d for _, d in pairs], np.int64), device)
        for cache in (*self.k_caches, *self.v_caches):
            cache.index_copy_(0, dst, cache.index_select(0, src))

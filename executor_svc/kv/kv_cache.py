"""The paged KV cache: k and v tensors of blocks the scheduler hands out, one pair per slot of
the model's KV layout (kv/groups.py: one per layer when all layers attend alike, else one per
layer of a group, each shared by the layers at that place in every group).

Layout per slot (both k and v)::

    [num_blocks, block_size, num_kv_heads, head_dim]
      block 0: | tok 0 | tok 1 | ... | tok block_size-1 |
      block 1: | ...                                    |

A token's slot is ``block_id * block_size + offset``. The executor never chooses blocks: every
block id it touches comes from the scheduler's plan.

Quantized (--kv-cache-dtype fp8 | int8, kernels/kv_quant.py): the tensors hold codes, and the
kernels get each layer's fp32 scales [num_blocks, block_size, num_kv_heads]: int8's are tensors
per slot beside k and v, written as K/V are stored and indexed by block id like them (copied,
swapped, counted in `bytes_per_block`); fp8's are each layer's static per-head scales (from the
checkpoint or 1.0) seen through stride-0 views, which no block operation touches.

Tensor parallel: each rank's cache holds only its own KV heads (``local_kv_heads``: num_kv_heads
/ tp, or one replicated head), so ``num_kv_heads`` above is per rank and `bytes_per_block` is one
rank's bytes; block ids mean the same blocks on every rank (one plan drives them all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import structlog
import torch

from executor_svc.kv.groups import KVLayout, kv_layout
from executor_svc.loading.model_config import ModelConfig, local_kv_heads
from executor_svc.parallel.distributed import tp_size
from kernels import kv_quant

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


def as_moved(t: torch.Tensor) -> torch.Tensor:
    """`t` as the block operations (copy-on-write, swap, the host tier) move it: a float8
    tensor as its bytes, a uint8 view of the same shape, since torch's CPU index_copy_ has no
    float8 kernel; moving bits is exact for every dtype."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def model_kv_layout(cfg: ModelConfig) -> KVLayout:
    return kv_layout(cfg.layer_windows)


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V, every slot (layer of a group), one block: this rank's KV heads (all of them
    with one rank). `dtype`: the cache's (int8 adds its fp32 scale per head row)."""
    num_kv_heads = local_kv_heads(cfg, tp_size())
    slots = model_kv_layout(cfg).group_size
    row = cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    if kv_quant.dynamic_scales(dtype):
        row += 4
    return 2 * slots * block_size * num_kv_heads * row


class LayerKV(NamedTuple):
    """One layer's view of the cache, what `bind_kv_cache` gives its attention."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads] fp32
    v_scale: torch.Tensor | None = None  # (quantized caches only)


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
    """Invariant: all k/v tensors share one shape and dtype; block ids index dim 0 of every
    one of them and of the int8 scale tensors (`block_tensors`). A quantized cache has its
    scales: `k_scales`/`v_scales` per slot (int8) or `static_scales` per layer (fp8)."""

    k_caches: list[torch.Tensor]  # per slot [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor]
    layout: KVLayout | None = None  # None: one full-attention group, a slot per layer
    k_scales: list[torch.Tensor] | None = None  # int8: per slot [num_blocks, block_size, H]
    v_scales: list[torch.Tensor] | None = None
    static_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # fp8: per layer [H]

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = kv_layout((0,) * len(self.k_caches))
        assert self.layout.group_size == len(self.k_caches) == len(self.v_caches)
        dtype = self.k_caches[0].dtype
        if kv_quant.dynamic_scales(dtype):
            assert self.k_scales is not None and self.v_scales is not None
            assert len(self.k_scales) == len(self.v_scales) == len(self.k_caches)
        elif kv_quant.is_quantized(dtype):
            assert self.static_scales is not None
            assert len(self.static_scales) == len(self.layout.layer_slot)

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device,
                 static_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 ) -> KVCache:
        """`dtype`: the cache's (the model's, or fp8/int8); fp8 needs `static_scales`, per
        layer (k_scale, v_scale) [local KV heads] (kv/kv_scales.py)."""
        layout = model_kv_layout(cfg)
        shape = (num_blocks, block_size, local_kv_heads(cfg, tp_size()), cfg.head_dim)
        # Zeros, not empty: a stale NaN in an unused slot must never reach a masked softmax.
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.group_size)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.group_size)]
        k_scales = v_scales = None
        if kv_quant.dynamic_scales(dtype):
            k_scales = [torch.zeros(shape[:3], device=device) for _ in range(layout.group_size)]
            v_scales = [torch.zeros(shape[:3], device=device) for _ in range(layout.group_size)]
        elif kv_quant.is_quantized(dtype):
            assert static_scales is not None, "an fp8 cache needs its static scales"
            static_scales = [(ks.to(device), vs.to(device)) for ks, vs in static_scales]
        else:
            static_scales = None
        log.info("KV cache allocated", num_blocks=num_blocks, block_size=block_size,
                 bytes=num_blocks * bytes_per_block(cfg, block_size, dtype),
                 kv_cache_dtype=str(dtype).removeprefix("torch."),
                 kv_groups=layout.num_groups, windows=list(layout.windows))
        return cls(k, v, layout, k_scales, v_scales, static_scales)

    @property
    def dtype(self) -> torch.dtype:
        return self.k_caches[0].dtype

    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block id: k slots, v slots, then int8's scales."""
        return [*self.k_caches, *self.v_caches, *(self.k_scales or ()), *(self.v_scales or ())]

    @property
    def num_blocks(self) -> int:
        return self.k_caches[0].shape[0]

    def bind(self, model) -> None:
        """Give each of the model's layers its tensors and KV group (`bind_kv_cache`)."""
        assert self.layout is not None
        model.bind_kv_cache(self.per_layer(), self.layout.layer_group)

    def per_layer(self) -> list[LayerKV]:
        """Each layer's cache: its slot's tensors, and its scales when quantized."""
        assert self.layout is not None
        layers = []
        for layer, s in enumerate(self.layout.layer_slot):
            k, v = self.k_caches[s], self.v_caches[s]
            if self.k_scales is not None and self.v_scales is not None:
                layers.append(LayerKV(k, v, self.k_scales[s], self.v_scales[s]))
            elif self.static_scales is not None:
                ks, vs = self.static_scales[layer]
                layers.append(LayerKV(k, v, kv_quant.static_scale_view(ks, *k.shape[:2]),
                                      kv_quant.static_scale_view(vs, *k.shape[:2])))
            else:
                layers.append(LayerKV(k, v))
        return layers

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst becomes a copy of block src, in every layer."""
        if not pairs:
            return
        device = self.k_caches[0].device
        src = to_device(np.array([s for s, _ in pairs], np.int64), device)
        dst = to_device(np.array([d for _, d in pairs], np.int64), device)
        for cache in map(as_moved, self.block_tensors()):
            cache.index_copy_(0, dst, cache.index_select(0, src))

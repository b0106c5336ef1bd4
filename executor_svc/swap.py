"""The CPU swap pool: KV blocks parked in host memory while their request is swapped out.

Layout per layer (k and v), the device cache's block layout with its own block ids::

    device KVCache  [num_blocks,      block_size, num_kv_heads, head_dim]   (GPU, or CPU backend)
    SwapPool        [num_swap_blocks, block_size, num_kv_heads, head_dim]   (host memory)

The scheduler owns both id spaces. A plan's ``swap_out`` pairs are (device block, cpu block)
and ``swap_in`` pairs (cpu block, device block). Each direction moves all its blocks with one
gather and one scatter per layer tensor (``index_select`` / ``index_copy_``)::

    swap out: device gather -> async copy into pinned staging -> one sync -> host scatter (pool)
    swap in:  host gather (pool) into pinned staging -> async copy -> device scatter

Only the staging buffer is pinned (page-locked) on CUDA: the scattered block ids make the pool
itself gather/scatter on the host anyway, so pinning the whole pool would lock GiBs of host
memory (which torch's pinned allocator also rounds up to a power of two) for no faster copy.

Within a step the runner applies: swap_out, then swap_in, then block_copies, then the forward
pass. So a device block freed by swap-out may be the destination of a swap-in in the same plan,
but a cpu block must not be both a swap-in source and a swap-out destination of one plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from executor_svc.kv_cache import KVCache

log = structlog.get_logger(__name__)

GIB = 1 << 30


def num_swap_blocks_for(swap_space_gib: float, bytes_per_block: int) -> int:
    """Blocks that `--swap-space` GiB hold (0 = no swap pool)."""
    if swap_space_gib <= 0:
        return 0
    budget = int(swap_space_gib * GIB)
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"--swap-space {swap_space_gib} GiB holds no KV block of "
                         f"{bytes_per_block} bytes; raise it or set it to 0 (no swapping)")
    return num_blocks


@dataclass
class SwapPool:
    """Invariant: every tensor has the device cache's block shape and dtype, on the host, and
    `num_blocks` rows; block ids index dim 0 of every one of them."""

    k_caches: list[torch.Tensor]  # per layer [num_swap_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor]
    pin_staging: bool  # page-locked staging, so copies to and from CUDA run asynchronously

    @classmethod
    def allocate(cls, like: KVCache, num_blocks: int) -> SwapPool:
        proto = like.k_caches[0]
        shape = (num_blocks, *proto.shape[1:])
        # Zeros like the device cache: a swapped-in slot past a request's last token must not
        # carry a NaN into a masked softmax.
        k = [torch.zeros(shape, dtype=proto.dtype) for _ in like.k_caches]
        v = [torch.zeros(shape, dtype=proto.dtype) for _ in like.v_caches]
        log.info("CPU swap pool allocated", num_swap_blocks=num_blocks,
                 bytes=2 * len(k) * k[0].numel() * k[0].element_size())
        return cls(k, v, pin_staging=proto.device.type == "cuda")

    @property
    def num_blocks(self) -> int:
        return self.k_caches[0].shape[0]

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.k_caches, *self.v_caches]

    def _staging(self, num_tensors: int, num_moved: int) -> torch.Tensor:
        # torch's pinned-memory allocator caches freed buffers and keeps one alive until the
        # async copies that read or write it have finished, so a fresh buffer per call is cheap
        # and safe.
        proto = self.k_caches[0]
        return torch.empty((num_tensors, num_moved, *proto.shape[1:]), dtype=proto.dtype,
                           pin_memory=self.pin_staging)  # [2 * num_layers, num_moved, ...]

    def swap_out(self, kv_cache: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy device block d into pool block c for every (d, c) in `pairs`, in every layer."""
        if not pairs:
            return
        device_tensors = [*kv_cache.k_caches, *kv_cache.v_caches]
        device = device_tensors[0].device
        src = torch.tensor([d for d, _ in pairs], dtype=torch.long).to(device)  # [num_moved]
        dst = torch.tensor([c for _, c in pairs], dtype=torch.long)  # [num_moved], host
        staging = self._staging(len(device_tensors), len(pairs))
        for i, cache in enumerate(device_tensors):
            staging[i].copy_(cache.index_select(0, src), non_blocking=True)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the host reads staging next
        for i, pool in enumerate(self._tensors()):
            pool.index_copy_(0, dst, staging[i])

    def swap_in(self, kv_cache: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy pool block c into device block d for every (c, d) in `pairs`, in every layer."""
        if not pairs:
            return
        device_tensors = [*kv_cache.k_caches, *kv_cache.v_caches]
        device = device_tensors[0].device
        src = torch.tensor([c for c, _ in pairs], dtype=torch.long)  # [num_moved], host
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long).to(device)  # [num_moved]
        staging = self._staging(len(device_tensors), len(pairs))
        for i, pool in enumerate(self._tensors()):
            torch.index_select(pool, 0, src, out=staging[i])
        # Stream-ordered: the forward pass that reads these blocks runs after the copies.
        for i, cache in enumerate(device_tensors):
            cache.index_copy_(0, dst, staging[i].to(device, non_blocking=True))

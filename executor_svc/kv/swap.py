"""The CPU swap pool: KV blocks parked in host memory while their request is swapped out.

Layout: one host tensor, block-major, so a pool block holds every layer's K and V contiguously::

    device KVCache (per layer, k and v)  [num_blocks, block_size, num_kv_heads, head_dim]
    SwapPool.blocks                      [num_swap_blocks, 2 * num_layers, block_size,
                                          num_kv_heads, head_dim]   (k layers, then v layers)
    SwapPool.scales (int8 KV only)       [num_swap_blocks, 2 * num_layers, block_size,
                                          num_kv_heads] fp32        (their scales, alike)

An fp8 cache's static scales belong to the layers, not to blocks, and never move.

The scheduler owns both id spaces. A plan's ``swap_out`` pairs are (device block, cpu block)
and ``swap_in`` pairs (cpu block, device block). The host never touches the pool's contents:
each direction is a device gather/scatter plus one copy per run of consecutive pool ids::

    swap out: device gather [n, 2L, ...] -> async copies into the pool's runs
    swap in:  async copies from the pool's runs into [n, 2L, ...] -> device scatter

On CUDA the pool is page-locked in place (cudaHostRegister: exactly its size, where torch's
pinned allocator would round up to a power of two), so every copy is asynchronous, and both
directions run on a side stream ordered with the compute stream by events: the side stream
first waits for the work already queued (the blocks' last writes); the compute stream waits for
a swap-out's gather (the freed blocks may be rewritten next) but not for its copies to the
host, and for a swap-in's scatter (the forward reads those blocks). Nothing blocks the host.
A pool block written by a swap-out is read by a later swap-in on the same stream, in order.

Within a step the runner applies: swap_out, then swap_in, then block_copies, then the forward
pass. So a device block freed by swap-out may be the destination of a swap-in in the same plan,
but a cpu block must not be both a swap-in source and a swap-out destination of one plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from executor_svc.kv.kv_cache import KVCache, as_moved, to_device

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


def pin_in_place(t: torch.Tensor) -> None:
    """Page-lock a host tensor's memory for the process's lifetime (CUDA only)."""
    res = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    torch.cuda.check_error(res)


def _runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """(start in ids, first id, length) of each run of consecutive values in sorted `ids`."""
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(ids)])))
    return [(int(s), int(ids[s]), int(n)) for s, n in zip(starts, lengths, strict=True)]


def _pinned_side_stream(device: torch.device, *host: torch.Tensor | None
                        ) -> torch.cuda.Stream | None:
    """On CUDA: page-lock the host tensors in place and return the side stream their copies
    run on; elsewhere None (the CPU backend copies on its own thread)."""
    if device.type != "cuda":
        return None
    for t in host:
        if t is not None:
            pin_in_place(t)
    return torch.cuda.Stream(device)


@dataclass
class SwapPool:
    """Invariant: `blocks` is on the host with the device cache's dtype and block shape;
    dim 1 holds the k layers then the v layers; block ids index dim 0. `scales` (an int8
    cache's) likewise holds the k then v slots' scales of the same blocks."""

    blocks: torch.Tensor  # [num_swap_blocks, 2 * num_layers, block_size, num_kv_heads, head_dim]
    stream: torch.cuda.Stream | None  # the side stream (CUDA), else None
    scales: torch.Tensor | None = None  # [num_swap_blocks, 2 * num_layers, block_size, H] fp32

    @classmethod
    def allocate(cls, like: KVCache, num_blocks: int, what: str = "CPU swap pool") -> SwapPool:
        proto = like.k_caches[0]
        shape = (num_blocks, 2 * len(like.k_caches), *proto.shape[1:])
        # Zeros like the device cache: a swapped-in slot past a request's last token must not
        # carry a NaN into a masked softmax.
        blocks = torch.zeros(shape, dtype=proto.dtype)
        scales = torch.zeros(shape[:-1]) if like.k_scales is not None else None
        stream = _pinned_side_stream(proto.device, blocks, scales)
        size = sum(t.numel() * t.element_size() for t in (blocks, scales) if t is not None)
        log.info(f"{what} allocated", num_blocks=num_blocks, bytes=size,
                 pinned=stream is not None)
        return cls(blocks, stream, scales)

    def _parts(self, kv_cache: KVCache) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """(host tensor, the device tensors its dim 1 holds) for the codes and the scales,
        as their moves see them (`as_moved`: fp8 codes as bytes)."""
        caches = [*kv_cache.k_caches, *kv_cache.v_caches]
        parts = [(as_moved(self.blocks), [as_moved(t) for t in caches])]
        if self.scales is not None:
            assert kv_cache.k_scales is not None and kv_cache.v_scales is not None
            parts.append((self.scales, [*kv_cache.k_scales, *kv_cache.v_scales]))
        return parts

    @classmethod
    def in_buffer(cls, like: KVCache, buffer: memoryview, what: str,
                  scales: memoryview | None = None) -> SwapPool:
        """A pool whose blocks are a view of `buffer` and, for an int8 cache, whose scales are
        a view of `scales` (a tier file's shared memory, exactly num_blocks whole blocks of
        each), contents as they are."""
        proto = like.k_caches[0]
        block_shape = (2 * len(like.k_caches), *proto.shape[1:])
        elems = proto.element_size() * torch.Size(block_shape).numel()
        if len(buffer) % elems:
            raise ValueError(f"{what}: {len(buffer)} bytes are not whole KV blocks of "
                             f"{elems} bytes")
        blocks = torch.frombuffer(buffer, dtype=proto.dtype).view(-1, *block_shape)
        scale_view = None
        if like.k_scales is not None:
            if scales is None or len(scales) != blocks.shape[0] * cls.scale_bytes(like):
                raise ValueError(f"{what}: an int8 KV cache needs the scales of its "
                                 f"{blocks.shape[0]} blocks beside them")
            scale_view = torch.frombuffer(scales, dtype=torch.float32).view(
                -1, *block_shape[:-1])  # [num_blocks, 2 * num_layers, block_size, H]
        stream = _pinned_side_stream(proto.device, blocks, scale_view)
        log.info(f"{what} mapped", num_blocks=blocks.shape[0], pinned=stream is not None)
        return cls(blocks, stream, scale_view)

    @staticmethod
    def block_bytes(like: KVCache) -> int:
        """Bytes one pool block takes: every layer's K and V of one device block."""
        proto = like.k_caches[0]
        return 2 * len(like.k_caches) * proto[0].numel() * proto.element_size()

    @staticmethod
    def scale_bytes(like: KVCache) -> int:
        """Bytes of one pool block's scales: an int8 cache's per-position K and V scales of
        every layer; 0 for any other cache."""
        if like.k_scales is None:
            return 0
        proto = like.k_scales[0]
        return 2 * len(like.k_scales) * proto[0].numel() * proto.element_size()

    def copy_done_event(self) -> torch.cuda.Event | None:
        """An event completing with every copy queued so far (None on the CPU: they are done)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def k_caches(self) -> list[torch.Tensor]:  # views, per layer [num_swap_blocks, ...]
        return [self.blocks[:, i] for i in range(self.blocks.shape[1] // 2)]

    @property
    def v_caches(self) -> list[torch.Tensor]:
        half = self.blocks.shape[1] // 2
        return [self.blocks[:, half + i] for i in range(half)]

    @contextlib.contextmanager
    def _on_side_stream(self, device: torch.device) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            yield

    def _compute_waits(self, device: torch.device) -> None:
        """The compute stream waits for what the side stream has queued so far."""
        if self.stream is not None:
            torch.cuda.current_stream(device).wait_stream(self.stream)

    def swap_out(self, kv_cache: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy device block d into pool block c for every (d, c) in `pairs`, in every layer."""
        if not pairs:
            return
        device = kv_cache.k_caches[0].device
        order = sorted(pairs, key=lambda p: p[1])  # by pool id, so runs are contiguous
        cpu_ids = np.array([c for _, c in order], dtype=np.int64)
        src = to_device(np.array([d for d, _ in order], np.int64), device)  # [num_moved]
        with self._on_side_stream(device):
            gathered = [(host, torch.stack([t.index_select(0, src) for t in tensors], dim=1))
                        for host, tensors in self._parts(kv_cache)]
            self._compute_waits(device)  # the freed blocks may be rewritten after the gather
            for host, moved in gathered:
                for start, first, n in _runs(cpu_ids):
                    host[first:first + n].copy_(moved[start:start + n], non_blocking=True)

    def swap_in(self, kv_cache: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy pool block c into device block d for every (c, d) in `pairs`, in every layer."""
        if not pairs:
            return
        device = kv_cache.k_caches[0].device
        order = sorted(pairs)  # by pool id
        cpu_ids = np.array([c for c, _ in order], dtype=np.int64)
        dst = to_device(np.array([d for _, d in order], np.int64), device)  # [num_moved]
        with self._on_side_stream(device):
            for host, tensors in self._parts(kv_cache):
                staging = torch.empty((len(order), *host.shape[1:]), dtype=host.dtype,
                                      device=device)  # [num_moved, 2 * num_layers, ...]
                for start, first, n in _runs(cpu_ids):
                    staging[start:start + n].copy_(host[first:first + n], non_blocking=True)
                for i, cache in enumerate(tensors):
                    cache.index_copy_(0, dst, staging[:, i])
        self._compute_waits(device)  # the forward reads the swapped-in blocks

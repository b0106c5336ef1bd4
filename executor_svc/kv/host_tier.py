"""The prefix cache's host tier on the executor: how many blocks `--kv-offloading-size` buys,
and whether this host has the memory for them.

The scheduler decides everything about the tier (scheduler_svc/sched/block_manager.py): which
key each slot holds, which blocks are written through to it, which hits are copied back. The
executor only holds the slots and runs each plan's `offload_out` (device block -> slot) and
`offload_in` (slot -> device block) copies, with the swap pool's machinery
(`executor_svc/kv/swap.py`: one block-major host tensor, page-locked on CUDA, copies on a
side stream ordered by events). On the CPU backend the tier is a second, larger pool of the
same layout, not counted against `--kv-cache-memory`.

In a tier file (`protos/kv_tier_file.py`, shared memory the serving process owns) the pool's
tensors are views of this rank's part of the file (its codes, and an int8 cache's scales), and
`TierRecords` keeps that part's records true: a slot's record is invalidated before a plan's
copy-out is queued into it and committed (the block's key, a crc32 of its codes and scales)
only once that copy has completed, so a crash at any moment leaves every record either
vouching for its slot's bytes or empty. Under tensor parallelism rank 0 alone creates or
validates the file (`open_tier_file`) and each rank writes only its own records and blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import structlog
import torch

from executor_svc.kv.kv_cache import KVCache
from executor_svc.kv.swap import SwapPool
from protos.kv_tier_file import TierFile, TierIdentity

log = structlog.get_logger(__name__)

GIB = 1 << 30


def available_host_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where the kernel does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(kv_offloading_size_gib: float, swap_space_gib: float,
                      available: int | None) -> None:
    """Refuse a host tier (with the swap pool beside it) larger than the memory this host has
    available: allocating it would end in the OOM killer mid-serve, not in a message now."""
    wanted = (kv_offloading_size_gib + swap_space_gib) * GIB
    if kv_offloading_size_gib > 0 and available is not None and wanted > available:
        raise ValueError(
            f"--kv-offloading-size {kv_offloading_size_gib:g} GiB (with --swap-space "
            f"{swap_space_gib:g} GiB) is more than this host's available memory "
            f"({available / GIB:.1f} GiB); lower it")


def num_host_blocks_for(kv_offloading_size_gib: float, bytes_per_block: int) -> int:
    """Blocks that `--kv-offloading-size` GiB hold (0 = no host tier)."""
    if kv_offloading_size_gib <= 0:
        return 0
    num_blocks = int(kv_offloading_size_gib * GIB) // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"--kv-offloading-size {kv_offloading_size_gib:g} GiB holds no KV "
                         f"block of {bytes_per_block} bytes; raise it or set it to 0 (no "
                         "host tier)")
    return num_blocks


class TierRecords:
    """The records of one rank's slots in a tier file. Invariant: a slot has at most one
    pending commit, for the newest copy queued into it; its record is empty from the moment
    that copy is queued until the copy has completed and the record is committed."""

    def __init__(self, tier: TierFile, rank: int):
        self.tier = tier
        self.rank = rank
        # (copy done event, None: already done; [(slot, key)]) in the order queued
        self._pending: list[tuple[torch.cuda.Event | None, list[tuple[int, bytes]]]] = []

    def before_copy(self, slots: list[int]) -> None:
        """A plan's copy-outs into `slots` are about to be queued: their records go first,
        and older commits for them are superseded."""
        gone = set(slots)
        for slot in slots:
            self.tier.invalidate(self.rank, slot)
        self._pending = [(event, [(s, k) for s, k in written if s not in gone])
                         for event, written in self._pending]

    def after_copy(self, written: list[tuple[int, bytes]], event: torch.cuda.Event | None
                   ) -> None:
        """The copies into these (slot, key)s are queued; `event` completes with them (None:
        they have completed). Commits whatever has completed so far."""
        self._pending.append((event, written))
        self.commit_completed()

    def commit_completed(self, wait: bool = False) -> None:
        """Commit the records of every copy that has completed (all of them with `wait`),
        oldest first; stops at the first one still running."""
        while self._pending:
            event, written = self._pending[0]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()
            for slot, key in written:
                self.tier.commit(self.rank, slot, key)
            self._pending.pop(0)


def tier_identity(*, model_name: str, architecture: str, kv_dtype_name: str, kv_cache: KVCache,
                  block_size: int, num_slots: int, tensor_parallel_size: int) -> TierIdentity:
    """What a tier file of this rank's KV cache holds: everything that decides its blocks'
    meaning and layout (codes, and an int8 cache's scales, per slot)."""
    return TierIdentity(model_name=model_name, architecture=architecture, dtype=kv_dtype_name,
                        block_size=block_size, block_bytes=SwapPool.block_bytes(kv_cache),
                        scale_bytes=SwapPool.scale_bytes(kv_cache), num_slots=num_slots,
                        tensor_parallel_size=tensor_parallel_size,
                        kv_windows=tuple(kv_cache.layout.windows))


def map_tier_file(tier: TierFile, kv_cache: KVCache, rank: int) -> tuple[SwapPool, TierRecords]:
    """`rank`'s host tier as a pool over its part of the file (codes and scales), with the
    records that keep that part true."""
    pool = SwapPool.in_buffer(kv_cache, tier.data(rank), "host tier file", tier.scales(rank))
    return pool, TierRecords(tier, rank)


def open_tier_file(path: str | Path, identity: TierIdentity, rank: int = 0,
                   barrier: Callable[[], None] = lambda: None) -> TierFile:
    """The tier file at `path` for `rank`: the file as it is if it holds blocks of exactly
    `identity` (a restarted executor: its records say what is still valid), else a fresh,
    empty one in its place.

    Only rank 0 creates or validates the file; every rank then meets at `barrier` (the
    tensor-parallel group's), and ranks > 0 map what rank 0 left. So no rank maps a file
    another is about to replace, and all ranks agree on whether the tier starts warm."""
    tier = None
    if rank == 0:
        tier = TierFile.open(path, identity)
        if tier is None:
            tier = TierFile.create(path, identity)
            log.info("host tier file created", path=str(path), num_slots=identity.num_slots,
                     tensor_parallel_size=identity.tensor_parallel_size)
        else:
            log.info("host tier file reopened", path=str(path),
                     num_committed=len(tier.committed_slots()))
    barrier()
    if tier is None:
        tier = TierFile.open(path, identity)
        if tier is None:
            raise ValueError(f"--kv-offloading-path {path}: rank {rank} finds no tier of its "
                             "blocks there after rank 0 prepared it (do the ranks disagree on "
                             "the model, the KV cache dtype or the tier's size?)")
    return tier

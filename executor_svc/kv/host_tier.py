"""The prefix cache's host tier on the executor: how many blocks `--kv-offloading-size` buys,
and whether this host has the memory for them.

The scheduler decides everything about the tier (scheduler_svc/sched/block_manager.py): which
key each slot holds, which blocks are written through to it, which hits are copied back. The
executor only holds the slots and runs each plan's `offload_out` (device block -> slot) and
`offload_in` (slot -> device block) copies, with the swap pool's machinery
(`executor_svc/kv/swap.py`: one block-major host tensor, page-locked on CUDA, copies on a
side stream ordered by events). On the CPU backend the tier is a second, larger pool of the
same layout, not counted against `--kv-cache-memory`.
"""

from __future__ import annotations

from pathlib import Path

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

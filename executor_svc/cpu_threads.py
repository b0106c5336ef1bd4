"""How many CPU threads the executor's torch ops use, decided before torch is imported.

torch's default is one intra-op thread per core. Every parallel op splits its work statically
over those threads and waits for the slowest, so when any one core is busy with something else
(the scheduler process next door, another job on the machine) each op waits for a thread that
is not running. On the 2-core development machine with other jobs running, 2 threads gave a
quarter of the throughput of 1 (bench/cpu_step.py; docs/benchmarks.md has the figures), and
the issue that started this measured a 16x collapse. Hence the default keeps one core for the
scheduler process and the rest of the machine:

    threads = max(1, cores_available - 1)

where cores_available is the process's CPU affinity (what a container's cpuset allows), not
the machine's core count. Threads are not pinned to cores: pinned, a thread that shares its
core with a busy process cannot move to an idle one, and loses half its speed for nothing.

This module does not import torch at import time: `apply_cpu_threads` is called before the
first torch op (`cli.main` calls it before the worker, and torch, is imported) so OpenMP reads
its environment when torch loads it.
"""

from __future__ import annotations

import os

import structlog

log = structlog.get_logger(__name__)


def available_cores() -> int:
    """Cores this process may run on (affinity mask, so a cpuset or taskset counts)."""
    return len(os.sched_getaffinity(0))


def default_cpu_threads(cores: int | None = None) -> int:
    """One core left for the scheduler process and everything else; at least one thread."""
    cores = available_cores() if cores is None else cores
    return max(1, cores - 1)


def apply_cpu_threads(num_threads: int) -> None:
    """Set torch's intra-op threads to `num_threads` and inter-op threads to 1 (the executor
    runs one op at a time). Call before torch runs its first op; later calls keep working
    for the intra-op count only."""
    if num_threads < 1:
        raise ValueError(f"--cpu-threads must be at least 1, got {num_threads}")
    # Read by OpenMP when torch loads it; an explicit value from the user wins.
    os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
    import torch

    torch.set_num_threads(num_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # the inter-op pool already started (torch used earlier in-process)
        pass
    log.info("cpu threads", num_threads=torch.get_num_threads(), cores=available_cores(),
             interop_threads=torch.get_num_interop_threads())

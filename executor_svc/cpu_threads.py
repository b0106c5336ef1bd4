"""How many CPU threads the executor's torch ops use, decided before torch is imported.

torch's default is one intra-op thread per core, and its OpenMP threads spin-wait between
ops. Every parallel op splits its work statically over the threads and waits for the slowest,
so when a core is busy with something else (the scheduler process next door, another job) the
thread there runs at a fraction of its speed while the others spin, taking CPU from the very
process they wait on. Passive waiting (`OMP_WAIT_POLICY=PASSIVE`: a waiting thread sleeps)
removes most of that. Measured on the 2-core machine with bench/cpu_step.py (Qwen2.5-0.5B
shape, 8 layers, 16 x 128 in / 32 out, fp32, quiet machine; docs/benchmarks.md):

    threads  wait policy  quiet     one core busy   kept
    1        (any)        35 tok/s  ~19 (54%)
    2        active       56 tok/s  27              48%
    2        passive      55 tok/s  34              61%

Hence the default: every core the process may use (its affinity mask, so a container's
cpuset counts), with passive waiting unless the environment says otherwise. Threads are not
pinned to cores: pinned, a thread that shares its core with a busy process cannot move to an
idle one. `--cpu-threads N` sets the count explicitly (e.g. cores - 1 on a machine whose
scheduler is busy all the time).

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
    """Every core this process may use; waiting threads sleep (see the module docstring)."""
    return available_cores() if cores is None else max(1, cores)


def apply_cpu_threads(num_threads: int) -> None:
    """Set torch's intra-op threads to `num_threads` and inter-op threads to 1 (the executor
    runs one op at a time). Call before torch runs its first op; later calls keep working
    for the intra-op count only."""
    if num_threads < 1:
        raise ValueError(f"--cpu-threads must be at least 1, got {num_threads}")
    # Read by OpenMP when torch loads it; an explicit value from the user wins.
    os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(num_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # the inter-op pool already started (torch used earlier in-process)
        pass
    log.info("cpu threads", num_threads=torch.get_num_threads(), cores=available_cores(),
             interop_threads=torch.get_num_interop_threads())

"""How many CPU threads the executor's torch ops use, decided before torch is imported.

torch's default is one intra-op thread per core, and its OpenMP threads (GNU libgomp) spin-wait
between parallel regions. Every parallel op splits its work statically over the threads and
waits for the slowest, so when a core is busy with something else (the scheduler process next
door, another job) the thread there runs at a fraction of its speed while the others spin,
taking CPU from the very process they wait on. Sleeping at once (`OMP_WAIT_POLICY=PASSIVE`)
removes that, but then every parallel region pays a wake-up, which on a virtual machine (an
idle vCPU halted until the host delivers an interrupt) costs 100-300 us: a batch-1 decode step
has ~300 parallel regions. A libgomp spin iteration takes ~28 ns here (3000: ~0.1 ms, 30000:
~0.9 ms of spinning after a region). Measured on the 2-core VM with bench/cpu_step.py
(Qwen2.5-0.5B shape, fp32; the step is the median of 20, two rounds; docs/benchmarks.md):

    wait              batch-1 step (24 layers)   16 x 128/32, 8 layers: quiet -> one core busy
    passive           219-249 ms                 51.6 -> 34.2 tok/s (66% kept)
    spin 3000         140-165 ms                 55.1 -> 37.5 tok/s (68%)
    spin 10000        -                          58.4 -> 30.9 tok/s (53%)
    spin 30000        125-128 ms                 59.0 -> 27.0 tok/s (46%)
    active            -                          59.3 -> 25.3 tok/s (43%)

Hence the default `GOMP_SPINCOUNT=3000`: most of the spinning's gain on a quiet machine and
none of its collapse on a busy one. On a machine the executor has to itself,
`GOMP_SPINCOUNT=30000` in its environment buys another ~10-20% at batch 1.

The thread count defaults to every core the process may use (its affinity mask, so a
container's cpuset counts). Threads are not pinned to cores: pinned, a thread that shares its
core with a busy process cannot move to an idle one. `--cpu-threads N` sets the count
explicitly (e.g. cores - 1 on a machine whose scheduler is busy all the time); an
`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` in the environment wins over the default wait.

This module does not import torch at import time: `apply_cpu_threads` is called before the
first torch op (`cli.main` calls it before the worker, and torch, is imported) so OpenMP reads
its environment when torch loads it.
"""

from __future__ import annotations

import os

import structlog

log = structlog.get_logger(__name__)


SPIN_COUNT = 3000  # libgomp spin iterations before a waiting thread sleeps


def available_cores() -> int:
    """Cores this process may run on (affinity mask, so a cpuset or taskset counts)."""
    return len(os.sched_getaffinity(0))


def default_cpu_threads(cores: int | None = None) -> int:
    """Every core this process may use (see the module docstring)."""
    return available_cores() if cores is None else max(1, cores)


def apply_cpu_threads(num_threads: int) -> None:
    """Set torch's intra-op threads to `num_threads` and inter-op threads to 1 (the executor
    runs one op at a time). Call before torch runs its first op; later calls keep working
    for the intra-op count only."""
    if num_threads < 1:
        raise ValueError(f"--cpu-threads must be at least 1, got {num_threads}")
    # Read by OpenMP when torch loads it; an explicit value from the user wins.
    os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))
    import torch

    torch.set_num_threads(num_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # the inter-op pool already started (torch used earlier in-process)
        pass
    log.info("cpu threads", num_threads=torch.get_num_threads(), cores=available_cores(),
             interop_threads=torch.get_num_interop_threads())

"""How the executor's host allocations behave: keep freed memory for reuse.

torch allocates CPU tensors with the C library's malloc. glibc serves every request above its
mmap threshold (128 KiB at first, growing to 32 MiB at most) with a fresh mmap and unmaps it on
free, so each large activation of a forward pass (a 2048-token prefill's MLP output is 80 MB)
lands on pages the kernel must fault in and zero again, step after step. On the 2-core VM an
elementwise product of two 40 MB tensors takes 23 ms that way and 4 ms on reused memory; a
whole prefill of Qwen2.5-0.5B's shape gets ~10% faster (docs/benchmarks.md).

`keep_freed_memory` turns mmap off for malloc (M_MMAP_MAX = 0: everything comes from the heap)
and raises the trim threshold so freed memory stays in the process for the next step. The
executor's working set repeats every step, so the heap grows to its peak and stays there; the
KV cache and the weights are allocated once. This is what tcmalloc/jemalloc (which vLLM's CPU
build asks users to preload) give too, without a preload. Where malloc is not glibc's (no
`mallopt`), nothing changes.

Loading is the exception: it frees what the step never reuses (checkpoint-layout copies, plain
weights replaced by packed forms: a MoE model's experts are one such copy of most of its
bytes). Those holes sit below the packed weights, where no trim of the heap top reaches, so
`return_freed_memory` (glibc's malloc_trim, which hands back every free page of the heap) runs
after each such release (the CPU backend's packing of a MoE layer's experts) and once the model
is in place.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import structlog

log = structlog.get_logger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30  # bytes of free heap top kept before returning memory to the OS


def keep_freed_memory() -> bool:
    """Apply the malloc settings above to this process; True if they took effect."""
    try:
        mallopt = _libc().mallopt
    except AttributeError:
        log.info("malloc settings unchanged: no glibc mallopt")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.info("malloc keeps freed memory", applied=ok, trim_threshold=TRIM_THRESHOLD)
    return ok


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def return_freed_memory() -> bool:
    """Give the pages of every free heap chunk back to the OS (glibc's malloc_trim(0)); True
    if any were. After loading: see the module docstring."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))

"""`--competing-load`: a busy Python loop pinned to one core while a timed run goes on.

It stands for a neighbour on a shared machine (the CPU target: at least half the quiet
throughput with one core taken). The loop is this package's own child, ended by its pid.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

BUSY_LOOP = "while True:\n    pass\n"


def pinned_core() -> int:
    """The highest-numbered core this process may use (the peers start on the lowest)."""
    return max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0


@contextlib.contextmanager
def competing_load(enabled: bool) -> Iterator[int | None]:
    """Yield the busy process's core (None when disabled)."""
    if not enabled:
        yield None
        return
    core = pinned_core()
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL)
    try:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(proc.pid, {core})
        yield core
    finally:
        proc.kill()
        proc.wait(timeout=10)

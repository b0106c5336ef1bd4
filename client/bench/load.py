"""The machine's load around a timed run.

`--competing-load`: a busy Python loop pinned to one core while a timed run goes on. It stands
for a neighbour on a shared machine (the CPU target: at least half the quiet throughput with
one core taken). The loop is this package's own child, ended by its pid.

`settle`: before each timed run, wait until the cores are quiet (the previous peer's threads
may spin on for a while after its run).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
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


def cpu_busy_fraction(interval_s: float = 0.5) -> float | None:
    """Share of all cores' time spent busy over `interval_s` (/proc/stat); None off Linux."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    try:
        total0, idle0 = sample()
        time.sleep(interval_s)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return 1.0 - (idle1 - idle0) / total if total > 0 else None


def settle(max_busy: float = 0.15, timeout_s: float = 15.0) -> float | None:
    """Before a timed run: wait (at most `timeout_s`) until the cores are quiet, so a peer
    that just finished (threads still spinning, a process winding down) does not slow the
    next one. Returns the last busy fraction measured."""
    deadline = time.monotonic() + timeout_s
    busy = cpu_busy_fraction()
    while busy is not None and busy > max_busy and time.monotonic() < deadline:
        busy = cpu_busy_fraction()
    return busy

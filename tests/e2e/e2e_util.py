"""Small polling helpers for end-to-end tests (bounded in time, never sleep-and-hope)."""

from __future__ import annotations

import time

from client import FolioClient


def wait_idle(address: str, timeout: float = 15.0) -> dict:
    """Poll GetServerStats until nothing runs or waits and every KV block is free; return the
    last stats. Raises AssertionError with those stats if that does not happen in time."""
    deadline = time.monotonic() + timeout
    with FolioClient(address, timeout=5.0) as client:
        while True:
            stats = client.stats()
            idle = (stats["num_running"] == 0 and stats["num_waiting"] == 0
                    and stats["kv_blocks_free"] == stats["kv_blocks_total"])
            if idle:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout:g}s: {stats}")
            time.sleep(0.05)

"""Sizing the prefix cache's host tier: blocks per GiB, and a tier larger than the host's
available memory refused at start with a sentence naming the flag."""

from __future__ import annotations

import pytest

from executor_svc.config import ExecutorConfig
from executor_svc.kv.host_tier import (
    GIB,
    available_host_bytes,
    check_host_memory,
    num_host_blocks_for,
)


def test_blocks_per_gib():
    assert num_host_blocks_for(0, 4096) == 0
    assert num_host_blocks_for(1, 4096) == GIB // 4096
    assert num_host_blocks_for(0.5, 3 * 1024) == (GIB // 2) // (3 * 1024)
    with pytest.raises(ValueError, match="--kv-offloading-size 1e-09 GiB holds no KV block"):
        num_host_blocks_for(1e-9, 4096)


def test_a_tier_larger_than_host_memory_is_refused(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8388608 kB\n")
    available = available_host_bytes(meminfo)
    assert available == 8 * GIB
    check_host_memory(6, 2, available)  # exactly what is available
    with pytest.raises(ValueError, match=r"--kv-offloading-size 7 GiB \(with --swap-space 2 "
                                         r"GiB\) is more than this host's available memory "
                                         r"\(8.0 GiB\)"):
        check_host_memory(7, 2, available)
    check_host_memory(0, 64, available)  # no tier: the swap pool is checked where it always was
    assert available_host_bytes(tmp_path / "missing") is None
    check_host_memory(1 << 19, 0, None)  # a kernel that does not say: nothing to check against


def test_the_real_host_refuses_a_tier_past_its_memory():
    available = available_host_bytes()
    if available is None:
        pytest.skip("no /proc/meminfo")
    with pytest.raises(ValueError, match="more than this host's available memory"):
        check_host_memory(available / GIB + 1, 0, available)


@pytest.mark.parametrize("size", [-1.0, float("nan"), float("inf")])
def test_bad_sizes_are_explained(size):
    with pytest.raises(ValueError, match="--kv-offloading-size must be >= 0 GiB"):
        ExecutorConfig(model="m", kv_offloading_size=size)

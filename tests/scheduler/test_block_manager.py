"""Block manager: exact block ids, ref counts, the free queue, no leaks."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.block_manager import BlockManager


def test_allocate_grows_tables_with_exact_ids():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 5) == [0, 1]  # 5 tokens -> 2 blocks
    assert bm.allocate("b", 4) == [2]
    assert bm.allocate("a", 8) == []  # still fits in 2 blocks
    assert bm.allocate("a", 9) == [3]  # the 9th token opens a third block
    assert bm.block_table("a") == [0, 1, 3]
    assert bm.block_table("b") == [2]
    assert bm.num_free_blocks == 4
    assert bm.ref_counts == [1, 1, 1, 1, 0, 0, 0, 0]
    bm.check_invariants()


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    assert bm.allocate("a", 4) == [0, 1]
    assert bm.allocate("b", 3) is None  # needs 2, only 1 free: nothing changes
    assert bm.block_table("b") == []
    assert "b" not in bm.block_tables
    assert bm.num_free_blocks == 1
    bm.check_invariants()


def test_free_returns_blocks_fifo():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate("a", 4)  # [0, 1]
    bm.allocate("b", 2)  # [2]
    assert bm.free("a") == 2
    assert bm.free("a") == 0  # second free is a no-op
    # Free queue: 3 4 5 then the freed 0 1, so the next table gets the never-used blocks first.
    assert bm.allocate("c", 8) == [3, 4, 5, 0]
    assert bm.ref_counts == [1, 0, 1, 1, 1, 1]
    bm.check_invariants()


def test_num_new_blocks_and_blocks_for():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert bm.blocks_for(0) == 0
    assert bm.blocks_for(1) == 1
    assert bm.blocks_for(16) == 1
    assert bm.blocks_for(17) == 2
    bm.allocate("a", 17)
    assert bm.num_new_blocks("a", 32) == 0
    assert bm.num_new_blocks("a", 33) == 1


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(num_blocks=0, block_size=16)


def test_random_workload_never_leaks():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=32, block_size=4)
    sizes: dict[str, int] = {}
    for _ in range(2000):
        if sizes and rng.random() < 0.3:
            req_id = rng.choice(sorted(sizes))
            bm.free(req_id)
            del sizes[req_id]
        else:
            req_id = rng.choice([f"r{i}" for i in range(10)])
            target = sizes.get(req_id, 0) + rng.randint(1, 9)
            if bm.allocate(req_id, target) is not None:
                sizes[req_id] = target
        bm.check_invariants()
        for req_id, size in sizes.items():
            assert len(bm.block_table(req_id)) == bm.blocks_for(size)
    for req_id in list(sizes):
        bm.free(req_id)
    assert bm.num_free_blocks == 32
    assert bm.ref_counts == [0] * 32

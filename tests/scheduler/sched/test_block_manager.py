"""Block manager: exact block ids, ref counts, the free and evictable pools, prefix-cache keys,
copy-on-write, fork and swap, no leaks."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.sched.block_manager import FREED, Allocation, BlockManager, longest_context
from scheduler_svc.sched.prefix_cache import block_key, extend_block_keys


def test_allocate_grows_tables_with_exact_ids():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 5) == Allocation([0, 1])  # 5 tokens -> 2 blocks
    assert bm.allocate("b", 4) == Allocation([2])
    assert bm.allocate("a", 8) == Allocation([])  # still fits in 2 blocks
    assert bm.allocate("a", 9) == Allocation([3])  # the 9th token opens a third block
    assert bm.block_table("a") == [0, 1, 3]
    assert bm.block_table("b") == [2]
    assert bm.num_free_blocks == 4
    assert bm.ref_counts == [1, 1, 1, 1, 0, 0, 0, 0]
    bm.check_invariants()


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    assert bm.allocate("a", 4) == Allocation([0, 1])
    assert bm.num_blocks_needed("b", 3) == 2
    assert bm.allocate("b", 3) is None  # needs 2, only 1 free: nothing changes
    assert bm.block_table("b") == []
    assert "b" not in bm.block_tables
    assert bm.num_free_blocks == 1
    bm.check_invariants()


def test_free_returns_blocks_tail_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate("a", 4)  # [0, 1]
    bm.allocate("b", 2)  # [2]
    assert bm.free("a") == 2
    assert bm.free("a") == 0  # second free is a no-op
    # Free queue: 3 4 5, then a's blocks tail first (1 0): never-used blocks go out first.
    assert bm.allocate("c", 8) == Allocation([3, 4, 5, 1])
    assert bm.ref_counts == [0, 1, 1, 1, 1, 1]
    bm.check_invariants()


def test_blocks_for_and_num_blocks_needed():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert [bm.blocks_for(n) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]
    bm.allocate("a", 17)
    assert bm.num_blocks_needed("a", 32) == 0
    assert bm.num_blocks_needed("a", 33) == 1


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(num_blocks=0, block_size=16)


def keys_of(token_ids, block_size=4, salt=""):
    return extend_block_keys([], token_ids, block_size, salt)


def test_keys_are_chained_salted_digests():
    a = keys_of(list(range(12)))
    assert len(a) == 3 and all(len(k) == 32 for k in a)
    assert a[0] == block_key(None, [0, 1, 2, 3])
    assert a[1] == block_key(a[0], [4, 5, 6, 7])
    # Same block tokens after a different prefix: a different key.
    assert keys_of([9, 1, 2, 3, 4, 5, 6, 7])[1] != a[1]
    assert keys_of(list(range(12)), salt="tenant-b")[0] != a[0]
    assert keys_of(list(range(13)))[:3] == a  # a partial block has no key
    assert extend_block_keys(a[:1], list(range(12)), 4) == a  # extends, reusing a[0]


def test_full_computed_blocks_are_reused_until_evicted_lru_first():
    bm = BlockManager(num_blocks=6, block_size=4)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    keys = keys_of(prompt)
    assert bm.allocate_new("a", 10) == [0, 1, 2]
    assert bm.cached_prefix(keys) == []  # nothing cached before the step that computes them
    assert bm.cache_blocks("a", keys) == 2
    assert bm.cached_prefix(keys) == [0, 1]
    # A request with the same first block and a different second one shares block 0 only.
    other = keys_of(prompt[:4] + [7, 7, 7, 7])
    assert bm.cached_prefix(other) == [0]
    assert bm.allocate_new("b", 6, [0]) == [0, 3]
    assert bm.ref_counts[:4] == [2, 1, 1, 1]
    bm.free("a")  # block 0 still held by b; 1 becomes evictable, 2 (partial) free
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    bm.free("b")
    bm.check_invariants()
    # Allocation takes never-cached blocks first (4 5 2 3), then evicts LRU: block 1 was
    # freed before block 0, so it goes first and its key is forgotten.
    assert bm.allocate_new("c", 20) == [4, 5, 2, 3, 1]
    assert bm.cached_prefix(keys) == [0]
    bm.check_invariants()
    assert bm.allocate("c", 24) == Allocation([0])  # evicts block 0 as well
    assert bm.cached_prefix(keys) == [] and bm.num_cached_blocks == 0
    bm.check_invariants()


def test_a_hit_in_the_evictable_pool_counts_against_free_blocks():
    bm = BlockManager(num_blocks=3, block_size=2)
    keys = keys_of([5, 6, 7, 8], block_size=2)
    bm.allocate_new("a", 4)
    bm.cache_blocks("a", keys)
    bm.free("a")
    assert bm.num_free_blocks == 3
    # Reusing both cached blocks plus 2 fresh ones needs 4 of the 3: refused, nothing changed.
    assert bm.allocate_new("b", 8, [1, 0]) is None
    assert bm.num_cached_blocks == 2
    assert bm.allocate_new("b", 6, [1, 0]) == [1, 0, 2]
    bm.check_invariants()


def test_same_contents_in_two_blocks_keep_one_key():
    bm = BlockManager(num_blocks=4, block_size=2)
    keys = keys_of([5, 6], block_size=2)
    bm.allocate_new("a", 2)
    bm.allocate_new("b", 2)
    assert bm.cache_blocks("a", keys) == 1
    assert bm.cache_blocks("b", keys) == 0  # block 1 stays uncached
    bm.free("b")
    bm.free("a")
    assert bm.num_cached_blocks == 1 and bm.cached_prefix(keys) == [0]
    bm.check_invariants()


def test_fork_shares_blocks_and_copy_on_write_on_a_shared_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate_new("p", 6)  # [0, 1]: block 1 holds 2 of 4 tokens
    bm.fork("p", "c1")
    bm.fork("p", "c2")
    assert bm.block_table("c1") == bm.block_table("c2") == [0, 1]
    assert bm.ref_counts[:2] == [3, 3]
    assert bm.num_blocks_needed("c1", 7) == 1  # the copy
    # c1 writes token 7 into block 1, which p and c2 share: it gets a copy of block 1.
    assert bm.allocate("c1", 7) == Allocation([], ((1, 2),))
    assert bm.block_table("c1") == [0, 2] and bm.ref_counts[:3] == [3, 2, 1]
    assert bm.allocate("p", 7) == Allocation([], ((1, 3),))
    # c2 is the last holder of block 1: it writes in place.
    assert bm.allocate("c2", 7) == Allocation([])
    assert bm.block_table("c2") == [0, 1] and bm.ref_counts[:4] == [3, 1, 1, 1]
    # Full blocks are never copied: growing past a shared full block appends.
    bm.fork("c2", "c3")
    assert bm.allocate("c3", 8) == Allocation([], ((1, 4),))  # c3 = [0, 4]: both full
    bm.fork("c3", "c4")
    assert bm.allocate("c4", 13) == Allocation([5, 6])
    assert bm.block_table("c4") == [0, 4, 5, 6]
    bm.check_invariants()
    for seq_id in ("p", "c1", "c2", "c3", "c4"):
        bm.free(seq_id)
    assert bm.num_free_blocks == 8 and bm.ref_counts == [0] * 8
    bm.check_invariants()


def test_swap_out_and_in_move_each_shared_block_once():
    bm = BlockManager(num_blocks=6, block_size=4, num_cpu_blocks=4)
    bm.allocate_new("a", 6)  # [0, 1]
    bm.fork("a", "b")
    bm.allocate("b", 7)  # copy-on-write: b = [0, 2]
    bm.allocate_new("x", 4)  # [3]
    assert bm.num_swap_out_blocks(["a", "b"]) == 3
    assert bm.swap_out(["a", "b"]) == [(0, 0), (1, 1), (2, 2)]
    assert bm.cpu_block_table("a") == [0, 1] and bm.cpu_block_table("b") == [0, 2]
    assert bm.cpu_ref_counts == [2, 1, 1, 0] and bm.num_free_cpu_blocks == 1
    assert bm.block_table("a") == [] and bm.num_free_blocks == 5
    bm.check_invariants()
    assert bm.swap_out(["x"]) == [(3, 3)]
    assert bm.num_free_cpu_blocks == 0
    bm.allocate_new("y", 24)  # all 6 GPU blocks: nothing fits back in
    assert bm.swap_in(["a", "b"]) is None
    bm.free("y")
    # Fresh GPU blocks from the free queue, which y's table [4 5 1 2 0 3] refilled tail first.
    assert bm.swap_in(["a", "b"]) == [(0, 3), (1, 0), (2, 2)]
    assert bm.block_table("a") == [3, 0] and bm.block_table("b") == [3, 2]
    assert bm.ref_counts[3] == 2 and bm.cpu_ref_counts == [0, 0, 0, 1]
    bm.check_invariants()
    for seq_id in ("a", "b", "x"):
        bm.free(seq_id)
    assert bm.num_free_blocks == 6 and bm.num_free_cpu_blocks == 4
    bm.check_invariants()


def test_swap_out_is_refused_without_cpu_room():
    bm = BlockManager(num_blocks=4, block_size=2, num_cpu_blocks=1)
    bm.allocate_new("a", 4)
    assert bm.swap_out(["a"]) is None
    assert bm.block_table("a") == [0, 1]
    bm.check_invariants()


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


# ---- KV groups and sliding windows ------------------------------------------------------------

def test_groups_interleave_one_block_per_group_per_position():
    bm = BlockManager(num_blocks=12, block_size=2, windows=(0, 4))
    assert bm.allocate("a", 3) == Allocation([0, 1, 2, 3])  # 2 positions x 2 groups
    assert bm.num_blocks_needed("a", 5) == 2
    assert bm.allocate("a", 5) == Allocation([4, 5])
    assert bm.block_table("a") == [0, 1, 2, 3, 4, 5]
    bm.check_invariants()


def test_windowed_group_releases_what_left_every_window():
    bm = BlockManager(num_blocks=20, block_size=2, windows=(0, 4))
    bm.allocate("a", 9)  # positions 0-4: [0 1 | 2 3 | 4 5 | 6 7 | 8 9]
    # Queries from position 8 see keys 5..: positions 0 and 1 (tokens 0-3) are out.
    assert bm.release_outside_windows("a", 8) == 2
    assert bm.block_table("a") == [0, FREED, 2, FREED, 4, 5, 6, 7, 8, 9]
    assert bm.plan_table("a") == [0, 0, 2, 0, 4, 5, 6, 7, 8, 9]  # FREED goes out as block 0
    assert bm.release_outside_windows("a", 8) == 0  # idempotent
    assert bm.num_windowed_blocks == 3 and bm.num_blocks_held("a") == 8
    bm.check_invariants()
    assert bm.free("a") == 8
    assert bm.num_free_blocks == 20
    bm.check_invariants()


def test_window_margin_keeps_positions_a_rollback_may_need():
    bm = BlockManager(num_blocks=20, block_size=2, windows=(4,), window_margin=3)
    bm.allocate("a", 10)
    # Queries may restart at 8 - 3 = 5, seeing keys 2..: only position 0 goes.
    assert bm.release_outside_windows("a", 8) == 1
    assert bm.block_table("a")[:2] == [FREED, 1]


def test_all_sliding_sequence_outgrows_the_pool():
    # Without releases the pool holds 16 tokens; with a window of 6 a sequence grows to 200.
    bm = BlockManager(num_blocks=8, block_size=2, windows=(6,))
    bm.allocate("a", 1)
    for n in range(1, 200):
        bm.release_outside_windows("a", n)  # queries from position n on
        assert bm.allocate("a", n + 1) is not None, n
        assert bm.num_blocks_held("a") <= bm.blocks_to_hold(n + 1, chunk=1)
        bm.check_invariants()
    assert bm.blocks_to_hold(200, chunk=1) == 5 < bm.blocks_for(200)


def test_blocks_to_hold_counts_full_groups_whole_and_windows_bounded():
    bm = BlockManager(num_blocks=100, block_size=4, windows=(0, 8, 8))
    # 64 tokens = 16 positions; a window of 8 with 4-token chunks: ceil(12 / 4) + 1 = 4.
    assert bm.blocks_to_hold(64, chunk=4) == 16 + 4 + 4
    assert bm.blocks_to_hold(4, chunk=4) == 3  # shorter than the window: every group whole


def test_cached_prefix_needs_only_the_window_of_windowed_groups():
    bm = BlockManager(num_blocks=40, block_size=2, windows=(0, 3))
    keys = extend_block_keys([], list(range(20, 32)), 2)  # 12 tokens, 6 positions
    bm.allocate("a", 12)
    bm.cache_blocks("a", keys)
    bm.release_outside_windows("a", 12)  # windowed blocks of positions 0-4 released
    # A sequence starting after all 6 positions sees keys 10..: the window needs position 5.
    table = bm.cached_prefix(keys)
    assert len(table) == 12
    assert table[1::2] == [bm.block_table("a")[1::2][k] if k == 5 else FREED for k in range(6)]
    assert table[0::2] == bm.block_table("a")[0::2]  # the full group: every position
    bm.allocate_new("b", 13, table)
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 40
    bm.check_invariants()


def test_cached_prefix_shrinks_when_a_windowed_block_was_evicted():
    bm = BlockManager(num_blocks=40, block_size=2, windows=(0, 3))
    keys = extend_block_keys([], list(range(20, 32)), 2)
    bm.allocate("a", 12)
    bm.cache_blocks("a", keys)
    windowed = bm.block_table("a")[1::2]
    del bm._cached[bm._key_of.pop(windowed[5])]  # as if evicted: position 5's window block
    table = bm.cached_prefix(keys)
    # 5 positions: queries from 10 need keys 8.. = position 4, still cached.
    assert len(table) == 10 and table[9] == windowed[4] and table[7] == FREED


def test_swap_keeps_released_entries_released():
    bm = BlockManager(num_blocks=20, block_size=2, num_cpu_blocks=20, windows=(0, 2))
    bm.allocate("a", 8)
    bm.release_outside_windows("a", 7)  # queries from 7 see 6..: positions 0-2 go
    pairs = bm.swap_out(["a"])
    assert len(pairs) == 5
    assert bm.cpu_block_table("a")[1:6:2] == [FREED] * 3
    bm.check_invariants()
    bm.swap_in(["a"])
    assert bm.block_table("a")[1:6:2] == [FREED] * 3 and bm.num_blocks_held("a") == 5
    bm.check_invariants()


def test_fork_shares_and_copies_per_group():
    bm = BlockManager(num_blocks=20, block_size=4, windows=(0, 8))
    bm.allocate("p", 5)  # [0 1 | 2 3]
    bm.fork("p", "c")
    alloc = bm.allocate("c", 6)  # the last position's blocks are shared and partly filled
    assert alloc.new_block_ids == [] and alloc.copies == ((2, 4), (3, 5))
    assert bm.block_table("c") == [0, 1, 4, 5]
    bm.check_invariants()


def test_longest_context_follows_the_windows():
    # Full attention: the pool's tokens. All windows: unbounded (up to the limit). Mixed: the
    # full groups' share of the pool, once the windows' blocks are set aside.
    assert longest_context(10, 4, (0,), chunk=8, limit=1000) == 40
    assert longest_context(10, 4, (8,), chunk=8, limit=1000) == 1000
    assert longest_context(4, 4, (8,), chunk=8, limit=1000) == 16  # a window and chunk need 5
    # windows (0, 8), chunk 8: a window holds ceil(16 / 4) + 1 = 5 blocks; 20 - 5 = 15 left.
    assert longest_context(20, 4, (0, 8), chunk=8, limit=1000) == 60
    assert longest_context(1, 4, (0, 8), chunk=1, limit=1000) == 0  # one block, two groups

"""The prefix cache's host tier in the block manager: exact slots and copies. Blocks are
written through when keyed, stay hits after device eviction, come back through copy-ins into
fresh device blocks; one LRU across the tiers; slots named by pending copies are never reused
before their plan is built; a freed table drops its pending copy-ins; tables hitting one slot
before its plan share one copy-in; reset and failed plans forget what the tier promised;
Tier.HOST events mirror it."""

from __future__ import annotations

from protos.plan import SamplingSpec
from scheduler_svc.sched.block_manager import FREED, BlockManager, host_entry, host_slot
from scheduler_svc.sched.kv_events import BlockRemoved, BlockStored, KvEventLog, Tier
from scheduler_svc.sched.prefix_cache import extend_block_keys
from scheduler_svc.sched.request import Request
from scheduler_svc.sched.scheduler import Scheduler
from tests.scheduler.null_executor import PlanMirror

BS = 2


def keys_of(tokens: list[int]) -> list[bytes]:
    return extend_block_keys([], tokens, BS)


def cached_seq(bm: BlockManager, seq_id: str, tokens: list[int]) -> list[int]:
    """A new sequence of `tokens`, every full block computed and offered to the cache."""
    hits = bm.cached_prefix(keys_of(tokens)[:(len(tokens) - 1) // BS])
    table = bm.allocate_new(seq_id, len(tokens), hits)
    assert table is not None
    bm.cache_blocks(seq_id, keys_of(tokens), tokens)
    return table


def test_keyed_blocks_are_written_through_once():
    bm = BlockManager(num_blocks=4, block_size=BS, num_host_blocks=6)
    assert cached_seq(bm, "a", [1, 2, 3, 4, 5]) == [0, 1, 2]
    assert bm.take_tier_copies() == ([(0, 0), (1, 1)], [])  # two full blocks, once
    bm.free("a")
    cached_seq(bm, "b", [1, 2, 3, 4, 9])  # device hits: nothing written again
    assert bm.take_tier_copies() == ([], [])
    assert bm.num_cached_host_blocks == 2
    bm.check_invariants()


def test_an_evicted_block_is_a_host_hit_copied_into_a_fresh_block():
    bm = BlockManager(num_blocks=3, block_size=BS, num_host_blocks=6)
    cached_seq(bm, "a", [1, 2, 3, 4])  # blocks 0, 1 keyed, slots 0, 1
    bm.take_tier_copies()
    bm.free("a")
    # Takes block 2, then evicts 1 and 0 (a freed table's tail is least recently used).
    assert cached_seq(bm, "b", [7, 8, 9, 10, 11]) == [2, 1, 0]
    assert bm.take_tier_copies() == ([(2, 2), (1, 3)], [])
    bm.free("b")
    keys = keys_of([1, 2, 3, 4, 5])
    hits = bm.cached_prefix(keys[:2])
    assert hits == [host_entry(0), host_entry(1)]  # neither is on the device any more
    table = bm.allocate_new("c", 5, hits)
    assert table == [0, 1, 2]  # free blocks first: the never-cached one, then the LRU
    assert bm.take_tier_copies() == ([], [(0, 0), (1, 1)])
    assert bm.num_host_hit_positions(hits) == 2
    # Copied-in blocks are keyed by the next cache_blocks, without a second copy-out.
    bm.cache_blocks("c", keys, [1, 2, 3, 4, 5])
    assert bm.cached_prefix(keys[:2]) == [0, 1]
    assert bm.take_tier_copies() == ([], [])
    bm.check_invariants()


def test_one_lru_across_tiers():
    """A device hit keeps its host slot warm, so the tier evicts what is least used anywhere."""
    bm = BlockManager(num_blocks=8, block_size=BS, num_host_blocks=2)
    cached_seq(bm, "a", [1, 2, 3])  # slot 0
    cached_seq(bm, "b", [5, 6, 7])  # slot 1
    bm.take_tier_copies()
    cached_seq(bm, "a2", [1, 2, 9])  # a device hit of a's block: slot 0 becomes the newest
    cached_seq(bm, "c", [8, 8, 8])  # needs a slot: b's (least recently used) goes
    assert bm.take_tier_copies() == ([(bm.block_table("c")[0], 1)], [])
    assert bm.cached_prefix(keys_of([5, 6])) == [2]  # b's block: still on the device
    assert bm._host_key_of[0] == keys_of([1, 2])[0]
    bm.check_invariants()


def test_slots_named_by_pending_copies_are_not_reused():
    bm = BlockManager(num_blocks=8, block_size=BS, num_host_blocks=2)
    cached_seq(bm, "a", [1, 2, 3, 4, 5])  # slots 0, 1: both pending copy-outs
    cached_seq(bm, "b", [7, 7, 7])  # no slot to take: not written through
    assert bm.take_tier_copies() == ([(0, 0), (1, 1)], [])
    assert bm.num_cached_host_blocks == 2
    cached_seq(bm, "c", [6, 6, 6])  # the plan was built: slot 0 (LRU) is reusable
    out, _ = bm.take_tier_copies()
    assert out == [(bm.block_table("c")[0], 0)]
    bm.check_invariants()


def test_a_freed_table_drops_its_pending_copy_ins():
    bm = BlockManager(num_blocks=2, block_size=BS, num_host_blocks=4)
    cached_seq(bm, "a", [1, 2, 3])
    bm.free("a")
    cached_seq(bm, "b", [5, 6, 7, 8])  # evicts a's block 0
    bm.free("b")
    bm.take_tier_copies()
    hits = bm.cached_prefix(keys_of([1, 2]))
    assert hits == [host_entry(0)]
    bm.allocate_new("c", 3, hits)
    bm.check_invariants()
    bm.free("c")  # aborted before its plan: the copy must not land in a reused block
    assert bm.take_tier_copies() == ([], [])
    bm.check_invariants()


def test_reset_and_failed_plans_forget_the_tier():
    bm = BlockManager(num_blocks=4, block_size=BS, num_host_blocks=4)
    cached_seq(bm, "a", [1, 2, 3, 4])
    out, _ = bm.take_tier_copies()
    bm.forget_host_blocks(slot for _, slot in out[:1])  # that plan failed
    assert bm.num_cached_host_blocks == 1
    bm.free("a")
    assert bm.reset_prefix_cache()
    assert bm.num_cached_host_blocks == 0 and bm.cached_prefix(keys_of([1, 2])) == []
    bm.check_invariants()


def test_host_events_mirror_the_tier():
    device, host = KvEventLog(), KvEventLog(Tier.HOST)
    bm = BlockManager(num_blocks=8, block_size=BS, num_host_blocks=1, events=device,
                      host_events=host)
    cached_seq(bm, "a", [1, 2, 3])
    bm.take_tier_copies()
    cached_seq(bm, "b", [4, 5, 6])  # the one slot goes to b's block
    a_key, b_key = keys_of([1, 2])[0], keys_of([4, 5])[0]
    assert host.drain() == [
        BlockStored(block_hashes=(a_key,), parent_hash=None, token_ids=(1, 2), block_size=BS,
                    cache_salt="", group=0, tier=Tier.HOST),
        BlockRemoved(block_hashes=(a_key,), group=0, tier=Tier.HOST),
        BlockStored(block_hashes=(b_key,), parent_hash=None, token_ids=(4, 5), block_size=BS,
                    cache_salt="", group=0, tier=Tier.HOST)]
    assert [e.tier for e in device.drain()] == [Tier.DEVICE, Tier.DEVICE]


def test_windowed_groups_copy_back_what_their_windows_need():
    bm = BlockManager(num_blocks=12, block_size=BS, windows=(0, 2), num_host_blocks=12)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    cached_seq(bm, "a", tokens)  # 3 full positions x 2 groups keyed and written through
    assert len(bm.take_tier_copies()[0]) == 6
    bm.free("a")
    assert bm.reset_prefix_cache() is True
    assert bm.cached_prefix(keys_of(tokens)[:3]) == []
    cached_seq(bm, "a", tokens)
    bm.take_tier_copies()
    bm.free("a")
    assert bm.allocate("f", 12) is not None  # all 12 blocks: every device copy evicted
    hits = bm.cached_prefix(keys_of(tokens)[:3])
    # The full group needs all 3 positions; the window of 2 only the last.
    assert hits[0::2] == [host_entry(s) for s in (0, 2, 4)]
    assert hits[1::2] == [FREED, FREED, host_entry(5)]


def test_a_new_block_manager_adopts_what_the_tier_vouches_for():
    """After an executor crash: the retired manager's index, less the slots the tier file could
    not vouch for, seeds the next one; its hits are copy-ins, its LRU order is kept, and the
    published host blocks it dropped are reported removed."""
    host = KvEventLog(Tier.HOST)
    old = BlockManager(num_blocks=8, block_size=BS, num_host_blocks=4, host_events=host)
    cached_seq(old, "a", [1, 2, 3])  # slot 0
    cached_seq(old, "b", [5, 6, 7])  # slot 1
    cached_seq(old, "c", [8, 9, 9])  # slot 2: say its copy-out never ran
    old.take_tier_copies()
    index = old.host_index()
    assert list(index) == [0, 1, 2]
    host.drain()
    del index[2]  # the tier file's record for slot 2 failed its checks
    new = BlockManager(num_blocks=8, block_size=BS, num_host_blocks=4, host_events=host)
    new.adopt_host_blocks(index)
    new.check_invariants()
    assert host.drain() == [BlockRemoved(block_hashes=(keys_of([8, 9])[0],), group=0,
                                         tier=Tier.HOST)]
    assert new.cached_prefix(keys_of([1, 2])) == [host_entry(0)]
    assert new.cached_prefix(keys_of([8, 9])) == []
    assert new.allocate_new("a", 3, [host_entry(0)]) == [0, 1]
    assert new.take_tier_copies() == ([], [(0, 0)])
    cached_seq(new, "d", [4, 4, 4])  # the free slots first (2, 3), then the LRU: slot 1
    cached_seq(new, "e", [3, 3, 3])
    cached_seq(new, "f", [2, 2, 2])
    # Slot 0 was hit after the adoption: slot 1 is the least recently used.
    assert [slot for _, slot in new.take_tier_copies()[0]] == [2, 3, 1]
    assert new.host_index()[0] == keys_of([1, 2])[0]
    new.check_invariants()


def test_requests_hitting_one_slot_before_its_plan_share_one_copy():
    """Two tables admitted before the plan is built, both hitting the same slots found only in
    the host tier: one copy-in per slot, the second table shares the first's blocks (a device
    hit) and counts them as host hits; freeing the first keeps the shared copy, freeing both
    drops it."""
    bm = BlockManager(num_blocks=8, block_size=BS, num_host_blocks=4)
    cached_seq(bm, "a", [1, 2, 3, 4, 5])
    bm.free("a")
    cached_seq(bm, "x", [9, 9, 8, 8, 7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2])  # evicts a's blocks
    bm.free("x")
    bm.take_tier_copies()
    keys = keys_of([1, 2, 3, 4, 5])[:2]
    first_hits = bm.cached_prefix(keys)
    assert all(b < FREED for b in first_hits)
    first = bm.allocate_new("b1", 5, first_hits)
    second_hits = bm.cached_prefix(keys)
    assert second_hits == first[:2]  # the blocks the pending copies fill
    assert bm.num_host_hit_positions(second_hits) == 2
    second = bm.allocate_new("b2", 6, second_hits)
    assert second[:2] == first[:2] and all(bm.ref_counts[b] == 2 for b in first[:2])
    bm.check_invariants()
    bm.free("b1")  # b2 still reads the copies
    bm.check_invariants()
    _, offload_in = bm.take_tier_copies()
    assert sorted(offload_in) == sorted(zip((host_slot(e) for e in first_hits), first[:2],
                                            strict=True))
    # After the plan: a third request before b2's cache_blocks copies again (into new blocks).
    third = bm.allocate_new("b3", 5, bm.cached_prefix(keys))
    assert not set(third[:2]) & set(first[:2])
    bm.free("b3")
    assert bm.take_tier_copies() == ([], [])
    bm.free("b2")
    bm.check_invariants()


def test_a_step_admitting_a_family_copies_each_host_slot_in_once():
    """The scheduler admits three requests in one step whose 6-block prefix is found only in
    the host tier: the plan copies each slot in once, all three tables share those blocks,
    every prefix position counts as a host hit, and each request reads back its own tokens
    (the KV-simulating mirror)."""
    bs, prefix = 4, [30 + i for i in range(24)]
    sched = Scheduler(BlockManager(16, bs, num_host_blocks=32), 8, 64, 64,
                      enable_prefix_caching=True)
    mirror = PlanMirror(bs)

    def admit(reqs: list[Request]):
        for r in reqs:
            sched.add_request(r)
        plan = sched.schedule()
        sched.update(mirror.apply(plan))
        sched.block_manager.check_invariants()
        return plan

    def family(name: str, tokens: list[int], n: int, arrival: int) -> list[Request]:
        return [Request(req_id=f"{name}{i}", prompt_token_ids=tokens + [90 + i],
                        sampling=SamplingSpec(temperature=0.0), max_tokens=2,
                        arrival=arrival + i) for i in range(n)]

    admit(family("a", prefix, 1, 0))
    while sched.has_unfinished():
        sched.update(mirror.apply(sched.schedule()))
    admit(family("x", [100 + i for i in range(60)], 1, 1))  # the whole pool: evicts the prefix
    while sched.has_unfinished():
        sched.update(mirror.apply(sched.schedule()))
    hits = sched.counters.prefix_cache_host_hits
    plan = admit(family("b", prefix, 3, 2))
    slots = [slot for slot, _ in plan.offload_in]
    assert len(slots) == len(set(slots)) == len(prefix) // bs
    tables = [r.block_ids for r in plan.new_reqs]
    assert len(tables) == 3 and tables[0][:6] == tables[1][:6] == tables[2][:6]
    assert {d for _, d in plan.offload_in} == set(tables[0][:6])
    assert sched.counters.prefix_cache_host_hits - hits == 3 * len(prefix)
    while sched.has_unfinished():
        sched.update(mirror.apply(sched.schedule()))
        sched.block_manager.check_invariants()

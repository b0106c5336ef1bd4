"""The prefix cache's KV events (sched/kv_events.py) and FlushCache's reset, on the real
BlockManager: exact hashes (the cache keys, recomputed here from the token ids with
prefix_cache.block_key), parent links, token ids, evictions, salts, windowed groups, the
snapshot a late subscriber gets; a random walk checks that a subscriber applying every event
sees exactly the blocks the manager holds cached."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.sched.block_manager import BlockManager
from scheduler_svc.sched.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventLog,
    Tier,
)
from scheduler_svc.sched.prefix_cache import block_key, extend_block_keys

BS = 4


def manager(num_blocks=8, windows=(0,), tier=Tier.DEVICE):
    log = KvEventLog(tier)
    return BlockManager(num_blocks, BS, windows=windows, events=log), log


def compute(bm, seq, tokens, salt=""):
    """Admit `tokens` as a new sequence (from its cached prefix), compute it all, offer its
    full blocks to the cache: what the scheduler does over a request's prefill."""
    keys = extend_block_keys([], tokens, BS, salt)
    hits = bm.cached_prefix(keys[:(len(tokens) - 1) // BS])
    assert bm.allocate_new(seq, len(tokens), hits) is not None
    bm.cache_blocks(seq, keys, tokens, salt)
    return keys


def chain(tokens, salt=""):
    """The hashes the cache must publish, computed from the tokens alone."""
    keys, parent = [], None
    for k in range(len(tokens) // BS):
        parent = block_key(parent, tokens[k * BS:(k + 1) * BS], salt)
        keys.append(parent)
    return keys


def test_stored_events_carry_the_chained_keys_and_tokens():
    bm, log = manager()
    tokens = list(range(100, 111))  # 11 tokens: 2 full blocks
    compute(bm, "a", tokens)
    (ev,) = log.drain()
    k0, k1 = chain(tokens)
    assert ev == BlockStored(block_hashes=(k0, k1), parent_hash=None,
                             token_ids=tuple(tokens[:8]), block_size=BS, cache_salt="",
                             group=0, tier=Tier.DEVICE)
    # The sequence grows past a third block: one more event, chained on the second block.
    tokens += [111, 112]
    bm.allocate("a", len(tokens))
    bm.cache_blocks("a", extend_block_keys([], tokens, BS), tokens)
    (ev,) = log.drain()
    assert ev.block_hashes == (chain(tokens)[2],) and ev.parent_hash == k1
    assert ev.token_ids == tuple(tokens[8:12])
    bm.check_invariants()


def test_hits_and_duplicates_are_not_stored_again():
    bm, log = manager()
    prefix = list(range(8))
    compute(bm, "a", prefix + [50, 51, 52, 53, 54])
    log.drain()
    # "b" starts from a's two cached blocks; only its own third block is new.
    compute(bm, "b", prefix + [60, 61, 62, 63, 64])
    (ev,) = log.drain()
    assert ev.block_hashes == (chain(prefix + [60, 61, 62, 63])[2],)
    assert ev.parent_hash == chain(prefix)[1]
    # "c" computes a's very tokens in blocks of its own (admitted before a was cached, say):
    # the contents are cached already, so nothing is stored.
    bm.allocate_new("c", 9)
    bm.cache_blocks("c", extend_block_keys([], prefix + [50], BS), prefix + [50])
    assert log.drain() == []


def test_eviction_is_removed_and_leaves_the_subscribers_view():
    bm, log = manager(num_blocks=4)
    keys = compute(bm, "a", list(range(12)))  # 3 blocks, all cached
    bm.free("a")
    log.drain()
    assert set(log.live) == set(keys)
    # 3 blocks for "b": one never-used block, then the two least recently used cached ones
    # (a's tail first: a freed table keeps its prefix longest).
    bm.allocate_new("b", 12)
    (ev,) = log.drain()
    assert ev == BlockRemoved(block_hashes=(keys[2], keys[1]), group=0, tier=Tier.DEVICE)
    assert set(log.live) == {keys[0]}
    bm.check_invariants()


def test_salts_separate_hashes_and_ride_on_the_event():
    bm, log = manager(num_blocks=16)
    tokens = list(range(9))
    plain = compute(bm, "a", tokens)
    salted = compute(bm, "b", tokens, salt="tenant-b")
    ev_a, ev_b = log.drain()
    assert set(ev_a.block_hashes).isdisjoint(ev_b.block_hashes)
    assert ev_b.block_hashes == tuple(chain(tokens, "tenant-b")) == tuple(salted[:2])
    assert ev_a.block_hashes == tuple(plain[:2])
    assert (ev_a.cache_salt, ev_b.cache_salt) == ("", "tenant-b")
    # the same salt hits, another salt does not
    assert bm.cached_prefix(extend_block_keys([], tokens, BS, "tenant-b")) != []
    assert bm.cached_prefix(extend_block_keys([], tokens, BS, "tenant-c")) == []


def test_only_the_first_full_attention_group_is_published():
    # group 0 windowed, group 1 full: blocks of group 1 are the published ones
    bm, log = manager(num_blocks=32, windows=(4, 0))
    tokens = list(range(9))
    keys = compute(bm, "a", tokens)
    (ev,) = log.drain()
    assert ev.group == 1
    assert ev.block_hashes == tuple(k + (1).to_bytes(2, "little") for k in keys[:2])
    assert ev.parent_hash is None


def test_reset_refuses_while_blocks_are_held_then_forgets_everything():
    bm, log = manager()
    keys = compute(bm, "a", list(range(12)))
    log.drain()
    assert not bm.reset_prefix_cache()  # "a" holds its blocks: nothing changes
    assert log.drain() == [] and bm.num_cached_blocks == 3
    bm.free("a")
    assert bm.cached_prefix(keys) != []
    assert bm.reset_prefix_cache()
    assert log.drain() == [AllBlocksCleared(tier=Tier.DEVICE)] and log.live == {}
    assert bm.cached_prefix(keys) == [] and bm.num_cached_blocks == 0
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()
    compute(bm, "b", list(range(12)))  # cached again: stored again
    assert [type(e) for e in log.drain()] == [BlockStored]


def test_snapshot_replays_the_live_blocks_parents_first():
    bm, log = manager(num_blocks=16)
    compute(bm, "a", list(range(13)))  # 3 blocks
    compute(bm, "b", list(range(8)) + [70, 71, 72, 73, 74])  # shares 2, adds 1
    compute(bm, "c", [9] * 9, salt="s")  # 2 salted blocks
    log.drain()
    events = log.snapshot(max_blocks_per_event=2)
    assert events[0] == AllBlocksCleared(tier=Tier.DEVICE)
    seen: dict[bytes, bytes | None] = {}
    for ev in events[1:]:
        assert len(ev.block_hashes) <= 2
        assert ev.parent_hash is None or ev.parent_hash in seen  # parents first
        parent = ev.parent_hash
        for h in ev.block_hashes:
            seen[h] = parent
            parent = h
    assert seen == {h: b.parent_hash for h, b in log.live.items()}
    salted = [ev for ev in events[1:] if ev.cache_salt]
    assert [h for ev in salted for h in ev.block_hashes] == chain([9] * 9, "s")


def test_a_run_whose_parent_was_evicted_is_not_published():
    bm, log = manager(num_blocks=8)
    prefix = list(range(8))
    keys = compute(bm, "a", prefix + [1])  # positions 0, 1 cached in a's blocks
    bm.allocate_new("b", 9)  # the same tokens computed apart (admitted before a's were keyed)
    bm.cache_blocks("b", keys, prefix + [1])  # a's blocks hold these contents: nothing new
    bm.free("a")
    bm.allocate_new("c", 20)  # 5 blocks: 3 never cached, then a's two cached ones
    assert [type(e) for e in log.drain()] == [BlockStored, BlockRemoved]
    assert log.live == {}
    # b's third block is chained on a key no subscriber knows any more: not published (a
    # gateway would take the run for the start of a sequence).
    tokens = prefix + [5, 5, 5, 5]
    assert bm.cache_blocks("b", extend_block_keys([], tokens, BS), tokens) == 1
    assert log.drain() == [] and log.live == {}
    bm.check_invariants()


def apply(view: dict[bytes, bytes | None], events) -> None:
    """A subscriber's view: what smg's indexer keeps per worker (hash -> parent)."""
    for ev in events:
        match ev:
            case BlockStored():
                assert ev.parent_hash is None or ev.parent_hash in view, "unplaced run"
                parent = ev.parent_hash
                for h in ev.block_hashes:
                    view[h] = parent
                    parent = h
            case BlockRemoved():
                for h in ev.block_hashes:
                    assert h in view, "removed a block never stored"
                    del view[h]
            case AllBlocksCleared():
                view.clear()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), windows=st.sampled_from([(0,), (0, 0), (8, 0)]))
def test_random_walk_subscriber_view_matches_the_cache(seed, windows):
    rng = random.Random(seed)
    bm, log = manager(num_blocks=24, windows=windows)
    g = bm._event_group
    view: dict[bytes, bytes | None] = {}
    late_joiner: dict[bytes, bytes | None] | None = None
    running: dict[str, list[int]] = {}
    for step in range(60):
        op = rng.random()
        if op < 0.45 and len(running) < 5:
            seq = f"s{step}"
            family = rng.randrange(3)  # shared prefixes
            tokens = [family] * (4 * rng.randrange(1, 3)) + \
                [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            salt = rng.choice(["", "", "t"])
            keys = extend_block_keys([], tokens, BS, salt)
            hits = bm.cached_prefix(keys[:(len(tokens) - 1) // BS])
            if bm.allocate_new(seq, len(tokens), hits) is None:
                continue
            bm.cache_blocks(seq, keys, tokens, salt)
            running[seq] = tokens
        elif op < 0.85 and running:
            bm.free(rng.choice(sorted(running)))
            running = {s: t for s, t in running.items() if s in bm.block_tables}
        elif op < 0.9:
            bm.reset_prefix_cache()
        elif late_joiner is None:
            late_joiner = {}
            apply(late_joiner, log.snapshot(3))
            continue
        events = log.drain()
        apply(view, events)
        if late_joiner is not None:
            apply(late_joiner, events)
        bm.check_invariants()
        assert view == {h: b.parent_hash for h, b in log.live.items()}
        cached = {k for k in bm._cached if (len(k) == 32) == (g == 0)}
        assert set(view) <= cached  # a subscriber never believes in a block that is gone
        if late_joiner is not None:
            assert set(late_joiner) <= set(view)  # less only by orphans left out of it

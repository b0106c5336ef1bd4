"""The engine's KV-event fan-out (engine/kv_event_stream.py): every open subscription gets every
batch in order or is dropped for falling behind, never blocks the publisher, and ends at close.
Random interleavings of subscribe / publish / read / cancel / close come from hypothesis; the
oracle is the sequence of batches published while each subscription was open."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.engine.kv_event_stream import KvEventStream, SubscriberTooSlow
from scheduler_svc.sched.block_manager import BlockManager
from scheduler_svc.sched.kv_events import AllBlocksCleared, BlockStored, KvEventLog, Tier
from scheduler_svc.sched.prefix_cache import extend_block_keys

BS = 2


def store(bm: BlockManager, seq: str, tokens: list[int]) -> None:
    bm.allocate_new(seq, len(tokens))
    bm.cache_blocks(seq, extend_block_keys([], tokens, BS), tokens)


def test_snapshot_then_live_batches_in_order():
    log = KvEventLog()
    bm = BlockManager(16, BS, events=log)
    stream = KvEventStream(log, max_batches=8, snapshot_blocks=1)
    store(bm, "a", [1, 2, 3, 4, 5])  # 2 blocks, pending
    stream.publish()
    sub = stream.subscribe()

    async def read(n):
        return [await sub.get() for _ in range(n)]

    snap = asyncio.run(read(2))  # one block per snapshot batch: 2 batches
    assert [b.snapshot for b in snap] == [(0, 2, 2), (1, 2, 2)]
    assert isinstance(snap[0].events[0], AllBlocksCleared)
    assert [len(e.block_hashes) for b in snap for e in b.events if isinstance(e, BlockStored)] \
        == [1, 1]
    store(bm, "b", [9, 9, 9])
    stream.publish()
    stream.publish()  # nothing pending: no batch
    (live,) = asyncio.run(read(1))
    assert live.snapshot is None and live.events[0].token_ids == (9, 9)
    stream.close()
    assert asyncio.run(sub.get()) is None


def test_the_host_tier_rides_the_same_stream_with_one_clear():
    """Device events, then the host tier's; one AllBlocksCleared per snapshot and per reset,
    since the wire's clear names no tier and a second would wipe the device blocks."""
    log, host_log = KvEventLog(), KvEventLog(Tier.HOST)
    bm = BlockManager(16, BS, events=log, num_host_blocks=8, host_events=host_log)
    stream = KvEventStream(log, host_log, max_batches=8)
    store(bm, "a", [1, 2, 3])
    stream.publish()
    sub = stream.subscribe()

    async def read(n):
        return [await sub.get() for _ in range(n)]

    events = [e for b in asyncio.run(read(2)) for e in b.events]
    assert [type(e) for e in events] == [AllBlocksCleared, BlockStored, BlockStored]
    assert [e.tier for e in events[1:]] == [Tier.DEVICE, Tier.HOST]
    assert events[1].block_hashes == events[2].block_hashes  # written through
    bm.free("a")
    assert bm.reset_prefix_cache()
    store(bm, "b", [5, 6, 7])  # stored again before the loop publishes
    stream.publish()
    (live,) = asyncio.run(read(1))
    assert [(type(e), e.tier) for e in live.events] == [
        (AllBlocksCleared, Tier.DEVICE), (BlockStored, Tier.DEVICE), (BlockStored, Tier.HOST)]


def test_a_full_queue_drops_the_subscriber_not_the_publisher():
    log = KvEventLog()
    bm = BlockManager(64, BS, events=log)
    stream = KvEventStream(log, max_batches=3)
    sub = stream.subscribe()  # 1 snapshot batch, then room for 3 live ones
    for i in range(5):
        store(bm, f"s{i}", [i, i, i])
        stream.publish()  # never waits
    assert stream.num_dropped_subscribers == 1 and stream.num_subscribers == 0
    with pytest.raises(SubscriberTooSlow, match="subscribe again"):
        asyncio.run(sub.get())


ops = st.lists(st.tuples(st.sampled_from(["sub", "pub", "read", "cancel"]),
                         st.integers(0, 7)), max_size=60)


@settings(max_examples=80, deadline=None)
@given(ops=ops, max_batches=st.integers(1, 4))
def test_random_churn(ops, max_batches):
    log = KvEventLog()
    bm = BlockManager(256, BS, events=log)
    stream = KvEventStream(log, max_batches=max_batches)
    subs = []  # (subscription, batches it must still get, batches it got)
    published = 0

    async def drain(sub):
        got = []
        while sub._queue:  # what is queued, without waiting
            got.append(await sub.get())
        return got

    for op, arg in ops:
        match op:
            case "sub":
                subs.append([stream.subscribe(), [], []])
            case "pub":
                store(bm, f"p{published}", [published, arg, published])
                stream.publish()
                published += 1
                for entry in subs:
                    if not entry[0].closed:
                        entry[1].append(published)
            case "read" if subs:
                entry = subs[arg % len(subs)]
                if entry[0].overflowed:
                    with pytest.raises(SubscriberTooSlow):
                        asyncio.run(entry[0].get())
                else:
                    entry[2] += asyncio.run(drain(entry[0]))
            case "cancel" if subs:
                subs[arg % len(subs)][0].cancel()
    stream.close()
    assert stream.num_subscribers == 0
    for sub, expected, got in subs:
        if sub.overflowed:
            continue
        got += asyncio.run(drain(sub))
        assert asyncio.run(sub.get()) is None  # closed: ends once drained
        live = [b for b in got if b.snapshot is None]
        # exactly the batches published while it was open, in order (tokens name the batch)
        assert [b.events[0].token_ids[0] + 1 for b in live] == expected

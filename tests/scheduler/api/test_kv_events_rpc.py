"""SubscribeKvEvents, FlushCache and cache_salt over real gRPC: the real SchedulerServer with a
null-model executor (tests.scheduler.grpc_harness; block size 4, 32 blocks, 64-token context).

Oracles: the block hashes recomputed from the prompt's token ids (prefix_cache.block_key, as
the wire carries them), GetServerStats' prefix-cache counters, and the subscriber's own view
rebuilt from the events it was sent."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2

from protos.folio.v1 import generator_pb2 as pb
from scheduler_svc.api.inputs import MAX_CACHE_SALT_BYTES
from scheduler_svc.api.kv_event_wire import wire_hash
from scheduler_svc.sched.prefix_cache import block_key
from tests.scheduler.grpc_harness import collect, running_server

BS = 4  # the null executor's block size
PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # 2 full blocks + 3 tokens


def chain(ids, salt=""):
    hashes, parent = [], None
    for k in range(len(ids) // BS):
        parent = block_key(parent, ids[k * BS:(k + 1) * BS], salt)
        hashes.append(wire_hash(parent))
    return hashes


def request(ids=PROMPT, salt="", max_tokens=1) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), cache_salt=salt,
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens))


async def generate(h, ids=PROMPT, salt=""):
    return await collect(h.stub.Generate(request(ids, salt)))


class Subscriber:
    """A SubscribeKvEvents stream read in the background into a view (hash -> tokens), as a
    gateway's indexer keeps it."""

    @classmethod
    async def open(cls, channel, start=0):
        self = cls()
        self.call = vpb_grpc.VllmEngineStub(channel).SubscribeKvEvents(
            common_pb2.SubscribeKvEventsRequest(start_sequence_number=start))
        self.batches: list[common_pb2.KvEventBatch] = []
        self.view: dict[int, tuple[int, ...]] = {}
        self.task = asyncio.create_task(self._read())
        return self

    async def _read(self):
        async for batch in self.call:
            self.batches.append(batch)
            for event in batch.events:
                match event.WhichOneof("data"):
                    case "stored":
                        parent = (event.stored.parent_block_hash
                                  if event.stored.HasField("parent_block_hash") else None)
                        assert parent is None or parent in self.view, "an unplaced run"
                        for block in event.stored.blocks:
                            self.view[block.block_hash] = tuple(block.token_ids)
                    case "removed":
                        for h in event.removed.block_hashes:
                            del self.view[h]
                    case "cleared":
                        self.view.clear()

    async def until(self, predicate, timeout=10.0):
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate(self):
            assert not self.task.done() or self.task.exception() is None, self.task.exception()
            assert asyncio.get_running_loop().time() < deadline, (self.view, self.batches[-3:])
            await asyncio.sleep(0.01)


@pytest.fixture
async def h(tiny_tokenizer):
    async with running_server(tiny_tokenizer) as harness:
        await harness.serve()
        yield harness


@pytest.fixture
async def channel(h):
    target = f"127.0.0.1:{h.server.port}"
    async with grpc.aio.insecure_channel(target) as ch:
        yield ch


async def test_stored_events_carry_the_prompts_block_hashes(h, channel):
    sub = await Subscriber.open(channel)
    await sub.until(lambda s: s.batches)  # the (empty) snapshot: AllBlocksCleared
    first = sub.batches[0]
    assert first.sequence_number == 1 and first.snapshot.count == 1
    assert [e.WhichOneof("data") for e in first.events] == ["cleared"]
    await generate(h)
    expected = chain(PROMPT)
    await sub.until(lambda s: set(expected) <= set(s.view))
    stored = [e.stored for b in sub.batches[1:] for e in b.events if e.HasField("stored")]
    blocks = [b for s in stored for b in s.blocks]
    assert [b.block_hash for b in blocks[:2]] == expected
    assert [list(b.token_ids) for b in blocks[:2]] == [PROMPT[:4], PROMPT[4:8]]
    assert all(b.block_size == BS and b.cache_level == 0 for b in blocks)
    assert stored[0].tier == common_pb2.KV_CACHE_TIER_DEVICE and stored[0].medium == "GPU"
    assert not stored[0].HasField("parent_block_hash")
    # the stream's batches are numbered 1, 2, ... and its live events 1, 2, ...
    assert [b.sequence_number for b in sub.batches] == list(range(1, len(sub.batches) + 1))
    live_ids = [e.event_id for b in sub.batches[1:] for e in b.events]
    assert live_ids == list(range(1, len(live_ids) + 1))
    sub.call.cancel()


async def test_a_late_subscriber_resumes_from_a_snapshot_numbered_after_its_cursor(h, channel):
    await generate(h)
    sub = await Subscriber.open(channel, start=41)
    await sub.until(lambda s: set(chain(PROMPT)) <= set(s.view))
    snap = sub.batches[0]
    assert snap.sequence_number == 42 and snap.snapshot.blocks >= 2
    assert all(e.event_id == 0 for e in snap.events)
    assert sub.view[chain(PROMPT)[1]] == tuple(PROMPT[4:8])
    sub.call.cancel()


async def stats(h):
    s = await h.stats()
    return s.prefix_cache_queries, s.prefix_cache_hits


async def test_flush_cache_forgets_every_block(h, channel):
    vllm = vpb_grpc.VllmEngineStub(channel)
    sub = await Subscriber.open(channel)
    await generate(h)
    await generate(h)
    _, hits = await stats(h)
    assert hits == 8  # the second request found both full blocks
    await sub.until(lambda s: set(chain(PROMPT)) <= set(s.view))
    response = await vllm.FlushCache(common_pb2.FlushCacheRequest())
    assert response.success, response.message
    await sub.until(lambda s: not s.view)
    assert sub.batches[-1].events[-1].WhichOneof("data") == "cleared"
    await generate(h)
    assert (await stats(h))[1] == hits  # nothing cached: no hit
    await generate(h)
    assert (await stats(h))[1] == hits + 8  # cached again
    sub.call.cancel()


async def test_flush_cache_refuses_while_a_request_runs_or_waits_for_it(h, channel):
    vllm = vpb_grpc.VllmEngineStub(channel)
    await generate(h)
    call = h.stub.Generate(request(list(range(30, 40)), max_tokens=40))
    await call.read()  # running
    refused = await vllm.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0))
    assert not refused.success and "in flight" in refused.message
    waited = await vllm.FlushCache(common_pb2.FlushCacheRequest(timeout_s=30))
    assert waited.success  # after the request ended
    rest = await collect(call)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    before = (await stats(h))[1]
    await generate(h)
    assert (await stats(h))[1] == before


@pytest.mark.parametrize("timeout_s", [-1.0, float("nan"), float("inf"), 1e9])
async def test_flush_cache_bad_timeouts(h, channel, timeout_s):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await vpb_grpc.VllmEngineStub(channel).FlushCache(
            common_pb2.FlushCacheRequest(timeout_s=timeout_s))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "timeout_s" in e.value.details()


async def test_salts_separate_tenants(h, channel):
    sub = await Subscriber.open(channel)
    await generate(h, salt="tenant-a")
    _, hits0 = await stats(h)
    await generate(h, salt="tenant-b")
    await generate(h)  # no salt: a third namespace
    assert (await stats(h))[1] == hits0
    await generate(h, salt="tenant-a")
    assert (await stats(h))[1] == hits0 + 8
    # the events say which salt each chain was hashed under
    await sub.until(lambda s: len(s.view) >= 6)
    salts = {e.stored.cache_salt for b in sub.batches for e in b.events if e.HasField("stored")}
    assert salts == {"tenant-a", "tenant-b", ""}
    assert set(chain(PROMPT, "tenant-b")) <= set(sub.view)
    sub.call.cancel()


@pytest.mark.parametrize("salt", ["x" * (MAX_CACHE_SALT_BYTES + 1), "é" * 129])
async def test_salt_over_the_limit_is_invalid(h, salt):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(h, salt=salt)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt" in e.value.details() and "256 bytes" in e.value.details()


async def test_a_slow_subscriber_is_disconnected_and_the_loop_goes_on(h, channel):
    """A subscriber that stops reading: once gRPC's flow-control window is full its queue fills
    (the engine's events here are written straight into the engine's log, large enough to
    fill the window soon), it is dropped with RESOURCE_EXHAUSTED, and serving goes on."""
    engine = h.server.engine
    engine.kv_event_stream.max_batches = 4
    slow = vpb_grpc.VllmEngineStub(channel).SubscribeKvEvents(
        common_pb2.SubscribeKvEventsRequest())
    await slow.read()  # subscribed; reads nothing more
    rng = random.Random(0)
    for _ in range(3000):
        ids = [rng.randrange(1000) for _ in range(256 * BS)]
        keys, parent = [], None
        for k in range(256):
            parent = block_key(parent, ids[k * BS:(k + 1) * BS])
            keys.append(parent)
        engine.kv_events.stored(keys, None, ids, "", 0)
        engine.kv_event_stream.publish()  # as the loop does: never waits for a subscriber
        await asyncio.sleep(0)  # let the stream's handler write what it can
        if engine.kv_event_stream.num_dropped_subscribers:
            break
    assert engine.kv_event_stream.num_dropped_subscribers == 1
    with pytest.raises(grpc.aio.AioRpcError) as e:
        while True:
            await slow.read()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "subscribe again" in e.value.details()
    assert (await generate(h))[-1].finish_reason == pb.FINISH_REASON_LENGTH


async def test_shutdown_ends_the_stream_cleanly(tiny_tokenizer):
    async with running_server(tiny_tokenizer) as h:
        await h.serve()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.server.port}") as channel:
            sub = await Subscriber.open(channel)
            await sub.until(lambda s: s.batches)
            await h.server.stop(grace_s=5)
            await asyncio.wait_for(sub.task, 10)  # the iteration ended without an error
            assert await sub.call.code() == grpc.StatusCode.OK


@pytest.mark.parametrize("start", [2**63, 2**64 - 1])
async def test_a_cursor_too_large_is_invalid(h, channel, start):
    call = vpb_grpc.VllmEngineStub(channel).SubscribeKvEvents(
        common_pb2.SubscribeKvEventsRequest(start_sequence_number=start))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.read()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_subscribe_cancel_churn_leaves_no_subscriber(h, channel):
    rng = random.Random(3)
    stub = vpb_grpc.VllmEngineStub(channel)
    calls = []
    for i in range(40):
        if rng.random() < 0.6:
            call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
                start_sequence_number=rng.randrange(2**40)))
            await call.read()
            calls.append(call)
        elif calls:
            calls.pop(rng.randrange(len(calls))).cancel()
        if i % 5 == 0:
            await generate(h, ids=[rng.randrange(100, 200) for _ in range(9)])
    for call in calls:
        call.cancel()
    stream = h.server.engine.kv_event_stream
    deadline = asyncio.get_running_loop().time() + 10
    while stream.num_subscribers:
        assert asyncio.get_running_loop().time() < deadline, stream.num_subscribers
        await asyncio.sleep(0.02)
    assert stream.num_dropped_subscribers == 0


@settings(max_examples=40, deadline=None)
@given(salt=st.text(max_size=300))
def test_salt_validation_fuzz(salt):
    """Any unicode salt: accepted up to 256 bytes of UTF-8, refused with one line beyond."""
    from scheduler_svc.api.inputs import submit_params
    from scheduler_svc.errors import InvalidRequest

    msg = request(salt=salt)
    if len(salt.encode()) <= MAX_CACHE_SALT_BYTES:
        assert submit_params(msg).cache_salt == salt
    else:
        with pytest.raises(InvalidRequest, match="cache_salt may have at most 256 bytes"):
            submit_params(msg)

"""Folio's KV events (`sched/kv_events.py`) as smg-grpc-proto's `KvEventBatch` messages, the
stream of the vLLM worker contract's SubscribeKvEvents.

    Folio                                   smg.grpc.common
    BlockStored(hashes, parent, tokens)     KvCacheEvent.stored: KvBlocksStored, one KvBlock
                                            per block (its hash, its block_size token ids,
                                            block_size, cache_level), parent_block_hash, tier,
                                            medium, locality LOCAL, cache_salt
    BlockRemoved(hashes)                    KvCacheEvent.removed: KvBlocksRemoved
    AllBlocksCleared                        KvCacheEvent.cleared: KvCacheCleared
    a snapshot batch (i of n)               KvEventBatch.snapshot: KvSnapshotChunk(i, n, blocks)

Only one KV group is published (sched/kv_events.py), so `group_idx` stays unset: a consumer
reads the stream as the worker's one prefix index.

A block's hash on the wire is the signed big-endian int64 of its prefix-cache key's first 8
bytes (sha256: distinct prefixes collide with probability ~2^-64). A gateway uses it as the
block's identity (parent links, removals) and matches requests by hashing the token ids
itself, as smg's cache-aware policy does.

Sequence numbers are the stream's own: a stream that a subscriber opens with
start_sequence_number S numbers its batches S + 1, S + 2, ... with no gap, whatever the
subscriber's cursor meant before: every stream starts with a snapshot (AllBlocksCleared and
the live blocks), so resuming is always a resync, never a replay. Live events carry ids 1, 2,
... per stream; a snapshot's synthesized events carry 0, as the proto asks.
"""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2

from scheduler_svc.engine.kv_event_stream import KvEventBatch
from scheduler_svc.errors import InvalidRequest
from scheduler_svc.sched.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, Tier

# A cursor this large leaves no room to number a stream's batches in the uint64 field.
MAX_START_SEQUENCE = 2**63 - 1
TIER = {Tier.DEVICE: common_pb2.KV_CACHE_TIER_DEVICE, Tier.HOST: common_pb2.KV_CACHE_TIER_HOST}
CACHE_LEVEL = {Tier.DEVICE: 0, Tier.HOST: 1}  # KvBlock.cache_level's numbering


def wire_hash(key: bytes) -> int:
    """A prefix-cache key as the proto's int64 block hash."""
    return int.from_bytes(key[:8], "big", signed=True)


def check_start(start_sequence_number: int) -> None:
    if start_sequence_number > MAX_START_SEQUENCE:
        raise InvalidRequest(f"start_sequence_number may be at most {MAX_START_SEQUENCE}, got "
                             f"{start_sequence_number}; use 0 to start from the current state")


def event_message(event: KvEvent, event_id: int) -> common_pb2.KvCacheEvent:
    match event:
        case BlockStored():
            bs = event.block_size
            stored = common_pb2.KvBlocksStored(
                blocks=[common_pb2.KvBlock(block_hash=wire_hash(h),
                                           token_ids=event.token_ids[i * bs:(i + 1) * bs],
                                           block_size=bs, cache_level=CACHE_LEVEL[event.tier])
                        for i, h in enumerate(event.block_hashes)],
                tier=TIER[event.tier], medium=event.tier.value,
                locality=common_pb2.KV_CACHE_LOCALITY_LOCAL)
            if event.parent_hash is not None:
                stored.parent_block_hash = wire_hash(event.parent_hash)
            if event.cache_salt:
                stored.cache_salt = event.cache_salt
            return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
        case BlockRemoved():
            return common_pb2.KvCacheEvent(event_id=event_id, removed=common_pb2.KvBlocksRemoved(
                block_hashes=[wire_hash(h) for h in event.block_hashes],
                cache_level=CACHE_LEVEL[event.tier], tier=TIER[event.tier],
                medium=event.tier.value, locality=common_pb2.KV_CACHE_LOCALITY_LOCAL))
        case AllBlocksCleared():
            return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())
    raise TypeError(f"not a KV event: {event!r}")


def batch_message(batch: KvEventBatch, sequence_number: int, last_event_id: int
                  ) -> tuple[common_pb2.KvEventBatch, int]:
    """The batch as the stream's `sequence_number`-th message; returns it and the last live
    event id used (the stream's counter)."""
    msg = common_pb2.KvEventBatch(sequence_number=sequence_number, timestamp=batch.timestamp)
    if batch.snapshot is not None:
        index, count, num_blocks = batch.snapshot
        msg.snapshot.CopyFrom(common_pb2.KvSnapshotChunk(index=index, count=count,
                                                         blocks=num_blocks))
        msg.events.extend(event_message(e, 0) for e in batch.events)
        return msg, last_event_id
    for event in batch.events:
        last_event_id += 1
        msg.events.append(event_message(event, last_event_id))
    return msg, last_event_id

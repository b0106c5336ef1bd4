"""What the prefix cache tells the outside world: blocks stored, blocks removed, all cleared.

The BlockManager reports every change to the set of cached blocks of one KV group (its first
full-attention group, else group 0: a gateway indexes one chain per position) to a
`KvEventLog`; the engine drains the log after each turn of its loop and fans the events out to
subscribers (`scheduler_svc/engine/kv_event_stream.py`), and the vLLM worker contract streams
them as smg-grpc-proto's `KvEventBatch` (`scheduler_svc/api/kv_event_wire.py`).

    cache_blocks keys positions 3..5 of a table     -> BlockStored([k3, k4, k5], parent=k2)
    allocation evicts the LRU cached block k7       -> BlockRemoved([k7])
    FlushCache, or a new Scheduler (new executor)   -> AllBlocksCleared()

A block's hash is its prefix-cache key (`prefix_cache.block_key`: sha256 over the parent key,
the salt and its token ids), so equal hashes mean equal KV, salt included; the event carries
the block's token ids, which is what a gateway hashes its own requests' tokens against.

Invariants of `KvEventLog`:
- `live` holds exactly the blocks a subscriber that applied every event so far believes cached;
  a Stored run whose parent is not live is not published (a gateway would place it at the
  start of a chain), and neither are its descendants; Removed names only live blocks;
- `live` is ordered parents before children (insertion order: a parent is live before any
  child is stored), so `snapshot()` replays it as a valid sequence of Stored events (leaving
  out blocks whose parent was removed before them).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Tier(enum.Enum):
    """Where cached blocks live; the value is vLLM's `medium` name for it."""

    DEVICE = "GPU"  # the executor's KV pool (a GPU's, or the CPU backend's)
    HOST = "CPU"  # a host-memory tier behind the device pool


@dataclass(frozen=True, kw_only=True)
class BlockStored:
    """A run of consecutive full blocks newly cached: block i holds
    token_ids[i * block_size:(i + 1) * block_size], its parent is block i - 1, the first's is
    `parent_hash` (None: the first block of a sequence)."""

    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    cache_salt: str
    group: int
    tier: Tier


@dataclass(frozen=True, kw_only=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    group: int
    tier: Tier


@dataclass(frozen=True, kw_only=True)
class AllBlocksCleared:
    tier: Tier | None = None  # None: every tier


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, kw_only=True)
class _LiveBlock:
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    cache_salt: str
    group: int


class KvEventLog:
    """Collects one engine's KV events between drains and mirrors the published cache state
    for late subscribers (`snapshot`). Owned by the engine for its whole life; each
    BlockManager it creates reports here for its `tier`."""

    def __init__(self, tier: Tier = Tier.DEVICE):
        self.tier = tier
        self.block_size = 0  # set by the BlockManager that reports here
        self.live: dict[bytes, _LiveBlock] = {}
        self._pending: list[KvEvent] = []

    def stored(self, block_hashes: Sequence[bytes], parent_hash: bytes | None,
               token_ids: Sequence[int], cache_salt: str, group: int) -> None:
        if parent_hash is not None and parent_hash not in self.live:
            return  # its chain is not published: a gateway could not place the run
        bs = self.block_size
        assert len(token_ids) == len(block_hashes) * bs, "a stored run is whole blocks"
        parent = parent_hash
        for i, block_hash in enumerate(block_hashes):
            self.live[block_hash] = _LiveBlock(
                parent_hash=parent, token_ids=tuple(token_ids[i * bs:(i + 1) * bs]),
                cache_salt=cache_salt, group=group)
            parent = block_hash
        self._pending.append(BlockStored(
            block_hashes=tuple(block_hashes), parent_hash=parent_hash,
            token_ids=tuple(token_ids), block_size=bs, cache_salt=cache_salt, group=group,
            tier=self.tier))

    def removed(self, block_hash: bytes, group: int) -> None:
        if self.live.pop(block_hash, None) is None:
            return  # never published
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved) and last.group == group:
            # Evictions come one block at a time: one event per run of them.
            self._pending[-1] = BlockRemoved(block_hashes=(*last.block_hashes, block_hash),
                                             group=group, tier=self.tier)
        else:
            self._pending.append(BlockRemoved(block_hashes=(block_hash,), group=group,
                                              tier=self.tier))

    def cleared(self) -> None:
        """Every cached block is forgotten (FlushCache, or a new BlockManager: a new executor
        or a rebuilt Scheduler starts with an empty cache)."""
        self.live.clear()
        self._pending = [AllBlocksCleared(tier=self.tier)]  # what came before is moot

    def drain(self) -> list[KvEvent]:
        events, self._pending = self._pending, []
        return events

    def snapshot(self, max_blocks_per_event: int) -> list[KvEvent]:
        """The published state as events a fresh subscriber applies: AllBlocksCleared, then
        the live blocks as Stored runs (parents first) of at most `max_blocks_per_event`."""
        events: list[KvEvent] = [AllBlocksCleared(tier=self.tier)]
        run: list[tuple[bytes, _LiveBlock]] = []

        def flush() -> None:
            if run:
                first = run[0][1]
                events.append(BlockStored(
                    block_hashes=tuple(h for h, _ in run), parent_hash=first.parent_hash,
                    token_ids=tuple(t for _, b in run for t in b.token_ids),
                    block_size=self.block_size, cache_salt=first.cache_salt,
                    group=first.group, tier=self.tier))
                run.clear()

        included: set[bytes] = set()
        for block_hash, block in self.live.items():
            if block.parent_hash is not None and block.parent_hash not in included:
                continue  # its parent was evicted first: no chain to hang it on
            included.add(block_hash)
            if run and (block.parent_hash != run[-1][0] or len(run) >= max_blocks_per_event):
                flush()
            run.append((block_hash, block))
        flush()
        return events

"""The engine's KV-event fan-out: batches of the prefix cache's events (`sched/kv_events.py`)
to any number of subscribers, each through a bounded queue of its own.

    Engine loop --publish()--> KvEventStream --offer--> Subscription.queue (<= max_batches) --> RPC
                               (one batch per turn      one per subscriber; the loop never
                                of the loop with events) waits on a subscriber

The stream carries the device tier's log and, with a host tier, the host tier's (`Tier.HOST`
events): each batch holds the device's pending events, then the host's. A subscriber starts
from a snapshot of the cache as published so far (AllBlocksCleared, then every live block of
each tier, parents first, in batches of at most `snapshot_blocks` blocks; the wire's "cleared"
names no tier, so only the first one is sent) and then gets
every batch published after it subscribed, in order. A subscriber that falls `max_batches`
behind is disconnected, not fed with gaps: `Subscription.get` raises `SubscriberTooSlow` (the
RPC ends with RESOURCE_EXHAUSTED), the stream counts it in `num_dropped_subscribers` and logs
a warning, and the subscriber resubscribes to a fresh snapshot. Dropping batches instead would
leave its view of the cache silently wrong, since a stream's sequence numbers are its own (the
wire layer numbers a stream's batches consecutively). `close()` (engine shutdown) ends every subscription after
it has taken what was queued: `get` returns None.

Invariants: every batch published while a subscription is open reaches it exactly once and in
order, or the subscription ends with SubscriberTooSlow; `publish` and `subscribe` never await.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

import structlog

from scheduler_svc.errors import Overloaded
from scheduler_svc.sched.kv_events import AllBlocksCleared, BlockStored, KvEvent, KvEventLog

log = structlog.get_logger("folio.scheduler.kv_events")

MAX_QUEUED_BATCHES = 1024  # per subscriber: about 1024 steps' worth of events
SNAPSHOT_BLOCKS = 256  # blocks per snapshot batch: ~4 k token ids at block size 16


@dataclass(frozen=True, kw_only=True)
class KvEventBatch:
    timestamp: float  # time.time() when published (or when the snapshot was taken)
    events: tuple[KvEvent, ...]
    # A snapshot batch: (index, count, live blocks in the whole snapshot); None for a live one.
    snapshot: tuple[int, int, int] | None = None


class SubscriberTooSlow(Overloaded):
    pass


class Subscription:
    """One subscriber's queue. Filled by the stream (never blocking), drained by `get`."""

    def __init__(self, stream: KvEventStream, max_batches: int):
        self._stream = stream
        self._max_batches = max_batches
        self._limit = max_batches  # raised by the snapshot's length: it never counts as lag
        self._queue: deque[KvEventBatch] = deque()
        self._ready = asyncio.Event()
        self.closed = False
        self.overflowed = False

    def _offer(self, batch: KvEventBatch) -> bool:
        """Queue `batch`; False (and the subscription ends) if the queue is full."""
        if len(self._queue) >= self._limit:
            self.overflowed = True
            self._close()
            return False
        self._queue.append(batch)
        self._ready.set()
        return True

    def _close(self) -> None:
        self.closed = True
        self._ready.set()

    async def get(self) -> KvEventBatch | None:
        """The next batch; None once the stream closed and the queue is drained."""
        while True:
            if self.overflowed:
                raise SubscriberTooSlow(
                    f"this KV event subscriber fell {self._max_batches} batches behind the "
                    "engine and was disconnected; subscribe again to resume from a snapshot")
            if self._queue:
                return self._queue.popleft()
            if self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()

    def cancel(self) -> None:
        """The subscriber went away (or is done): stop queueing for it."""
        self._stream._subscribers.discard(self)
        self._close()


class KvEventStream:
    def __init__(self, log: KvEventLog, host_log: KvEventLog | None = None,
                 max_batches: int = MAX_QUEUED_BATCHES, snapshot_blocks: int = SNAPSHOT_BLOCKS):
        if max_batches < 1 or snapshot_blocks < 1:
            raise ValueError(f"need max_batches >= 1 and snapshot_blocks >= 1, got "
                             f"{max_batches} and {snapshot_blocks}")
        self.log = log
        self.host_log = host_log
        self.max_batches = max_batches
        self.snapshot_blocks = snapshot_blocks
        self._subscribers: set[Subscription] = set()
        self._closed = False
        self.num_batches_published = 0
        self.num_dropped_subscribers = 0

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def subscribe(self) -> Subscription:
        """A subscription whose first batches are the snapshot of the published state. Call
        `publish` first so that the snapshot does not leave out pending events."""
        sub = Subscription(self, self.max_batches)
        events = self.log.snapshot(self.snapshot_blocks)
        if self.host_log is not None:  # its own AllBlocksCleared would clear the device's
            events += self.host_log.snapshot(self.snapshot_blocks)[1:]
        num_blocks = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
        # AllBlocksCleared rides with the first run of blocks: one batch per Stored event.
        chunks = [events[:2], *([e] for e in events[2:])]
        now = time.time()
        sub._limit += len(chunks)
        for i, chunk in enumerate(chunks):
            sub._queue.append(KvEventBatch(timestamp=now, events=tuple(chunk),
                                           snapshot=(i, len(chunks), num_blocks)))
        sub._ready.set()
        if self._closed:
            sub._close()
        else:
            self._subscribers.add(sub)
        return sub

    def publish(self) -> None:
        """Send the log's pending events, if any, to every subscriber as one batch."""
        events = self.log.drain()
        if self.host_log is not None:
            # The host tier is cleared only with the device (reset, a retired scheduler), whose
            # AllBlocksCleared went first; a second, tierless on the wire, would wipe the
            # device blocks stored between them.
            events += [e for e in self.host_log.drain() if not isinstance(e, AllBlocksCleared)]
        if not events:
            return
        batch = KvEventBatch(timestamp=time.time(), events=tuple(events))
        self.num_batches_published += 1
        for sub in list(self._subscribers):
            if not sub._offer(batch):
                self._subscribers.discard(sub)
                self.num_dropped_subscribers += 1
                log.warning("KV event subscriber disconnected: it fell behind",
                            max_batches=self.max_batches,
                            num_dropped_subscribers=self.num_dropped_subscribers)

    def close(self) -> None:
        """Shutdown: every subscription ends once it has taken what is queued."""
        self._closed = True
        for sub in self._subscribers:
            sub._close()
        self._subscribers.clear()

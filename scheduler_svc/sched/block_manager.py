"""The KV block manager: block tables, reference counts, prefix caching, copy-on-write, swap,
and the blocks that sliding windows let go.

The executor's KV pool is `num_blocks` GPU blocks of `block_size` token slots (plus an optional
CPU swap pool of `num_cpu_blocks`). The scheduler owns every block table; the executor only
reads them from step plans. Tables are keyed by sequence id (a request id today).

    gpu pool:    [ b0 | b1 | b2 | b3 | b4 | b5 | b6 | b7 ]
    ref_counts:     2    1    1    0    1    0    0    0
    keys:          k0                       k5            (full, computed, cached blocks)
    tables:     "a" -> [b0, b1]       "b" -> [b0, b2, b4]     (b0: a shared cached prefix)
    free:        b6 b7               (ref 0, no key: handed out first)
    evictable:   b5                  (ref 0, keyed: reusable until evicted, LRU first)
    free(b3)... b3 is in `free` too; "free blocks" = free + evictable

KV groups. The executor splits a model's layers into `len(windows)` groups of equally many
layers, each group's layers of one attention kind: windows[g] = 0 (full attention) or W (each
query sees its last W positions). A block id names one block of every layer of the group that
holds it, so the groups share the pool and every position of a sequence takes one block per
group. A table holds the groups interleaved, G entries per block position::

    G = 2, windows = (0, 4), block_size 2, 7 tokens:   [a0 s0 | a1 s1 | a2 s2 | a3 s3]
    after the window moves past positions 0-3:          [a0 -- | a1 -- | a2 s2 | a3 s3]

A position's block of a windowed group is released (`--`, FREED in the table) once it lies
wholly below the window of every query still to come: below num_computed - W + 1 - margin,
`margin` being the positions a step may roll back (rejected speculative proposals). A model
with one full-attention group (G = 1, windows = (0,)) has plain tables, one entry per position.
The executor never reads a FREED entry: attention reads a sequence's keys from its first
query's window on (the plan sends FREED as block 0).

API (each call all-or-nothing: None or an exception changes nothing):
- `allocate_new(seq, num_tokens, cached_block_ids)`: a new table starting with cached blocks
  (prefix-cache hits, from `cached_prefix(keys)`), grown to hold `num_tokens` tokens.
- `allocate(seq, num_tokens)`: grow a table. If a group's last block is partly filled and
  shared (ref count > 1), the write would clobber the other holders: the block is replaced by a
  fresh copy and `Allocation.copies` holds (src, dst) for the plan's `block_copies`.
- `num_blocks_needed(seq, num_tokens)`: free blocks `allocate` would take (copies included);
  `num_blocks_needed_many` sums it over many sequences.
- `release_outside_windows(seq, num_computed, offered_only)`: free the windowed groups' blocks
  no query from position num_computed on can see (with prefix caching, only those already
  offered to the cache, so they stay hits). Returns how many blocks became free.
- `fork(parent, child)`: the child's table is the parent's; every block's ref count +1. The
  first of them to write into a shared, partly filled last block gets the copy.
- `cache_blocks(seq, keys, token_ids, salt)`: offer the table's leading full, computed
  positions to the prefix cache under their keys (`prefix_cache.extend_block_keys`), each
  group's block under the key and its group. A key already cached in another block stays with
  that block.
- `reset_prefix_cache()`: forget every cached block, as vLLM's reset: only while no table holds
  a block (False, nothing changed, otherwise).
- `cached_prefix(keys)`: the longest run of leading positions a new sequence can start from:
  every full-attention group holds all of them, every windowed group those its window needs;
  an entry < FREED is a hit in the host tier (`host_slot(entry)`), which `allocate_new`
  copies back into a fresh block.
- `swap_out(seqs)` / `swap_in(seqs)`: move a group of tables to the CPU pool and back; each
  distinct block moves once (shared blocks stay shared), FREED entries stay FREED, and the
  (src, dst) pairs go in the plan.
- `take_tier_copies()`: the host-tier copies the next plan carries; `forget_host_blocks(slots)`
  drops what a failed plan would have written.
- `free(seq)`: drop a table (GPU or CPU). Keyed blocks whose ref count drops to 0 become
  evictable, the table's leading blocks most recently (a prefix outlives its tail).

The host tier (`num_host_blocks` > 0): a second, larger pool of KV blocks in host memory
behind the device pool, holding prefix-cache blocks only. Every block `cache_blocks` keys is
written through to it (so a block evicted from the device keeps its key there, and, later, the
tier can outlive the executor); a prefix hit found only in the tier is copied back into a fresh
device block before the step that reads it, instead of being recomputed::

    device keyed:  k0 k1 k2          (tables, evictable; the device's LRU)
    host keyed:    k0 k1 k2 k3 k4    (k3, k4: evicted from the device, still hits)
    a new request with k0..k4:  table [b0 b1 b2 d3 d4], offload_in [(h3, d3), (h4, d4)]

One LRU across the tiers: a device hit and a device eviction move the key's host slot to the
tier's most recently used end, so the tier drops the blocks least recently used anywhere.
Copies are collected between plans and taken by `take_tier_copies` for the next plan, whose
executor runs `offload_out` (device -> host) before anything else and `offload_in` (host ->
device) after the swaps, before copy-on-write and the forward pass. So a device block a pending
copy-out reads may be handed out again in the same plan (it is read first), and a slot written
by a copy-out may be read by a copy-in of the same plan; but a slot a pending copy names
(`_host_busy`) is never reused before its plan is built, and a copy into a table freed before
then is dropped. A block copied in is keyed on the device only by `cache_blocks` after its
step, like any computed block; until the plan is built, a second request hitting the same slot
shares the block the pending copy fills (a device hit: one copy per slot per plan), and a copy
is dropped only when no table holds its block any more.

KV events (`kv_events.py`, when an `events` log is given): blocks of the first full-attention
group (else group 0) newly keyed by `cache_blocks` are reported stored, in runs of consecutive
positions, with their token ids (`token_ids`, the sequence's tokens) and salt; a keyed block
evicted by allocation is reported removed; `reset_prefix_cache` reports all cleared. The host
tier reports the same to `host_events` (a `Tier.HOST` log): written-through blocks stored,
slots reused removed, all cleared on reset.

Invariants (`check_invariants`, asserted in tests):
- a GPU block is in exactly one of: a table (ref > 0), `free` (ref 0, no key), `evictable`
  (ref 0, keyed); a block's ref count is the number of table entries naming it;
- `_key_of` and `_cached` are inverse maps: one block per (key, group), one per block; a keyed
  block is full and its contents are what its key says, and nothing ever writes into it;
- a table holds G * blocks_for(n) entries, n = the tokens it was sized for; FREED entries sit
  only in windowed groups, below the positions their windows still need; a sequence's table is
  on the GPU or on the CPU, never both; CPU ref counts likewise count CPU table entries.
- host slots are free or keyed (`_host_key_of` / `_host_cached` inverse, every keyed slot in
  the host LRU); the pending copies name distinct host slots (copy-outs), distinct host slots
  and distinct device blocks (copy-ins), from keyed slots into held blocks, and exactly they
  are `_host_busy`.
Allocation takes a never-cached free block first, else evicts the least recently used
evictable block and drops its key, so a request never reads a block that was reassigned.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from scheduler_svc.sched.kv_events import KvEventLog

FREED = -1  # a table entry whose block left every window of its group and was released


def host_entry(slot: int) -> int:
    """A `cached_prefix` entry naming host-tier slot `slot` (every such entry is < FREED)."""
    return -2 - slot


def host_slot(entry: int) -> int:
    """The host-tier slot a `cached_prefix` entry < FREED names."""
    return -2 - entry


def blocks_to_hold(num_tokens: int, chunk: int, block_size: int, windows: Sequence[int],
                   margin: int = 0) -> int:
    """The most blocks a sequence of `num_tokens` tokens, computed `chunk` tokens a step, holds
    at once: every position in full-attention groups, in windowed groups the positions of one
    chunk and the window behind it (plus the rollback margin)."""
    positions = -(-num_tokens // block_size)
    total = 0
    for w in windows:
        total += min(positions, -(-(w + chunk + margin) // block_size) + 1) if w else positions
    return total


def longest_context(num_blocks: int, block_size: int, windows: Sequence[int], chunk: int,
                    limit: int) -> int:
    """The longest sequence (at most `limit` tokens) that runs alone in a pool of `num_blocks`
    blocks, computed `chunk` tokens a step; 0 if none fits."""
    lo, hi = 0, limit  # blocks_to_hold grows with the length: the last length that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_to_hold(mid, chunk, block_size, windows) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Allocation(NamedTuple):
    """What one `allocate` call did. A NamedTuple, not a frozen dataclass: one is made per
    running request per step, and a frozen dataclass's __init__ costs several times more."""

    new_block_ids: list[int]  # appended to the table (G per new position, interleaved)
    copies: tuple[tuple[int, int], ...] = ()  # (src, dst): dst replaced the shared block src


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 windows: Sequence[int] = (0,), window_margin: int = 0,
                 events: KvEventLog | None = None, num_host_blocks: int = 0,
                 host_events: KvEventLog | None = None):
        if num_blocks < 1 or block_size < 1 or num_cpu_blocks < 0 or num_host_blocks < 0:
            raise ValueError(f"need at least one block of at least one token, got "
                             f"num_blocks={num_blocks}, block_size={block_size}, "
                             f"num_cpu_blocks={num_cpu_blocks}, num_host_blocks={num_host_blocks}")
        if not windows or any(w < 0 for w in windows) or window_margin < 0:
            raise ValueError(f"KV groups need windows >= 0 (0: full attention) and a margin "
                             f">= 0, got windows={list(windows)}, margin={window_margin}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        self.window_margin = window_margin
        self._windowed = [(g, w) for g, w in enumerate(self.windows) if w]
        self._full_groups = [g for g, w in enumerate(self.windows) if not w]
        self.events = events
        self._event_group = self._full_groups[0] if self._full_groups else 0
        if events is not None:
            events.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._key_of: dict[int, bytes] = {}
        self._cached: dict[bytes, int] = {}
        self.block_tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}  # tokens each table (GPU or CPU) is sized for
        self._num_offered: dict[str, int] = {}  # leading positions already offered to the cache
        self._released_to: dict[str, int] = {}  # positions below this were window-released
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_ref_counts = [0] * num_cpu_blocks
        self._cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self.cpu_tables: dict[str, list[int]] = {}
        # The host tier of the prefix cache (see the module docstring).
        self.num_host_blocks = num_host_blocks
        self.host_events = host_events
        if host_events is not None:
            host_events.block_size = block_size
        self._host_free: deque[int] = deque(range(num_host_blocks))
        self._host_lru: OrderedDict[int, None] = OrderedDict()  # keyed slots, LRU first
        self._host_key_of: dict[int, bytes] = {}
        self._host_cached: dict[bytes, int] = {}
        self._offload_out: list[tuple[int, int]] = []  # (device, host) copies for the next plan
        self._offload_in: dict[int, int] = {}  # host slot -> device block, for the next plan
        self._host_busy: set[int] = set()  # host slots the pending copies name

    # ---- sizes -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_cached_host_blocks(self) -> int:
        return len(self._host_cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Block positions (one block of each group at each) that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)  # ceil

    def blocks_to_hold(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of `num_tokens` tokens computed `chunk` tokens a step
        ever holds at once (`blocks_to_hold` below)."""
        return blocks_to_hold(num_tokens, chunk, self.block_size, self.windows,
                              self.window_margin)

    def block_table(self, seq_id: str) -> list[int]:
        return list(self.block_tables.get(seq_id, ()))

    def plan_table(self, seq_id: str) -> list[int]:
        """The table as a plan sends it: FREED entries as block 0 (never read)."""
        table = self.block_tables.get(seq_id, ())
        return [b if b != FREED else 0 for b in table] if self._windowed else list(table)

    @property
    def windowed(self) -> bool:
        """Whether some KV group has a sliding window (blocks are released as it moves)."""
        return bool(self._windowed)

    def cpu_block_table(self, seq_id: str) -> list[int]:
        return list(self.cpu_tables.get(seq_id, ()))

    @property
    def num_windowed_blocks(self) -> int:
        """GPU blocks the windowed groups' table entries name now (a shared one once)."""
        G = self.num_groups
        return len({b for table in self.block_tables.values()
                    for g, _ in self._windowed for b in table[g::G] if b != FREED})

    def num_blocks_held(self, seq_id: str) -> int:
        """GPU blocks `seq_id`'s table names (FREED entries aside)."""
        return sum(1 for b in self.block_tables.get(seq_id, ()) if b != FREED)

    def num_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Free blocks that `allocate(seq_id, num_tokens)` would take."""
        num_fresh, copies = self._growth(seq_id, num_tokens)
        return num_fresh * self.num_groups + len(copies)

    def num_offered(self, seq_id: str) -> int:
        """How many of the table's leading positions were already offered to the prefix cache."""
        return self._num_offered.get(seq_id, 0)

    # ---- growing and freeing ---------------------------------------------------------------

    def num_blocks_needed_many(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> int:
        """sum(num_blocks_needed(s, n) for s, n in zip(seq_ids, num_tokens)), in one pass: the
        scheduler asks it for every running request at every step."""
        if self.num_groups > 1:
            return sum(self.num_blocks_needed(s, n)
                       for s, n in zip(seq_ids, num_tokens, strict=True))
        bs, tables, sizes, refs = self.block_size, self.block_tables, self._num_tokens, \
            self.ref_counts
        total = 0
        for seq_id, n in zip(seq_ids, num_tokens, strict=True):
            need = -(-n // bs)
            table = tables.get(seq_id)
            if table:
                need -= len(table)
                have = sizes.get(seq_id, 0)
                # _growth's copy-on-write condition (a shared, partly filled last block).
                copy = n > have and have % bs != 0 and refs[table[-1]] > 1
                need = (need if need > 0 else 0) + copy
            total += need
        return total

    def allocate(self, seq_id: str, num_tokens: int) -> Allocation | None:
        """Grow `seq_id`'s table to hold `num_tokens` tokens in total; None (nothing changed)
        when too few blocks are free: the caller decides whom to preempt."""
        assert seq_id not in self.cpu_tables, f"{seq_id} is swapped out"
        table = self.block_tables.get(seq_id)
        if table and self.num_groups == 1 and num_tokens <= len(table) * self.block_size:
            # Most decodes: the tokens fit the last block. Only a shared, partly filled last
            # block being written needs more (the copy below).
            have = self._num_tokens.get(seq_id, 0)
            if num_tokens <= have:
                return Allocation([])
            if have % self.block_size == 0 or self.ref_counts[table[-1]] == 1:
                self._num_tokens[seq_id] = num_tokens
                return Allocation([])
        num_fresh, copy_at = self._growth(seq_id, num_tokens)
        if num_fresh * self.num_groups + len(copy_at) > self.num_free_blocks:
            return None
        table = self.block_tables.setdefault(seq_id, [])
        copies = []
        for i in copy_at:
            src, dst = table[i], self._take_free_block()
            self.ref_counts[src] -= 1  # > 0 still: the other holders keep it
            table[i] = dst
            copies.append((src, dst))
        # usually stays empty: a decode writes into its last block
        new_block_ids = [self._take_free_block() for _ in range(num_fresh * self.num_groups)]
        table.extend(new_block_ids)
        if num_tokens > self._num_tokens.get(seq_id, 0):
            self._num_tokens[seq_id] = num_tokens
        return Allocation(new_block_ids, tuple(copies))

    def release_outside_windows(self, seq_id: str, num_computed: int,
                                offered_only: bool = False) -> int:
        """Release the windowed groups' blocks that no query at position >= num_computed -
        margin can see (wholly below its window). `offered_only` (prefix caching): only
        positions already offered to the cache, so a block leaves keyed (evictable, a later
        request's hit) rather than unkeyed before its step's result has come back. Returns how
        many blocks became free."""
        if not self._windowed or (table := self.block_tables.get(seq_id)) is None:
            return 0
        G, bs, released = self.num_groups, self.block_size, 0
        start = self._released_to.get(seq_id, 0)
        first_query = max(0, num_computed - self.window_margin)
        last = len(table) // G - 1  # the newest position always stays
        if offered_only:
            last = min(last, self._num_offered.get(seq_id, 0))
        end = last
        for g, w in self._windowed:
            # Positions below group_end are wholly out of the window of every query to come.
            group_end = min(max(0, first_query - w + 1) // bs, last)
            end = min(end, group_end)
            for k in range(start, group_end):
                if (block_id := table[k * G + g]) != FREED:
                    table[k * G + g] = FREED
                    released += self._release(block_id)
        if end > start:  # every windowed group released below `end`
            self._released_to[seq_id] = end
        return released

    def cached_prefix(self, keys: Iterable[bytes]) -> list[int]:
        """The table (G entries per position, FREED where a window needs none) of the longest
        run of leading positions of `keys` a new sequence can start from: each full-attention
        group's block is cached at every one, each windowed group's at the positions the window
        of the first position after them needs (prefix-cache hits)."""
        G, bs = self.num_groups, self.block_size
        hits: list[list[int | None]] = []  # per position, per group: the cached block or None
        for key in keys:
            row = [self._lookup(self._group_key(key, g)) for g in range(G)]
            if any(row[g] is None for g in self._full_groups):
                break
            hits.append(row)
        for n in range(len(hits), 0, -1):  # the longest usable run
            usable = True
            for g, w in self._windowed:
                first_needed = max(0, n * bs - w + 1) // bs
                if any(hits[k][g] is None for k in range(first_needed, n)):
                    usable = False
                    break
            if usable:
                table = []
                for k in range(n):
                    for g in range(G):
                        w = self.windows[g]
                        needed = not w or k >= max(0, n * bs - w + 1) // bs
                        block_id = hits[k][g]
                        table.append(block_id if needed and block_id is not None else FREED)
                return table
        return []

    def _lookup(self, key: bytes) -> int | None:
        """The device block cached under `key`, else its host-tier slot as a `host_entry`."""
        block_id = self._cached.get(key)
        if block_id is None and (slot := self._host_cached.get(key)) is not None:
            # A slot the next plan already copies in is read from that copy, shared as a
            # device hit: the copy lands before the step that reads it.
            return self._offload_in.get(slot, host_entry(slot))
        return block_id

    def num_host_hit_positions(self, cached_block_ids: Sequence[int]) -> int:
        """Positions of a `cached_prefix` table that some group reads from the host tier: by
        a copy of its own, or by sharing the block a pending copy fills."""
        G, copied_in = self.num_groups, set(self._offload_in.values())
        return sum(1 for k in range(len(cached_block_ids) // G)
                   if any(b < FREED or b in copied_in
                          for b in cached_block_ids[k * G:(k + 1) * G]))

    def allocate_new(self, seq_id: str, num_tokens: int,
                     cached_block_ids: Sequence[int] = ()) -> list[int] | None:
        """A table for a new sequence: the cached blocks (a `cached_prefix` table), then fresh
        ones up to `num_tokens`. Returns the whole table, or None (nothing changed) when too few
        blocks are free."""
        assert seq_id not in self.block_tables and seq_id not in self.cpu_tables, seq_id
        G = self.num_groups
        assert len(cached_block_ids) % G == 0, "a cached prefix holds G entries per position"
        num_cached = len(cached_block_ids) // G
        num_fresh = self.blocks_for(num_tokens) - num_cached
        assert num_fresh >= 0, "cached blocks cover more than the tokens asked for"
        hits = [b for b in cached_block_ids if b >= 0]
        num_host = sum(1 for b in cached_block_ids if b < FREED)  # each takes a device block
        # Hits that sit in the evictable pool leave it, so they count against the free blocks.
        num_revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        if num_fresh * G + num_revived + num_host > self.num_free_blocks:
            return None
        # The first position read from the host tier, by a copy of its own or one shared.
        copied_in = set(self._offload_in.values())
        first_host = next((i // G for i, b in enumerate(cached_block_ids)
                           if b < FREED or b in copied_in), num_cached)
        for block_id in hits:  # before taking fresh ones: those may evict
            if self.ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self.ref_counts[block_id] += 1
            if self._host_cached and (key := self._key_of.get(block_id)) is not None \
                    and (slot := self._host_cached.get(key)) is not None:
                self._host_lru.move_to_end(slot)  # one LRU across the tiers
        table = list(cached_block_ids)
        for i, entry in enumerate(table):
            if entry < FREED:  # copied back into a fresh device block before the step
                slot, block_id = host_slot(entry), self._take_free_block()
                assert slot not in self._offload_in, "a host slot copied in twice"
                table[i] = block_id
                self._offload_in[slot] = block_id
                self._host_busy.add(slot)
                self._host_lru.move_to_end(slot)
        table += [self._take_free_block() for _ in range(num_fresh * G)]
        self.block_tables[seq_id] = table
        self._num_tokens[seq_id] = num_tokens
        # Device hits are cached already; blocks copied in from the host tier are keyed by
        # the first `cache_blocks` after the step that reads them.
        self._num_offered[seq_id] = first_host
        if self._windowed:
            # No windowed group holds a block below the first position any of them holds.
            held = [k for k in range(num_cached)
                    if any(table[k * G + g] != FREED for g, _ in self._windowed)]
            self._released_to[seq_id] = held[0] if held else num_cached
        return list(table)

    def fork(self, parent_seq_id: str, child_seq_id: str) -> None:
        """The child shares every block of the parent's GPU table (ref counts +1)."""
        assert child_seq_id not in self.block_tables and child_seq_id not in self.cpu_tables
        table = self.block_tables[parent_seq_id]
        for block_id in table:
            if block_id != FREED:
                self.ref_counts[block_id] += 1
        self.block_tables[child_seq_id] = list(table)
        self._num_tokens[child_seq_id] = self._num_tokens[parent_seq_id]
        self._num_offered[child_seq_id] = self._num_offered.get(parent_seq_id, 0)
        if parent_seq_id in self._released_to:
            self._released_to[child_seq_id] = self._released_to[parent_seq_id]

    def free(self, seq_id: str) -> int:
        """Drop `seq_id`'s table (GPU or CPU). Returns how many blocks became free; unknown ids
        are a no-op (already freed)."""
        self._num_tokens.pop(seq_id, None)
        self._num_offered.pop(seq_id, None)
        self._released_to.pop(seq_id, None)
        if (cpu_table := self.cpu_tables.pop(seq_id, None)) is not None:
            return sum(self._release_cpu(c) for c in cpu_table if c != FREED)
        table = self.block_tables.pop(seq_id, None)
        if table is None:
            return 0
        released = sum(self._release(b) for b in reversed(table) if b != FREED)
        if self._offload_in:
            # A copy into a block no table holds any more would clobber its next holder; one
            # another table shares (it hit this table's copy) still lands.
            self._offload_in = {h: d for h, d in self._offload_in.items() if self.ref_counts[d]}
            self._host_busy = {h for _, h in self._offload_out} | set(self._offload_in)
        return released

    # ---- prefix cache ----------------------------------------------------------------------

    def cache_blocks(self, seq_id: str, keys: Sequence[bytes], token_ids: Sequence[int] = (),
                     salt: str = "") -> int:
        """Key the table's leading positions with `keys` (one per full, computed position):
        each group's block under (key, group). `token_ids` and `salt` (the sequence's, whose
        blocks the keys were made from) are needed only for KV events. Returns how many blocks
        became cached."""
        table = self.block_tables.get(seq_id)
        if table is None:
            return 0
        G = self.num_groups
        start, end = self._num_offered.get(seq_id, 0), min(len(keys), len(table) // G)
        num_cached = 0
        stored: list[int] = []  # positions whose event-group block became cached
        host_stored: list[int] = []  # ... and was written through to the host tier
        for k in range(start, end):
            for g in range(G):
                block_id = table[k * G + g]
                key = self._group_key(keys[k], g)
                if block_id == FREED or block_id in self._key_of or key in self._cached:
                    continue  # released, already a hit, or the same contents in another block
                self._key_of[block_id] = key
                self._cached[key] = block_id
                num_cached += 1
                if g == self._event_group:
                    stored.append(k)
                if self.num_host_blocks and self._write_through(block_id, key) \
                        and g == self._event_group:
                    host_stored.append(k)
        self._num_offered[seq_id] = max(start, end)
        if self.events is not None and stored:
            self._report_stored(self.events, stored, keys, token_ids, salt)
        if self.host_events is not None and host_stored:
            self._report_stored(self.host_events, host_stored, keys, token_ids, salt)
        return num_cached

    def _write_through(self, block_id: int, key: bytes) -> bool:
        """Give a newly keyed device block's key a host-tier slot, copied into by the next
        plan; True if a slot was newly written. A key the tier holds already only moves to its
        most recently used end; with every slot named by a pending copy, nothing is written."""
        slot = self._host_cached.get(key)
        if slot is not None:
            self._host_lru.move_to_end(slot)
            return False
        slot = self._take_host_slot()
        if slot is None:
            return False
        self._host_key_of[slot] = key
        self._host_cached[key] = slot
        self._host_lru[slot] = None
        self._offload_out.append((block_id, slot))
        self._host_busy.add(slot)
        return True

    def _take_host_slot(self) -> int | None:
        """A free host slot, else the least recently used one no pending copy names (its key
        is forgotten), else None."""
        if self._host_free:
            return self._host_free.popleft()
        for slot in self._host_lru:
            if slot not in self._host_busy:
                self._forget_host_slot(slot)
                return self._host_free.pop()  # the slot just freed
        return None

    def _forget_host_slot(self, slot: int) -> None:
        """Drop host slot `slot`'s key: the slot becomes free."""
        key = self._host_key_of.pop(slot)
        del self._host_cached[key]
        del self._host_lru[slot]
        self._host_free.append(slot)
        if self.host_events is not None:
            self.host_events.removed(key, self._event_group)

    def take_tier_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host-tier copies the next plan must carry: (offload_out as (device, host)
        pairs, offload_in as (host, device) pairs). The plan is built from them now, so their
        slots may be reused by later allocations: the executor runs plans in order."""
        out, into = self._offload_out, list(self._offload_in.items())
        self._offload_out, self._offload_in, self._host_busy = [], {}, set()
        return out, into

    def host_key(self, slot: int) -> bytes:
        """The key host slot `slot` holds (or, named by a pending copy-out, will hold)."""
        return self._host_key_of[slot]

    def host_index(self) -> dict[int, bytes]:
        """Slot -> key of every keyed host slot, least recently used first: what the tier
        promises (a copy-out in a plan the executor never ran included; the tier file's
        records tell which promises were kept)."""
        return {slot: self._host_key_of[slot] for slot in self._host_lru}

    def adopt_host_blocks(self, index: Mapping[int, bytes]) -> None:
        """Start the host tier with `index` (slot -> key, least recently used first: a
        retired BlockManager's `host_index`, less what the tier file could not vouch for),
        on a new executor that maps the same tier. Published host blocks not adopted are
        reported removed."""
        assert not self._host_key_of and not self._offload_out, "adopting into a used tier"
        for slot, key in index.items():
            assert 0 <= slot < self.num_host_blocks and key not in self._host_cached, slot
            self._host_key_of[slot] = key
            self._host_cached[key] = slot
            self._host_lru[slot] = None
        self._host_free = deque(s for s in range(self.num_host_blocks)
                                if s not in self._host_key_of)
        if self.host_events is not None:
            for key in [k for k in self.host_events.live if k not in self._host_cached]:
                self.host_events.removed(key, self._event_group)

    def forget_host_blocks(self, slots: Iterable[int]) -> None:
        """Forget what these host slots hold (the plan that would have written them failed).
        Forgetting is always safe: a slot's key is only a promise of its contents."""
        for slot in slots:
            if slot in self._host_key_of and slot not in self._host_busy:
                self._forget_host_slot(slot)

    def _report_stored(self, events: KvEventLog, positions: list[int], keys: Sequence[bytes],
                       token_ids: Sequence[int], salt: str) -> None:
        """One BlockStored per run of consecutive `positions` (ascending)."""
        g, bs = self._event_group, self.block_size
        assert len(token_ids) >= (positions[-1] + 1) * bs, "KV events need the token ids"
        first = 0
        for i in range(1, len(positions) + 1):
            if i < len(positions) and positions[i] == positions[i - 1] + 1:
                continue
            k0, k1 = positions[first], positions[i - 1] + 1
            events.stored(
                [self._group_key(keys[k], g) for k in range(k0, k1)],
                self._group_key(keys[k0 - 1], g) if k0 else None,
                token_ids[k0 * bs:k1 * bs], salt, g)
            first = i

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (FlushCache). As vLLM's, it refuses while any GPU table
        holds a block: returns False and changes nothing. Tables swapped out to the CPU hold
        no keyed block and do not count."""
        if any(self.ref_counts):
            return False
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._key_of.clear()
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        # The host tier too. No table holds a block, so no copy-in is pending; pending
        # copy-outs may go: their slots no longer promise anything.
        self._host_free = deque(range(self.num_host_blocks))
        self._host_lru.clear()
        self._host_key_of.clear()
        self._host_cached.clear()
        self._offload_out, self._host_busy = [], set()
        if self.host_events is not None:
            self.host_events.cleared()
        return True

    @staticmethod
    def _group_key(key: bytes, group: int) -> bytes:
        """Group 0's blocks are cached under the position's key; group g's under key + g."""
        return key if group == 0 else key + group.to_bytes(2, "little")

    # ---- swapping --------------------------------------------------------------------------

    def num_swap_out_blocks(self, seq_ids: Iterable[str]) -> int:
        return len({b for s in seq_ids for b in self.block_tables[s] if b != FREED})

    def swap_out(self, seq_ids: Sequence[str]) -> list[tuple[int, int]] | None:
        """Move these GPU tables to the CPU pool: (gpu, cpu) pairs, or None (nothing changed)
        if the CPU pool is too small. GPU blocks keep their keys: swap-out only reads them."""
        if self.num_swap_out_blocks(seq_ids) > self.num_free_cpu_blocks:
            return None
        # A swap-out reads its blocks before the plan's copy-ins write them.
        assert not set(self._offload_in.values()) & {
            b for s in seq_ids for b in self.block_tables[s]}, "swapping out a pending copy-in"
        moved: dict[int, int] = {}
        for seq_id in seq_ids:
            table = self.block_tables.pop(seq_id)
            cpu_table = []
            for block_id in table:
                if block_id == FREED:
                    cpu_table.append(FREED)
                    continue
                if block_id not in moved:
                    moved[block_id] = self._cpu_free.popleft()
                cpu_table.append(moved[block_id])
                self.cpu_ref_counts[moved[block_id]] += 1
            for block_id in reversed(table):
                if block_id != FREED:
                    self._release(block_id)
            self.cpu_tables[seq_id] = cpu_table
            self._num_offered.pop(seq_id, None)
        return list(moved.items())

    def num_swap_in_blocks(self, seq_ids: Iterable[str]) -> int:
        return len({c for s in seq_ids for c in self.cpu_tables[s] if c != FREED})

    def swap_in(self, seq_ids: Sequence[str]) -> list[tuple[int, int]] | None:
        """Move these CPU tables back to fresh GPU blocks: (cpu, gpu) pairs, or None (nothing
        changed) if too few GPU blocks are free."""
        if self.num_swap_in_blocks(seq_ids) > self.num_free_blocks:
            return None
        moved: dict[int, int] = {}
        for seq_id in seq_ids:
            cpu_table = self.cpu_tables.pop(seq_id)
            table = []
            for cpu_id in cpu_table:
                if cpu_id == FREED:
                    table.append(FREED)
                elif cpu_id in moved:
                    self.ref_counts[moved[cpu_id]] += 1  # shared within the group
                    table.append(moved[cpu_id])
                else:
                    moved[cpu_id] = self._take_free_block()
                    table.append(moved[cpu_id])
            for cpu_id in cpu_table:
                if cpu_id != FREED:
                    self._release_cpu(cpu_id)
            self.block_tables[seq_id] = table
            self._num_offered[seq_id] = 0  # fresh blocks: offer them to the cache again
        return list(moved.items())

    # ---- internals -------------------------------------------------------------------------

    def _growth(self, seq_id: str, num_tokens: int) -> tuple[int, list[int]]:
        """What growing `seq_id`'s GPU table to `num_tokens` tokens takes: (fresh positions to
        append, the table indices of partly filled, shared last blocks to copy first).
        Computed once per call of allocate / num_blocks_needed: it is on every step's path."""
        num_fresh = -(-num_tokens // self.block_size)  # blocks_for(num_tokens)
        table = self.block_tables.get(seq_id)
        if not table:
            return num_fresh, []
        G = self.num_groups
        num_fresh -= len(table) // G
        have = self._num_tokens.get(seq_id, 0)
        copy_at = []
        if num_tokens > have and have % self.block_size != 0:
            copy_at = [i for i in range(len(table) - G, len(table))
                       if table[i] != FREED and self.ref_counts[table[i]] > 1]
        return max(0, num_fresh), copy_at

    def _take_free_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:  # evict the least recently used cached block; its contents are forgotten
            block_id, _ = self._evictable.popitem(last=False)
            key = self._key_of.pop(block_id)
            del self._cached[key]
            if self._host_cached and (slot := self._host_cached.get(key)) is not None:
                self._host_lru.move_to_end(slot)  # one LRU: just below the device's blocks
            if self.events is not None:
                self.events.removed(key, self._event_group)  # a no-op for other groups' keys
        self.ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> int:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id]:
            return 0
        if block_id in self._key_of:
            self._evictable[block_id] = None  # most recently used end
        else:
            self._free.append(block_id)
        return 1

    def _release_cpu(self, cpu_id: int) -> int:
        self.cpu_ref_counts[cpu_id] -= 1
        if self.cpu_ref_counts[cpu_id]:
            return 0
        self._cpu_free.append(cpu_id)
        return 1

    def check_invariants(self) -> None:
        free, evictable = list(self._free), list(self._evictable)
        assert len(free) == len(set(free)), "a block is in the free queue twice"
        assert not set(free) & set(evictable), "a block is both free and evictable"
        counted = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                if block_id != FREED:
                    counted[block_id] += 1
        assert counted == self.ref_counts, "ref counts disagree with the block tables"
        assert set(free) | set(evictable) == {b for b, c in enumerate(counted) if c == 0}, \
            "free + evictable is not exactly the unreferenced blocks"
        assert not set(free) & set(self._key_of), "a never-cached free block has a key"
        assert set(evictable) <= set(self._key_of), "an evictable block has no key"
        assert {k: b for b, k in self._key_of.items()} == self._cached, "key maps disagree"
        assert not set(self.block_tables) & set(self.cpu_tables), "a table on GPU and CPU"
        G = self.num_groups
        for seq_id, table in (*self.block_tables.items(), *self.cpu_tables.items()):
            n = self._num_tokens[seq_id]
            assert len(table) == G * self.blocks_for(n), f"{seq_id}'s table does not match its size"
            for i, block_id in enumerate(table):
                if block_id == FREED:
                    w = self.windows[i % G]
                    assert w, f"{seq_id}: a full-attention group's block was released"
                    # The last position always stays: it holds the newest keys.
                    assert i // G < len(table) // G - 1, f"{seq_id}: its last block released"
        cpu_counted = [0] * self.num_cpu_blocks
        for table in self.cpu_tables.values():
            for cpu_id in table:
                if cpu_id != FREED:
                    cpu_counted[cpu_id] += 1
        assert cpu_counted == self.cpu_ref_counts, "CPU ref counts disagree with the tables"
        cpu_free = list(self._cpu_free)
        assert len(cpu_free) == len(set(cpu_free)) and set(cpu_free) == {
            c for c, n in enumerate(cpu_counted) if n == 0}, "CPU free list is wrong"
        self._check_host_tier()

    def _check_host_tier(self) -> None:
        host_free, host_lru = list(self._host_free), list(self._host_lru)
        assert len(host_free) == len(set(host_free)), "a host slot is free twice"
        assert not set(host_free) & set(host_lru), "a host slot is both free and keyed"
        assert set(host_free) | set(host_lru) == set(range(self.num_host_blocks)), \
            "free + keyed host slots are not exactly the tier"
        assert set(host_lru) == set(self._host_key_of), "the host LRU disagrees with its keys"
        assert {k: s for s, k in self._host_key_of.items()} == self._host_cached, \
            "host key maps disagree"
        out_slots = [h for _, h in self._offload_out]
        in_blocks = list(self._offload_in.values())
        assert len(out_slots) == len(set(out_slots)), "two copies into one host slot"
        assert len(in_blocks) == len(set(in_blocks)), "two copies into one device block"
        assert set(out_slots) <= set(self._host_key_of), "a copy-out into an unkeyed slot"
        assert all(h in self._host_key_of for h in self._offload_in), \
            "a copy-in from an unkeyed host slot"  # (and each slot copied in at most once)
        assert all(self.ref_counts[d] > 0 for d in in_blocks), "a copy-in into a free block"
        assert self._host_busy == set(out_slots) | set(self._offload_in), \
            "busy host slots are not exactly those the pending copies name"

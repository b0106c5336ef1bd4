"""The KV block manager: fixed-size blocks, reference counts, one block table per sequence.

The executor's KV pool is `num_blocks` blocks of `block_size` token slots each. The scheduler
owns every block table; the executor only reads them from the step plan.

    pool:          [ b0 | b1 | b2 | b3 | b4 | b5 | b6 | b7 ]
    ref_counts:       1    1    1    0    1    0    0    0
    block_tables:  "a" -> [b0, b1]      (20 tokens, block_size 16: b1 is part full)
                   "b" -> [b2, b4]
    free queue:    b3 b5 b6 b7          (front is handed out next)

Invariants (checked by `check_invariants`, asserted in tests):
- a block is in the free queue exactly when its ref count is 0, and at most once;
- a block's ref count equals the number of block-table entries naming it;
- a table holds ceil(n / block_size) blocks, n = the largest size it was allocated for;
- tables only grow (append-only) until the sequence is freed as a whole.

Today every ref count is 0 or 1. Counts above 1 are the hook for prefix caching and
copy-on-write (a shared full block gets a content hash and several tables point at it); the
free queue is FIFO so that, once freed blocks keep their hashes, the most recently freed (most
likely reused) blocks stay cached longest.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got "
                             f"num_blocks={num_blocks}, block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    def num_new_blocks(self, req_id: str, num_tokens: int) -> int:
        """Blocks to append so that `req_id`'s table holds `num_tokens` tokens."""
        have = len(self.block_tables.get(req_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def allocate(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Grow `req_id`'s table to hold `num_tokens` tokens in total.

        Returns the block ids appended (possibly none), or None, changing nothing, when the free
        queue is too short: the caller decides whom to preempt.
        """
        num_new = self.num_new_blocks(req_id, num_tokens)
        if num_new > len(self._free):
            return None
        new_block_ids = [self._free.popleft() for _ in range(num_new)]
        for block_id in new_block_ids:
            self.ref_counts[block_id] += 1
        self.block_tables.setdefault(req_id, []).extend(new_block_ids)
        return new_block_ids

    def free(self, req_id: str) -> int:
        """Drop `req_id`'s table; blocks nobody else references return to the free queue.
        Returns how many blocks became free. Unknown ids are a no-op (already freed)."""
        table = self.block_tables.pop(req_id, None)
        if table is None:
            return 0
        num_freed = 0
        for block_id in table:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free.append(block_id)
                num_freed += 1
        return num_freed

    def block_table(self, req_id: str) -> list[int]:
        return list(self.block_tables.get(req_id, ()))

    def check_invariants(self) -> None:
        free = list(self._free)
        assert len(free) == len(set(free)), "a block is in the free queue twice"
        counted = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                counted[block_id] += 1
        assert counted == self.ref_counts, "ref counts disagree with the block tables"
        assert set(free) == {b for b, c in enumerate(self.ref_counts) if c == 0}, \
            "free queue is not exactly the unreferenced blocks"

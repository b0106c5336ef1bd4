"""The executor's persistent input batch: one row per held request, in preallocated arrays.

A request keeps its row from the step it arrives (NewRequest) to the step it is dropped
(finished, preempted, a failed step, a reset). Each step's plan diff is written into the rows
in place, and the step inputs are gathered from them with array indexing (``inputs.py``), so a
step costs the numpy work of its scheduled tokens and block-table entries, with no Python loop
over either and no rebuild from lists::

    row r ──► token_ids[r, :num_tokens[r]]           every token held: prompt, then outputs
              num_prompt[r]                          where the outputs start (kept on resume)
              block_table[r, :num_blocks[r]]         the request's blocks, then zeros (with
                                                     KV groups: G entries per position,
                                                     interleaved, kv/groups.py)
              num_computed[r]                        tokens whose KV is in those blocks
              temperature, top_p, top_k, seed, has_seed, num_logprobs, append_sampled,
              sampled_logprob, prompt_logprobs, processed_logprobs [r]
              processors: min_tokens, penalties, min_p, logit bias, allowed ids, bad words
                          (processor_rows.ProcessorRows, gathered only for rows that use them)

Invariants:
- ``row_of[req_id] == r`` exactly when ``req_ids[r] == req_id``; every other row is in
  ``free_rows``.
- ``block_table[r, num_blocks[r]:]`` is all zeros for every row, held or free, so a gathered
  table is already padded with block 0 (freeing a row zeroes its used prefix).
- ``num_tokens[r] <= max_model_len + 1`` (the token sampled at position max_model_len still
  fits) and ``num_blocks[r] <= G * ceil(max_model_len / block_size)``, a multiple of G (the
  KV groups); the runner checks both before it writes.

Rows are not kept compact: a freed row goes on a free list and the lowest free row is reused
first (a heap), which keeps held rows near the top of the arrays. Compacting would move a
token-history row (up to max_model_len ids) whenever a request in the middle finishes, for
nothing: a step gathers its rows by index in the plan's order anyway. When no row is free the
arrays double. The runner does not know max_num_seqs, so it starts at ``INITIAL_CAPACITY``.
Host memory: the token history is int32, ``capacity x (max_model_len + 1)`` (256 rows of a
32k model: 32 MiB).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from executor_svc.sample.processor_rows import ProcessorRows
from executor_svc.sample.sampler import seed_bits
from protos.plan import SamplingSpec

INITIAL_CAPACITY = 32
_ROW_ARRAYS = ("token_ids", "block_table", "num_tokens", "num_prompt", "num_blocks",
               "num_computed", "temperature", "top_p", "top_k", "seed", "has_seed",
               "num_logprobs", "append_sampled", "sampled_logprob", "prompt_logprobs",
               "processed_logprobs", "num_spec", "draft_computed")


@dataclass(frozen=True)
class RequestState:
    """A copy of one held request, for introspection (the runner works on the rows)."""

    req_id: str
    token_ids: list[int]
    sampling: SamplingSpec
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int  # token_ids[num_prompt_tokens:] are outputs


class InputBatch(Mapping[str, RequestState]):
    """Rows of per-request state. As a Mapping it reads req_id -> RequestState (a copy)."""

    def __init__(self, max_model_len: int, block_size: int,
                 capacity: int = INITIAL_CAPACITY, num_kv_groups: int = 1):
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kv_groups = num_kv_groups
        self.max_num_tokens = max_model_len + 1  # room for the sample at position max_model_len
        self.max_num_blocks = num_kv_groups * -(-max_model_len // block_size)  # table entries
        self.row_of: dict[str, int] = {}
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.req_ids: list[str | None] = [None] * capacity
        self.specs: list[SamplingSpec | None] = [None] * capacity
        self.free_rows = list(range(capacity))  # a heap
        self.token_ids = np.zeros((capacity, self.max_num_tokens), np.int32)
        self.block_table = np.zeros((capacity, self.max_num_blocks), np.int32)
        self.num_tokens = np.zeros(capacity, np.int64)
        self.num_prompt = np.zeros(capacity, np.int64)
        self.num_blocks = np.zeros(capacity, np.int64)
        self.num_computed = np.zeros(capacity, np.int64)
        self.temperature = np.zeros(capacity, np.float32)
        self.top_p = np.zeros(capacity, np.float32)
        self.top_k = np.zeros(capacity, np.int64)
        self.seed = np.zeros(capacity, np.int64)  # seed_bits(seed)
        self.has_seed = np.zeros(capacity, bool)
        self.num_logprobs = np.zeros(capacity, np.int64)
        self.append_sampled = np.zeros(capacity, bool)
        self.sampled_logprob = np.zeros(capacity, bool)
        self.prompt_logprobs = np.full(capacity, -1, np.int64)  # -1 = off
        self.processed_logprobs = np.zeros(capacity, bool)
        # Speculative decoding: proposals appended to token_ids for this step's verification
        # (the row's last num_spec tokens are not its own yet; SpecVerifier.settle settles them).
        self.num_spec = np.zeros(capacity, np.int64)
        # The draft model's KV positions of the row's real tokens (executor_svc/spec/draft.py).
        self.draft_computed = np.zeros(capacity, np.int64)
        self.processors = ProcessorRows(capacity)

    def _grow(self) -> None:
        """Double every array; held rows keep their index (every old row is held)."""
        old = {name: getattr(self, name) for name in _ROW_ARRAYS}
        req_ids, specs, num_old = self.req_ids, self.specs, self.capacity
        processors = self.processors
        self._allocate(2 * num_old)
        processors.grow(2 * num_old)
        self.processors = processors
        for name, array in old.items():
            getattr(self, name)[:num_old] = array
        self.req_ids[:num_old], self.specs[:num_old] = req_ids, specs
        self.free_rows = list(range(num_old, 2 * num_old))

    # ---- the plan diff ----------------------------------------------------------------------

    def add(self, req_id: str, token_ids: list[int], block_ids: list[int],
            num_computed: int, sampling: SamplingSpec, num_prompt: int | None = None) -> int:
        """Write a whole row (replacing any older copy of req_id); returns its index.
        token_ids[:num_prompt] is the prompt (None: all of it), the rest earlier outputs."""
        self.remove(req_id)
        if not self.free_rows:
            self._grow()
        row = heapq.heappop(self.free_rows)
        self.req_ids[row], self.specs[row] = req_id, sampling
        self.row_of[req_id] = row
        self.token_ids[row, :len(token_ids)] = token_ids
        self.block_table[row, :len(block_ids)] = block_ids
        self.num_tokens[row], self.num_blocks[row] = len(token_ids), len(block_ids)
        self.num_prompt[row] = len(token_ids) if num_prompt is None else num_prompt
        self.num_computed[row] = num_computed
        self.temperature[row], self.top_p[row] = sampling.temperature, sampling.top_p
        self.top_k[row] = sampling.top_k
        self.has_seed[row] = sampling.seed is not None
        self.seed[row] = seed_bits(sampling.seed) if sampling.seed is not None else 0
        self.num_logprobs[row] = sampling.num_logprobs
        self.append_sampled[row] = sampling.append_sampled
        self.sampled_logprob[row] = sampling.sampled_logprob
        self.prompt_logprobs[row] = sampling.prompt_logprobs
        self.processed_logprobs[row] = sampling.processed_logprobs
        self.processors.add(row, sampling)
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        start = int(self.num_tokens[row])
        self.token_ids[row, start:start + len(token_ids)] = token_ids
        self.num_tokens[row] = start + len(token_ids)

    def append_sampled_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """rows [n] (distinct), token_ids [n]: one token appended to each row, in one op."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def remove(self, req_id: str) -> bool:
        """Free req_id's row, if held."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return False
        self.block_table[row, :self.num_blocks[row]] = 0
        self.num_blocks[row] = self.num_tokens[row] = self.num_computed[row] = 0
        self.num_spec[row] = self.draft_computed[row] = 0
        self.processors.remove(row)
        self.req_ids[row] = self.specs[row] = None
        heapq.heappush(self.free_rows, row)
        return True

    def clear(self) -> None:
        """Drop every request (a reset, or a new scheduler)."""
        for req_id in list(self.row_of):
            self.remove(req_id)

    # ---- introspection: req_id -> RequestState ------------------------------------------------

    def __getitem__(self, req_id: str) -> RequestState:
        row = self.row_of[req_id]
        spec = self.specs[row]
        assert spec is not None
        return RequestState(req_id, self.token_ids[row, :self.num_tokens[row]].tolist(), spec,
                            self.block_table[row, :self.num_blocks[row]].tolist(),
                            int(self.num_computed[row]), int(self.num_prompt[row]))

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.row_of

    def __iter__(self) -> Iterator[str]:
        return iter(self.row_of)

    def __len__(self) -> int:
        return len(self.row_of)

"""Apply a step plan to the executor's request state, run the model, sample.

The runner mirrors what the scheduler has told it about each request::

    req_id -> RequestState(token_ids, block_ids, num_computed_tokens, sampling)

Invariants (checked every step, a violation fails the step with a message):
- ``num_computed_tokens + num_scheduled <= len(token_ids)`` and fits the request's blocks;
- a request samples exactly when that sum equals ``len(token_ids)``; the sampled id is appended,
  so the next decode step schedules it without the scheduler resending any token ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch
from torch import nn

from executor_svc.batch import BatchMetadata
from executor_svc.kv_cache import KVCache
from executor_svc.sampler import SamplingBatch, sample
from protos.plan import SamplingSpec, StepPlan

log = structlog.get_logger(__name__)


class PlanError(ValueError):
    """A plan that contradicts what the executor holds (a scheduler bug, or lost state)."""


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]
    sampling: SamplingSpec
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(frozen=True)
class StepOutput:
    sampled: list[tuple[str, list[int]]]
    num_tokens: int  # tokens computed this step
    execute_time_s: float


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, block_size: int,
                 max_model_len: int, vocab_size: int, device: torch.device):
        self.model = model
        self.vocab_size = vocab_size
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.requests: dict[str, RequestState] = {}

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one plan. On failure the state of every request the plan touches is dropped, so
        the scheduler can only go on by resending them as new requests."""
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                scheduled = self._apply(plan)
                sampled = self._run(scheduled) if scheduled else []
        except Exception:
            for req_id in [r.req_id for r in plan.new_reqs] + [r.req_id for r in plan.cached_reqs]:
                self.requests.pop(req_id, None)
            raise
        num_tokens = sum(n for _, n in scheduled)
        return StepOutput(sampled, num_tokens, time.perf_counter() - start)

    def _apply(self, plan: StepPlan) -> list[tuple[RequestState, int]]:
        """Update request state from the diff; return (request, num_scheduled) to compute."""
        if plan.swap_out or plan.swap_in:
            raise NotImplementedError("swap not supported yet: this executor has no CPU swap "
                                      "pool (num_swap_blocks = 0); preempt by recompute")
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            self.requests.pop(req_id, None)
        scheduled: list[tuple[RequestState, int]] = []
        for new in plan.new_reqs:
            self._check_block_ids(new.req_id, new.block_ids)
            # An id past the embedding table would be a device-side assert on CUDA.
            if new.token_ids and not (0 <= min(new.token_ids)
                                      and max(new.token_ids) < self.vocab_size):
                raise PlanError(f"request {new.req_id}: token ids outside the model's "
                                f"vocabulary of {self.vocab_size}")
            state = RequestState(new.req_id, list(new.token_ids), new.sampling,
                                 list(new.block_ids), new.num_computed_tokens)
            self.requests[new.req_id] = state  # replaces any older copy (resume after preempt)
            scheduled.append((state, new.num_scheduled_tokens))
        for cached in plan.cached_reqs:
            state = self.requests.get(cached.req_id)
            if state is None:
                raise PlanError(f"request {cached.req_id} is not held by the executor")
            if cached.num_computed_tokens != state.num_computed_tokens:
                raise PlanError(
                    f"request {cached.req_id}: scheduler counts {cached.num_computed_tokens} "
                    f"computed tokens, executor {state.num_computed_tokens}")
            self._check_block_ids(cached.req_id, cached.new_block_ids)
            state.block_ids.extend(cached.new_block_ids)
            scheduled.append((state, cached.num_scheduled_tokens))
        self._check_blocks(plan.block_copies)
        self.kv_cache.copy_blocks(plan.block_copies)
        for state, num_scheduled in scheduled:
            self._check(state, num_scheduled)
        return [(s, n) for s, n in scheduled if n > 0]

    def _check_blocks(self, pairs: list[tuple[int, int]]) -> None:
        num_blocks = self.kv_cache.num_blocks
        if any(not (0 <= b < num_blocks) for pair in pairs for b in pair):
            raise PlanError(f"block copy {pairs} names a block outside 0..{num_blocks - 1}")

    def _check_block_ids(self, req_id: str, block_ids: list[int]) -> None:
        # Checked once, when the ids arrive: an id out of range would index past the cache.
        if any(not (0 <= b < self.kv_cache.num_blocks) for b in block_ids):
            raise PlanError(f"request {req_id}: block table names a block outside "
                            f"0..{self.kv_cache.num_blocks - 1}")

    def _check(self, state: RequestState, num_scheduled: int) -> None:
        end = state.num_computed_tokens + num_scheduled
        if num_scheduled < 0 or end > len(state.token_ids):
            raise PlanError(f"request {state.req_id}: {state.num_computed_tokens} computed + "
                            f"{num_scheduled} scheduled exceeds its {len(state.token_ids)} tokens")
        if end > len(state.block_ids) * self.block_size:
            raise PlanError(f"request {state.req_id}: {end} tokens do not fit its "
                            f"{len(state.block_ids)} blocks of {self.block_size}")
        if end > self.max_model_len:
            raise PlanError(f"request {state.req_id}: {end} tokens exceed max_model_len "
                            f"{self.max_model_len}")

    def prepare(self, scheduled: list[tuple[RequestState, int]]
                ) -> tuple[torch.Tensor, torch.Tensor, BatchMetadata, list[RequestState]]:
        """Flatten the scheduled tokens into (input_ids, positions, batch metadata) on the
        device, and list the requests that sample (in logits row order)."""
        # Per-request loop only to gather index lists; per-token work is tensor ops below.
        flat_ids: list[int] = []
        block_rows: list[list[int]] = []
        for state, n in scheduled:
            flat_ids.extend(state.token_ids[state.num_computed_tokens:state.num_computed_tokens + n])
            block_rows.append(state.block_ids)
        num_computed = torch.tensor([s.num_computed_tokens for s, _ in scheduled])  # [num_seqs]
        query_lens = torch.tensor([n for _, n in scheduled])  # [num_seqs]
        num_held = torch.tensor([len(s.token_ids) for s, _ in scheduled])  # [num_seqs]
        max_blocks = max(len(row) for row in block_rows)
        block_tables = torch.tensor([row + [0] * (max_blocks - len(row)) for row in block_rows],
                                    dtype=torch.int32)  # [num_seqs, max_blocks]

        query_start_loc = torch.zeros(len(scheduled) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.cumsum(query_lens, 0)
        seq_idx = torch.repeat_interleave(torch.arange(len(scheduled)), query_lens)  # [num_tokens]
        token_offset = torch.arange(len(flat_ids)) - query_start_loc[:-1].long()[seq_idx]
        positions = num_computed[seq_idx] + token_offset  # [num_tokens]
        block_ids = block_tables[seq_idx, positions // self.block_size].long()
        slot_mapping = block_ids * self.block_size + positions % self.block_size
        seq_lens = num_computed + query_lens  # [num_seqs]
        samples = seq_lens == num_held  # [num_seqs]: prompt done, or a decode step
        logits_indices = (query_start_loc[1:].long() - 1)[samples]

        dev = self.device
        batch = BatchMetadata(
            slot_mapping=slot_mapping.to(dev),
            block_tables=block_tables.to(dev),
            seq_lens=seq_lens.to(torch.int32).to(dev),
            query_start_loc=query_start_loc.to(dev),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            logits_indices=logits_indices.to(dev),
        )
        sampling_reqs = [s for (s, _), flag in zip(scheduled, samples.tolist(), strict=True)
                         if flag]
        input_ids = torch.tensor(flat_ids, dtype=torch.int64).to(dev)
        return input_ids, positions.to(dev), batch, sampling_reqs

    def _run(self, scheduled: list[tuple[RequestState, int]]) -> list[tuple[str, list[int]]]:
        input_ids, positions, batch, sampling_reqs = self.prepare(scheduled)
        logits = self.model(input_ids, positions, batch)  # [num_sampling, vocab]
        sampled: list[int] = []
        if sampling_reqs:
            sampling = SamplingBatch.from_specs(
                [s.sampling for s in sampling_reqs],
                [len(s.token_ids) for s in sampling_reqs], self.device)
            sampled = sample(logits, sampling).tolist()  # the step's one host sync
        for state, n in scheduled:
            state.num_computed_tokens += n
        for state, token_id in zip(sampling_reqs, sampled, strict=True):
            state.token_ids.append(token_id)
        log.debug("step computed", num_seqs=len(scheduled), num_tokens=len(input_ids),
                  num_sampled=len(sampled))
        return [(s.req_id, [t]) for s, t in zip(sampling_reqs, sampled, strict=True)]

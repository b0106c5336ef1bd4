"""Apply a step plan to the executor's request state, move KV blocks, run the model, sample.

The runner mirrors what the scheduler has told it about each request::

    req_id -> RequestState(token_ids, block_ids, num_computed_tokens, sampling)

Invariants (checked every step, a violation fails the step with a message):
- ``num_computed_tokens + num_scheduled <= len(token_ids)`` and fits the request's blocks;
- a request samples exactly when that sum equals ``len(token_ids)``. With
  ``append_sampled`` (the default) the sampled id is appended, so the next decode step schedules
  it without the scheduler resending any token ids; otherwise the scheduler picks the next token
  (beam search) and sends it in ``CachedRequest.new_token_ids``, appended before computing.

Order within a step, after the plan is validated and request state updated:
``swap_out`` (device -> CPU pool), then ``swap_in`` (CPU pool -> device), then ``block_copies``
(copy-on-write), then the forward pass. A swapped-in request arrives as a NewRequest with all its
token ids, its new block table and ``num_computed_tokens > 0`` (its state was dropped at
swap-out through ``preempted_req_ids``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch
from torch import nn

from executor_svc.batch import BatchMetadata
from executor_svc.inputs import build_inputs
from executor_svc.kv_cache import KVCache
from executor_svc.sampler import SamplingBatch, sample, top_logprobs
from executor_svc.swap import SwapPool
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
    # (req_id, top token ids, their logprobs), best first, for requests with num_logprobs > 0
    logprobs: list[tuple[str, list[int], list[float]]]


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, block_size: int,
                 max_model_len: int, vocab_size: int, device: torch.device,
                 swap_pool: SwapPool | None = None):
        self.model = model
        self.vocab_size = vocab_size
        self.kv_cache = kv_cache
        self.swap_pool = swap_pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.requests: dict[str, RequestState] = {}

    @property
    def num_swap_blocks(self) -> int:
        return self.swap_pool.num_blocks if self.swap_pool is not None else 0

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one plan. On failure the state of every request the plan touches is dropped, so
        the scheduler can only go on by resending them as new requests."""
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                scheduled = self._apply(plan)
                self._move_blocks(plan)
                sampled, logprobs = self._run(scheduled) if scheduled else ([], [])
        except Exception:
            for req_id in [r.req_id for r in plan.new_reqs] + [r.req_id for r in plan.cached_reqs]:
                self.requests.pop(req_id, None)
            raise
        num_tokens = sum(n for _, n in scheduled)
        return StepOutput(sampled, num_tokens, time.perf_counter() - start, logprobs)

    def _apply(self, plan: StepPlan) -> list[tuple[RequestState, int]]:
        """Validate the plan and update request state from the diff; return (request,
        num_scheduled) to compute. Nothing has moved in the KV cache yet."""
        self._check_pairs(plan)
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            self.requests.pop(req_id, None)
        scheduled: list[tuple[RequestState, int]] = []
        for new in plan.new_reqs:
            self._check_block_ids(new.req_id, new.block_ids)
            self._check_token_ids(new.req_id, new.token_ids)
            self._check_sampling(new.req_id, new.sampling)
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
            if cached.new_token_ids:
                if state.sampling.append_sampled:
                    raise PlanError(
                        f"request {cached.req_id}: new_token_ids sent, but the executor appends "
                        "this request's sampled tokens itself (append_sampled is True)")
                self._check_token_ids(cached.req_id, cached.new_token_ids)
                state.token_ids.extend(cached.new_token_ids)
            scheduled.append((state, cached.num_scheduled_tokens))
        for state, num_scheduled in scheduled:
            self._check(state, num_scheduled)
        return [(s, n) for s, n in scheduled if n > 0]

    def _move_blocks(self, plan: StepPlan) -> None:
        """swap_out, then swap_in, then copy-on-write: the order the protocol promises."""
        if self.swap_pool is not None:
            self.swap_pool.swap_out(self.kv_cache, plan.swap_out)
            self.swap_pool.swap_in(self.kv_cache, plan.swap_in)
        self.kv_cache.copy_blocks(plan.block_copies)

    def _check_pairs(self, plan: StepPlan) -> None:
        """Every pair names blocks that exist, and no block is written twice in one list (a
        repeated destination would make the batched scatter's result undefined)."""
        if (plan.swap_out or plan.swap_in) and self.swap_pool is None:
            raise PlanError("the plan swaps blocks, but this executor has no CPU swap pool "
                            "(started with --swap-space 0; num_swap_blocks = 0)")
        num_gpu, num_cpu = self.kv_cache.num_blocks, self.num_swap_blocks
        for what, pairs, src_space, dst_space in (
                ("swap out", plan.swap_out, ("device", num_gpu), ("cpu", num_cpu)),
                ("swap in", plan.swap_in, ("cpu", num_cpu), ("device", num_gpu)),
                ("block copy", plan.block_copies, ("device", num_gpu), ("device", num_gpu))):
            for pair in pairs:
                for block, (space, num) in zip(pair, (src_space, dst_space), strict=True):
                    if not 0 <= block < num:
                        raise PlanError(f"{what} {pair} names {space} block {block}, outside "
                                        f"0..{num - 1}")
            dsts = [dst for _, dst in pairs]
            if len(set(dsts)) != len(dsts):
                twice = next(d for d in dsts if dsts.count(d) > 1)
                raise PlanError(f"{what} writes {dst_space[0]} block {twice} more than once")

    def _check_block_ids(self, req_id: str, block_ids: list[int]) -> None:
        # Checked once, when the ids arrive: an id out of range would index past the cache.
        if any(not (0 <= b < self.kv_cache.num_blocks) for b in block_ids):
            raise PlanError(f"request {req_id}: block table names a block outside "
                            f"0..{self.kv_cache.num_blocks - 1}")

    def _check_token_ids(self, req_id: str, token_ids: list[int]) -> None:
        # An id past the embedding table would be a device-side assert on CUDA.
        if token_ids and not (0 <= min(token_ids) and max(token_ids) < self.vocab_size):
            raise PlanError(f"request {req_id}: token ids outside the model's "
                            f"vocabulary of {self.vocab_size}")

    def _check_sampling(self, req_id: str, sampling: SamplingSpec) -> None:
        if not 0 <= sampling.num_logprobs <= self.vocab_size:
            raise PlanError(f"request {req_id}: num_logprobs {sampling.num_logprobs} is outside "
                            f"0..{self.vocab_size} (the model's vocabulary)")

    def _check(self, state: RequestState, num_scheduled: int) -> None:
        end = state.num_computed_tokens + num_scheduled
        if num_scheduled < 0 or end > len(state.token_ids):
            hint = ("" if state.sampling.append_sampled else
                    "; it does not append its samples (append_sampled is False), so the plan "
                    "must send the next tokens in new_token_ids")
            raise PlanError(f"request {state.req_id}: {state.num_computed_tokens} computed + "
                            f"{num_scheduled} scheduled exceeds its {len(state.token_ids)} "
                            f"tokens{hint}")
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
        # Per-request loops only gather Python scalars and lists; inputs.py does the rest.
        states = [s for s, _ in scheduled]
        query_lens = [n for _, n in scheduled]
        num_computed = [s.num_computed_tokens for s in states]
        input_ids, positions, batch, samples = build_inputs(
            (s.token_ids[c:c + n] for s, c, n in zip(states, num_computed, query_lens,
                                                     strict=True)),
            [s.block_ids for s in states], num_computed, query_lens,
            [len(s.token_ids) for s in states], self.block_size, self.device)
        sampling_reqs = [s for s, flag in zip(states, samples.tolist(), strict=True) if flag]
        return input_ids, positions, batch, sampling_reqs

    def _run(self, scheduled: list[tuple[RequestState, int]]
             ) -> tuple[list[tuple[str, list[int]]], list[tuple[str, list[int], list[float]]]]:
        input_ids, positions, batch, sampling_reqs = self.prepare(scheduled)
        logits = self.model(input_ids, positions, batch)  # [num_sampling, vocab]
        sampled: list[int] = []
        logprobs: list[tuple[str, list[int], list[float]]] = []
        if sampling_reqs:
            sampling = SamplingBatch.from_specs(
                [s.sampling for s in sampling_reqs],
                [len(s.token_ids) for s in sampling_reqs], self.device)
            sampled, logprobs = self._sample(logits, sampling, sampling_reqs)
        for state, n in scheduled:
            state.num_computed_tokens += n
        for state, token_id in zip(sampling_reqs, sampled, strict=True):
            if state.sampling.append_sampled:
                state.token_ids.append(token_id)
        log.debug("step computed", num_seqs=len(scheduled), num_tokens=len(input_ids),
                  num_sampled=len(sampled), num_logprobs=len(logprobs))
        return [(s.req_id, [t]) for s, t in zip(sampling_reqs, sampled, strict=True)], logprobs

    def _sample(self, logits: torch.Tensor, sampling: SamplingBatch,
                sampling_reqs: list[RequestState]
                ) -> tuple[list[int], list[tuple[str, list[int], list[float]]]]:
        """Sampled ids, plus top logprobs for the rows that ask, in the step's one host sync."""
        sampled_ids = sample(logits, sampling)  # [num_rows]
        lp_rows = [i for i, s in enumerate(sampling_reqs) if s.sampling.num_logprobs > 0]
        if not lp_rows:
            return sampled_ids.tolist(), []
        k = max(sampling_reqs[i].sampling.num_logprobs for i in lp_rows)
        rows = torch.tensor(lp_rows, dtype=torch.long).to(self.device)
        top_ids, top_lps = top_logprobs(logits, rows, k)  # [len(lp_rows), k] each
        # One transfer for everything: token ids (< 2**53) and fp32 logprobs are exact in fp64.
        host = torch.cat([sampled_ids.double(), top_ids.flatten().double(),
                          top_lps.flatten().double()]).tolist()
        num_rows, num_top = len(sampling_reqs), len(lp_rows) * k
        flat_ids, flat_lps = host[num_rows:num_rows + num_top], host[num_rows + num_top:]
        logprobs = []
        for j, row in enumerate(lp_rows):
            state = sampling_reqs[row]
            span = slice(j * k, j * k + state.sampling.num_logprobs)
            logprobs.append((state.req_id, [int(t) for t in flat_ids[span]], flat_lps[span]))
        return [int(t) for t in host[:num_rows]], logprobs

"""Apply a step plan to the executor's request state, move KV blocks, run the model, sample.

The runner mirrors what the scheduler has told it about each request in a persistent
``InputBatch`` (``input_batch.py``): one row per held request, updated in place from each plan's
diff. ``runner.requests`` is that batch, read as a Mapping ``req_id -> RequestState`` (a copy);
``requests.clear()`` (or ``reset()``) drops everything.

Invariants (checked every step, a violation fails the step with a message):
- ``num_computed_tokens + num_scheduled <= num_tokens`` (the tokens held) and fits the request's
  blocks and max_model_len;
- a request samples exactly when that sum equals ``num_tokens``. With ``append_sampled`` (the
  default) the sampled id is appended, so the next decode step schedules it without the
  scheduler resending any token ids; otherwise the scheduler picks the next token (beam search)
  and sends it in ``CachedRequest.new_token_ids``, appended before computing;
- a row verifying speculative proposals (``CachedRequest.spec_token_ids``) holds them for the
  step only: ``runner_spec.py`` verifies them and settles the row to what it keeps.

Order within a step, after the plan is validated and request state updated:
``swap_out`` (device -> CPU pool), then ``swap_in`` (CPU pool -> device), then ``block_copies``
(copy-on-write), then the forward pass. A swapped-in request arrives as a NewRequest with all its
token ids, its new block table and ``num_computed_tokens > 0`` (its state was dropped at
swap-out through ``preempted_req_ids``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog
import torch
from torch import nn

from executor_svc.kv.kv_cache import KVCache, to_device
from executor_svc.kv.swap import SwapPool
from executor_svc.parallel.tp_worker import collectives, share_sampled
from executor_svc.sample.sampler import (
    prompt_logprobs_records,
    sample,
    sample_with_distribution,
    split_flat,
    token_logprobs,
    top_logprobs,
)
from executor_svc.sample.structured import StructuredRows, apply_bitmask
from executor_svc.spec.draft import DraftProposer
from executor_svc.spec.runner_spec import refusal, settle, verify
from executor_svc.step.graph_runner import DecodeGraphRunner
from executor_svc.step.input_batch import InputBatch, RequestState
from executor_svc.step.inputs import StepInputs, build_step_inputs
from executor_svc.step.runner_checks import PlanChecks, PlanError
from protos.plan import CachedRequest, NewRequest, PromptLogprobs, StepPlan

__all__ = ["ModelRunner", "PlanError", "RequestState", "Scheduled", "StepOutput"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Scheduled:
    """What a step computes: persistent-batch rows in plan order (new requests first)."""

    rows: np.ndarray  # [num_seqs] int64, distinct
    query_lens: np.ndarray  # [num_seqs] int64 >= 1: tokens computed this step


@dataclass(frozen=True)
class StepOutput:
    sampled: list[tuple[str, list[int]]]
    num_tokens: int  # tokens computed this step
    execute_time_s: float
    # (req_id, top token ids, their logprobs), best first, for requests with num_logprobs > 0
    logprobs: list[tuple[str, list[int], list[float]]]
    # (req_id, sampled token's logprob, its rank) for requests with sampled_logprob
    sampled_logprobs: list[tuple[str, float, int]] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    proposals: list[tuple[str, list[int]]] = field(default_factory=list)  # draft model's


@dataclass
class _Sampled:
    """What `_sample` brings back from the device, in its one transfer."""

    token_ids: list[int]
    logprobs: list[tuple[str, list[int], list[float]]] = field(default_factory=list)
    sampled_logprobs: list[tuple[str, float, int]] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


class ModelRunner(PlanChecks):
    def __init__(self, model: nn.Module, kv_cache: KVCache, block_size: int,
                 max_model_len: int, vocab_size: int, device: torch.device,
                 swap_pool: SwapPool | None = None, tokenizer_json: Path | None = None,
                 graph_runner: DecodeGraphRunner | None = None,
                 draft: DraftProposer | None = None):
        self.model = model
        self.vocab_size = vocab_size
        self.kv_cache = kv_cache
        self.swap_pool = swap_pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.input_batch = InputBatch(max_model_len, block_size)
        # Structured output's matchers, next to their rows (tokenizer_json: the model's).
        self.structured = StructuredRows(tokenizer_json, vocab_size)
        # Replays pure-decode steps from captured graphs (None: every step eager).
        self.graph_runner = graph_runner
        # Speculative decoding's draft model: proposals after each step (None: no draft).
        self.draft = draft

    @property
    def requests(self) -> InputBatch:
        """The held requests: ``req_id in``, ``len``, ``[req_id]`` (a copy), ``clear()``."""
        return self.input_batch

    def reset(self) -> None:
        """Drop every request (StepPlan.reset, or a new scheduler)."""
        self.input_batch.clear()
        self.structured.clear()

    @property
    def num_swap_blocks(self) -> int:
        return self.swap_pool.num_blocks if self.swap_pool is not None else 0

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one plan. On failure the state of every request the plan touches is dropped, so
        the scheduler can only go on by resending them as new requests."""
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                scheduled = self.apply(plan)
                self._move_blocks(plan)
                sampled, out = self._run(scheduled) if len(scheduled.rows) else ([], _Sampled([]))
                proposals = self._propose(sampled) if self.draft is not None else []
        except Exception:
            for req_id in [r.req_id for r in plan.new_reqs] + [r.req_id for r in plan.cached_reqs]:
                self.input_batch.remove(req_id)
            raise
        num_tokens = int(scheduled.query_lens.sum())
        return StepOutput(sampled, num_tokens, time.perf_counter() - start, out.logprobs,
                          out.sampled_logprobs, out.prompt_logprobs, proposals)

    def _propose(self, sampled: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
        """The draft model's proposals for the rows that sampled and may speculate."""
        batch = self.input_batch
        rows = [batch.row_of[r] for r, _ in sampled if r in batch.row_of]
        rows = np.array([r for r in rows if self._spec_refusal(r) is None], np.int64)
        if not len(rows):
            return []
        ids = self.draft.propose(batch, rows)
        return [(batch.req_ids[r], p) for r, p in zip(rows.tolist(), ids, strict=True) if p]

    def apply(self, plan: StepPlan) -> Scheduled:
        """Validate the plan and write its diff into the persistent batch; return the rows to
        compute. Nothing has moved in the KV cache yet."""
        self._check_pairs(plan)
        batch = self.input_batch
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            batch.remove(req_id)
        rows = [self._add(new) for new in plan.new_reqs]  # replaces older copies (a resume)
        rows += [self._update(cached) for cached in plan.cached_reqs]
        counts = [r.num_scheduled_tokens for r in plan.new_reqs]
        counts += [r.num_scheduled_tokens for r in plan.cached_reqs]
        row_arr = np.array(rows, dtype=np.int64)  # [num_entries]
        count_arr = np.array(counts, dtype=np.int64)  # [num_entries]
        self._check_scheduled(row_arr, count_arr)
        keep = count_arr > 0
        return Scheduled(row_arr[keep], count_arr[keep])

    def _add(self, new: NewRequest) -> int:
        self._check_block_ids(new.req_id, new.block_ids)
        self._check_token_ids(new.req_id, new.token_ids)
        self._check_sampling(new.req_id, new.sampling)
        self._check_capacity(new.req_id, len(new.token_ids), len(new.block_ids))
        row = self.input_batch.add(new.req_id, new.token_ids, new.block_ids,
                                   new.num_computed_tokens, new.sampling, new.num_prompt_tokens)
        # A fresh matcher replaying the outputs held (a resume), or the row's old one dropped.
        self.structured.add(row, new.req_id, new.sampling.structured,
                            new.token_ids[new.num_prompt_tokens:])
        return row

    def _spec_refusal(self, row: int) -> str | None:
        """Why a row may not verify (or be drafted) proposals, or None (runner_spec.refusal)."""
        return refusal(self.input_batch, row,
                       len(self.structured.constrained(np.array([row]))) > 0)

    def _update(self, cached: CachedRequest) -> int:
        batch = self.input_batch
        row = batch.row_of.get(cached.req_id)
        if row is None:
            raise PlanError(f"request {cached.req_id} is not held by the executor")
        if cached.num_computed_tokens != batch.num_computed[row]:
            raise PlanError(
                f"request {cached.req_id}: scheduler counts {cached.num_computed_tokens} "
                f"computed tokens, executor {batch.num_computed[row]}")
        if cached.new_block_ids:
            self._check_block_ids(cached.req_id, cached.new_block_ids)
            self._check_capacity(cached.req_id, int(batch.num_tokens[row]),
                                 int(batch.num_blocks[row]) + len(cached.new_block_ids))
            batch.append_blocks(row, cached.new_block_ids)
        if cached.new_token_ids:
            if batch.append_sampled[row]:
                raise PlanError(
                    f"request {cached.req_id}: new_token_ids sent, but the executor appends "
                    "this request's sampled tokens itself (append_sampled is True)")
            self._check_token_ids(cached.req_id, cached.new_token_ids)
            self._check_capacity(cached.req_id,
                                 int(batch.num_tokens[row]) + len(cached.new_token_ids),
                                 int(batch.num_blocks[row]))
            batch.append_tokens(row, cached.new_token_ids)
            if self.structured.active:
                self.structured.advance([row], batch.req_ids, [cached.new_token_ids])
        if cached.spec_token_ids:  # verified this step (runner_spec.py)
            why = self._spec_refusal(row)
            num_spec = len(cached.spec_token_ids)
            if why is None and (batch.num_computed[row] != batch.num_tokens[row] - 1
                                or cached.num_scheduled_tokens != 1 + num_spec):
                why = (f"{num_spec} proposals need a decode step scheduling {1 + num_spec} "
                       f"tokens (computed {batch.num_computed[row]} of "
                       f"{batch.num_tokens[row]} held, {cached.num_scheduled_tokens} scheduled)")
            if why is not None:
                raise PlanError(f"request {cached.req_id}: {why}")
            self._check_token_ids(cached.req_id, cached.spec_token_ids)
            self._check_capacity(cached.req_id,
                                 int(batch.num_tokens[row]) + len(cached.spec_token_ids),
                                 int(batch.num_blocks[row]))
            batch.append_tokens(row, cached.spec_token_ids)
            batch.num_spec[row] = len(cached.spec_token_ids)
        return row

    def _move_blocks(self, plan: StepPlan) -> None:
        """swap_out, then swap_in, then copy-on-write: the order the protocol promises."""
        if self.swap_pool is not None:
            self.swap_pool.swap_out(self.kv_cache, plan.swap_out)
            self.swap_pool.swap_in(self.kv_cache, plan.swap_in)
        self.kv_cache.copy_blocks(plan.block_copies)

    def prepare(self, scheduled: Scheduled) -> StepInputs:
        """The step's flattened inputs on the device, gathered from the scheduled rows."""
        return build_step_inputs(self.input_batch, scheduled.rows, scheduled.query_lens,
                                 self.device)

    def _run(self, scheduled: Scheduled) -> tuple[list[tuple[str, list[int]]], _Sampled]:
        inputs = self.prepare(scheduled)
        with collectives():  # tensor parallel: logits on rank 0 only (None elsewhere)
            logits = self._forward(inputs)  # [num_logits (+ prompt positions), vocab]
        sample_rows = inputs.sample_rows  # [num_logits]
        out = _Sampled([])
        if len(sample_rows) or inputs.prompt_lp is not None:
            out = share_sampled(lambda: self._sample(logits, inputs), len(sample_rows),
                                self.device, _Sampled)
        sampled = out.token_ids
        batch = self.input_batch
        batch.num_computed[scheduled.rows] += scheduled.query_lens
        spec, emitted = inputs.spec, None
        if spec is not None:  # proposals verified, the rows settled to what they keep
            emitted = verify(logits, spec, inputs.sampling, batch)
            settle(batch, spec, emitted)
        if self.draft is not None:  # its KV is valid only where the target's is
            batch.draft_computed[scheduled.rows] = np.minimum(
                batch.draft_computed[scheduled.rows], batch.num_computed[scheduled.rows])
        appends = batch.append_sampled[sample_rows]  # [num_logits] bool
        if spec is not None:
            appends[spec.logits_rows] = False
        appended_rows, appended_ids = sample_rows[appends], np.array(sampled, np.int64)[appends]
        batch.append_sampled_tokens(appended_rows, appended_ids)
        if self.structured.active:  # each constrained row's matcher takes its new token
            hit = self.structured.constrained(appended_rows)
            self.structured.advance(appended_rows[hit].tolist(), batch.req_ids,
                                    [[t] for t in appended_ids[hit].tolist()])
        log.debug("step computed", num_seqs=len(scheduled.rows), num_tokens=len(inputs.input_ids),
                  num_sampled=len(sampled), num_logprobs=len(out.logprobs))
        req_ids = [batch.req_ids[r] for r in sample_rows.tolist()]
        tokens = [[t] for t in sampled]
        if emitted is not None:
            for i, ids in zip(spec.logits_rows.tolist(), emitted, strict=True):
                tokens[i] = ids
        return list(zip(req_ids, tokens, strict=True)), out

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Pure-decode steps that fit a captured size replay the decoder graph, then the LM
        head runs on the real rows' logits positions; every other step runs eagerly."""
        graphs, batch = self.graph_runner, inputs.batch
        if graphs is not None and graphs.fits(batch.num_seqs, batch.max_query_len):
            hidden = graphs.run(inputs)  # [num_seqs, hidden]
            return self.model.compute_logits(hidden[batch.logits_indices])
        return self.model(inputs.input_ids, inputs.positions, batch)

    def _sample(self, logits: torch.Tensor, inputs: StepInputs) -> _Sampled:
        """Sampled ids, plus the logprobs the rows ask for, in the step's one host sync."""
        num_rows = len(inputs.sample_rows)
        num_lp, num_slp = len(inputs.num_logprobs), len(inputs.sampled_lp_rows_host)
        masked = logits[:num_rows]
        if self.structured.active:
            idx, bitmask = self.structured.bitmask(inputs.sample_rows, self.input_batch.req_ids)
            if len(idx):  # logprobs stay the raw model's: mask a copy when any are asked for
                masked = masked.clone() if num_lp or num_slp else masked
                apply_bitmask(masked, to_device(idx, self.device),
                              to_device(bitmask, self.device))
        # Logprobs come from the raw logits, or for PROCESSED rows from what they were drawn from.
        processed_rows = self.input_batch.processed_logprobs[inputs.sample_rows] if (
            num_lp or num_slp) else None
        lp_logits = logits[:num_rows]  # [num_logits, vocab]
        if processed_rows is not None and processed_rows.any():
            sampled_ids, drawn = sample_with_distribution(masked, inputs.sampling)
            flags = to_device(processed_rows, self.device)
            lp_logits = torch.where(flags[:, None], drawn, lp_logits)
        else:
            sampled_ids = sample(masked, inputs.sampling)  # [num_logits]
        if not (num_lp or num_slp or inputs.prompt_lp is not None):
            return _Sampled(sampled_ids.tolist())  # the common step: nothing else crosses
        # One transfer for everything: token ids (< 2**53), ranks and fp32 logprobs are exact
        # in fp64. `parts` are flat device tensors, read back in the same order.
        parts = [sampled_ids.double()]
        k = int(inputs.num_logprobs.max()) if num_lp else 0
        if num_lp:
            top_ids, top_lps = top_logprobs(lp_logits, inputs.logprob_rows, k)
            parts += [top_ids.flatten().double(), top_lps.flatten().double()]  # [num_lp * k]
        if num_slp:
            rows = inputs.sampled_lp_rows  # [num_slp]
            own, ranks, _ = token_logprobs(lp_logits.index_select(0, rows), sampled_ids[rows])
            parts += [own.double(), ranks.double()]
        pl = inputs.prompt_lp
        pl_k = int(pl.num_top.max()) if pl is not None else 0
        if pl is not None:
            own, ranks, lsm = token_logprobs(logits[num_rows:num_rows + len(inputs.prompt_targets)],
                                             inputs.prompt_targets)
            pl_lps, pl_ids = lsm.topk(pl_k, dim=-1)  # [num_pl, pl_k]
            parts += [own.double(), ranks.double(), pl_ids.flatten().double(),
                      pl_lps.flatten().double()]
        host = iter(split_flat(torch.cat(parts).tolist(), [p.numel() for p in parts]))
        out = _Sampled([int(t) for t in next(host)])
        req_ids, sample_rows = self.input_batch.req_ids, inputs.sample_rows
        if num_lp:
            flat_ids, flat_lps = next(host), next(host)
            for j, (row, n) in enumerate(zip(inputs.logprob_rows_host.tolist(),
                                             inputs.num_logprobs.tolist(), strict=True)):
                span = slice(j * k, j * k + n)
                out.logprobs.append((req_ids[int(sample_rows[row])],
                                     [int(t) for t in flat_ids[span]], flat_lps[span]))
        if num_slp:
            own_lps, own_ranks = next(host), next(host)
            out.sampled_logprobs = [
                (req_ids[int(sample_rows[row])], lp, int(rank)) for row, lp, rank
                in zip(inputs.sampled_lp_rows_host.tolist(), own_lps, own_ranks, strict=True)]
        if pl is not None:
            out.prompt_logprobs = prompt_logprobs_records(pl, req_ids, pl_k, next(host), next(host),
                                                  next(host), next(host))
        return out

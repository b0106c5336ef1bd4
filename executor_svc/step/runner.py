"""Apply a step plan to the executor's request state, move KV blocks, run the model, sample.

The runner owns a step's parts and calls them in order; each owns its state whole::

    ModelRunner
      input_batch   InputBatch        the held requests, one row each (input_batch.py)
      structured    StructuredRows    structured output's matchers, by row (sample/structured.py)
      verifier      SpecVerifier      verifies proposals, settles their rows (spec/verifier.py)
      validator     PlanValidator     the rules every plan must satisfy (plan_validation.py)
      graph_runner  DecodeGraphRunner pure-decode steps replayed from CUDA graphs (None: eager)
      draft         DraftProposer     the draft model's proposals after a step (None: no draft)

A step crosses to the device in one host-to-device copy (inputs.py) and back in one
device-to-host transfer of named segments (outputs.py). ``runner.requests`` is the batch,
read as a Mapping ``req_id -> RequestState`` (a copy); ``requests.clear()`` (or ``reset()``)
drops everything.

Invariants (checked every step by the validator, a violation fails the step with a message):
- ``num_computed_tokens + num_scheduled <= num_tokens`` (the tokens held) and fits the request's
  blocks and max_model_len;
- a request samples exactly when that sum equals ``num_tokens``. With ``append_sampled`` (the
  default) the sampled id is appended, so the next decode step schedules it without the
  scheduler resending any token ids; otherwise the scheduler picks the next token (beam search)
  and sends it in ``CachedRequest.new_token_ids``, appended before computing;
- a row verifying speculative proposals (``CachedRequest.spec_token_ids``) holds them for the
  step only: the verifier checks them against the step's logits and settles the row to what it
  keeps.

Order within a step, after the plan is validated and request state updated:
``offload_out`` (device -> the prefix cache's host tier), ``swap_out`` (device -> CPU pool),
``swap_in`` (CPU pool -> device), ``offload_in`` (host tier -> device), then ``block_copies``
(copy-on-write), then the forward pass. A swapped-in request arrives as a NewRequest with all its
token ids, its new block table and ``num_computed_tokens > 0`` (its state was dropped at
swap-out through ``preempted_req_ids``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
import torch
from torch import nn

from executor_svc.kv.host_tier import TierRecords
from executor_svc.kv.kv_cache import KVCache, to_device
from executor_svc.kv.swap import SwapPool
from executor_svc.parallel.tp_worker import collectives, share_sampled
from executor_svc.sample.sampler import (
    sample,
    sample_with_distribution,
    token_logprobs,
    top_logprobs,
)
from executor_svc.sample.structured import StructuredRows, apply_bitmask
from executor_svc.spec.draft import DraftProposer
from executor_svc.spec.verifier import SpecVerifier
from executor_svc.step.graph_runner import DecodeGraphRunner
from executor_svc.step.input_batch import InputBatch, RequestState
from executor_svc.step.inputs import StepInputs, build_step_inputs
from executor_svc.step.outputs import (
    Proposal,
    Sampled,
    SampledTokens,
    StepOutput,
    read_back,
    read_sampled,
    sampled_tokens,
)
from executor_svc.step.plan_validation import PlanError, PlanValidator
from protos.plan import CachedRequest, NewRequest, StepPlan

__all__ = ["ModelRunner", "PlanError", "RequestState", "Scheduled", "StepOutput"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Scheduled:
    """What a step computes: persistent-batch rows in plan order (new requests first)."""

    rows: np.ndarray  # [num_seqs] int64, distinct
    query_lens: np.ndarray  # [num_seqs] int64 >= 1: tokens computed this step


class ModelRunner:
    """Runs step plans over the parts it owns (the module docstring draws them).

    Invariants: after a step that succeeds the batch holds exactly what the plans said
    (plus the tokens it appended); a step that fails drops every request its plan touched,
    so the scheduler can only resend them whole. The parts share the one InputBatch and
    StructuredRows, each reading or writing them only through their public fields.
    """

    def __init__(self, model: nn.Module, kv_cache: KVCache, block_size: int,
                 max_model_len: int, vocab_size: int, device: torch.device,
                 swap_pool: SwapPool | None = None, tokenizer_json: Path | None = None,
                 graph_runner: DecodeGraphRunner | None = None,
                 draft: DraftProposer | None = None, host_tier: SwapPool | None = None,
                 host_tier_records: TierRecords | None = None):
        self.model = model
        self.vocab_size = vocab_size
        self.kv_cache = kv_cache
        self.swap_pool = swap_pool
        self.host_tier = host_tier  # the prefix cache's host tier (kv/host_tier.py)
        self.host_tier_records = host_tier_records  # its records, when it is a tier file
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.input_batch = InputBatch(max_model_len, block_size,
                                      num_kv_groups=kv_cache.layout.num_groups)
        # Structured output's matchers, next to their rows (tokenizer_json: the model's).
        self.structured = StructuredRows(tokenizer_json, vocab_size)
        self.verifier = SpecVerifier(self.input_batch, self.structured)
        self.validator = PlanValidator(
            self.input_batch, self.verifier, vocab_size=vocab_size,
            num_blocks=kv_cache.num_blocks,
            num_swap_blocks=swap_pool.num_blocks if swap_pool is not None else None,
            num_host_blocks=host_tier.num_blocks if host_tier is not None else None)
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
                sampled, out = self._run(scheduled) if len(scheduled.rows) else ([], Sampled([]))
                proposals = self._propose(sampled) if self.draft is not None else []
        except Exception:
            for req_id in [r.req_id for r in plan.new_reqs] + [r.req_id for r in plan.cached_reqs]:
                self.input_batch.remove(req_id)
            raise
        return StepOutput(sampled=sampled, num_tokens=int(scheduled.query_lens.sum()),
                          execute_time_s=time.perf_counter() - start, logprobs=out.logprobs,
                          sampled_logprobs=out.sampled_logprobs,
                          prompt_logprobs=out.prompt_logprobs, proposals=proposals)

    def _propose(self, sampled: list[SampledTokens]) -> list[Proposal]:
        """The draft model's proposals for the rows that sampled and may speculate."""
        batch = self.input_batch
        rows = [batch.row_of[s.req_id] for s in sampled if s.req_id in batch.row_of]
        rows = np.array([r for r in rows if self.verifier.refusal(r) is None], np.int64)
        if not len(rows):
            return []
        ids = self.draft.propose(batch, rows)
        return [Proposal(batch.req_ids[r], p) for r, p in zip(rows.tolist(), ids, strict=True)
                if p]

    def apply(self, plan: StepPlan) -> Scheduled:
        """Validate the plan and write its diff into the persistent batch; return the rows to
        compute. Nothing has moved in the KV cache yet."""
        self.validator.check_block_moves(plan)
        batch = self.input_batch
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            batch.remove(req_id)
        rows = [self._add(new) for new in plan.new_reqs]  # replaces older copies (a resume)
        rows += [self._update(cached) for cached in plan.cached_reqs]
        counts = [r.num_scheduled_tokens for r in plan.new_reqs]
        counts += [r.num_scheduled_tokens for r in plan.cached_reqs]
        row_arr = np.array(rows, dtype=np.int64)  # [num_entries]
        count_arr = np.array(counts, dtype=np.int64)  # [num_entries]
        self.validator.check_scheduled(row_arr, count_arr)
        keep = count_arr > 0
        return Scheduled(row_arr[keep], count_arr[keep])

    def _add(self, new: NewRequest) -> int:
        self.validator.check_new(new)
        row = self.input_batch.add(new.req_id, new.token_ids, new.block_ids,
                                   new.num_computed_tokens, new.sampling, new.num_prompt_tokens)
        # A fresh matcher replaying the outputs held (a resume), or the row's old one dropped.
        self.structured.add(row, new.req_id, new.sampling.structured,
                            new.token_ids[new.num_prompt_tokens:])
        return row

    def _update(self, cached: CachedRequest) -> int:
        """Write a held request's diff, each part checked right before it is written."""
        batch, validator = self.input_batch, self.validator
        row = validator.held_row(cached)
        if cached.new_block_ids:
            validator.check_new_blocks(cached, row)
            batch.append_blocks(row, cached.new_block_ids)
        if cached.new_token_ids:
            validator.check_new_tokens(cached, row)
            batch.append_tokens(row, cached.new_token_ids)
            if self.structured.active:
                self.structured.advance([row], batch.req_ids, [cached.new_token_ids])
        if cached.spec_token_ids:  # verified this step (spec/verifier.py)
            validator.check_proposals(cached, row)
            batch.append_tokens(row, cached.spec_token_ids)
            batch.num_spec[row] = len(cached.spec_token_ids)
        return row

    def _move_blocks(self, plan: StepPlan) -> None:
        """offload_out, swap_out, swap_in, offload_in, then copy-on-write: the order the
        protocol promises (every device read before every device write)."""
        if self.host_tier is not None:
            self._offload_out(plan)
        if self.swap_pool is not None:
            self.swap_pool.swap_out(self.kv_cache, plan.swap_out)
            self.swap_pool.swap_in(self.kv_cache, plan.swap_in)
        if self.host_tier is not None:
            self.host_tier.swap_in(self.kv_cache, plan.offload_in)
        self.kv_cache.copy_blocks(plan.block_copies)

    def settle_host_tier(self) -> None:
        """Commit the tier file's records of copies that have landed since the last plan (the
        worker calls this while idle, so a crash then loses none of them)."""
        if self.host_tier_records is not None:
            self.host_tier_records.commit_completed()

    def _offload_out(self, plan: StepPlan) -> None:
        """The plan's copies into the host tier, with a tier file's records kept true around
        them (kv/host_tier.py)."""
        records = self.host_tier_records
        if records is None:
            self.host_tier.swap_out(self.kv_cache, plan.offload_out)
            return
        records.commit_completed()  # earlier plans' copies that have landed since
        slots = [slot for _, slot in plan.offload_out]
        records.before_copy(slots)
        self.host_tier.swap_out(self.kv_cache, plan.offload_out)
        keys = [bytes.fromhex(k) for k in plan.offload_keys]  # hex checked by the validator
        records.after_copy(list(zip(slots, keys, strict=True)), self.host_tier.copy_done_event())

    def prepare(self, scheduled: Scheduled) -> StepInputs:
        """The step's flattened inputs on the device, gathered from the scheduled rows."""
        return build_step_inputs(self.input_batch, scheduled.rows, scheduled.query_lens,
                                 self.device)

    def _run(self, scheduled: Scheduled) -> tuple[list[SampledTokens], Sampled]:
        inputs = self.prepare(scheduled)
        with collectives():  # tensor parallel: logits on rank 0 only (None elsewhere)
            logits = self._forward(inputs)  # [num_logits (+ prompt positions), vocab]
        sample_rows = inputs.sample_rows  # [num_logits]
        out = Sampled([])
        if len(sample_rows) or inputs.prompt_lp is not None:
            out = share_sampled(lambda: self._sample(logits, inputs), len(sample_rows),
                                self.device, Sampled)
        sampled = out.token_ids
        batch = self.input_batch
        batch.num_computed[scheduled.rows] += scheduled.query_lens
        spec = inputs.spec
        if spec is not None:  # proposals verified (in _sample), the rows settled to what they keep
            self.verifier.settle(spec, out.emitted)
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
        if spec is not None:
            for i, ids in zip(spec.logits_rows.tolist(), out.emitted, strict=True):
                tokens[i] = ids
        return sampled_tokens(req_ids, tokens), out

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Pure-decode steps that fit a captured size replay the decoder graph, then the LM
        head runs on the real rows' logits positions; every other step runs eagerly."""
        graphs, batch = self.graph_runner, inputs.batch
        if graphs is not None and graphs.fits(batch.num_seqs, batch.max_query_len):
            hidden = graphs.run(inputs)  # [num_seqs, hidden]
            return self.model.compute_logits(hidden[batch.logits_indices])
        return self.model(inputs.input_ids, inputs.positions, batch)

    def _sample(self, logits: torch.Tensor, inputs: StepInputs) -> Sampled:
        """Sampled ids, the logprobs the rows ask for and the verdict on proposals, named
        device tensors read back in the step's one host sync (outputs.read_back)."""
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
        segments = {"token_ids": sampled_ids}  # the common step names nothing else
        if num_lp:
            top_ids, top_lps = top_logprobs(lp_logits, inputs.logprob_rows,
                                            int(inputs.num_logprobs.max()))
            segments.update(top_ids=top_ids, top_logprobs=top_lps)  # [num_lp, k]
        if num_slp:
            rows = inputs.sampled_lp_rows  # [num_slp]
            own, ranks, _ = token_logprobs(lp_logits.index_select(0, rows), sampled_ids[rows])
            segments.update(sampled_logprobs=own, sampled_ranks=ranks)
        pl = inputs.prompt_lp
        if pl is not None:
            own, ranks, lsm = token_logprobs(logits[num_rows:num_rows + len(inputs.prompt_targets)],
                                             inputs.prompt_targets)
            pl_lps, pl_ids = lsm.topk(int(pl.num_top.max()), dim=-1)  # [num_pl, pl_k]
            segments.update(prompt_logprobs=own, prompt_ranks=ranks, prompt_top_ids=pl_ids,
                            prompt_top_logprobs=pl_lps)
        if inputs.spec is not None:  # drawn after the sampling rows' own draws, as ever
            verdict = self.verifier.verify(logits, inputs.spec, inputs.sampling)
            segments.update(spec_tokens=verdict.tokens, spec_counts=verdict.counts)
        return read_sampled(read_back(segments), inputs, self.input_batch.req_ids)

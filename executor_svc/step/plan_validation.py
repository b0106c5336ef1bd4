"""The rules a StepPlan must satisfy against what the executor holds.

`PlanValidator` is asked before each write the runner makes from a plan (runner.py): a
violation raises PlanError, which fails the step with its message (the executor keeps
serving; the runner drops every request the plan touched). The checks are made where a bad
value would otherwise do harm: an id past the vocabulary or the KV cache indexes out of
bounds (a device-side assert on CUDA), a token past a row's capacity writes outside it, a
repeated destination block makes a batched scatter's result undefined.
"""

from __future__ import annotations

import math

import numpy as np

from executor_svc.spec.verifier import SpecVerifier
from executor_svc.step.input_batch import InputBatch
from protos.plan import CachedRequest, NewRequest, SamplingSpec, StepPlan


class PlanError(ValueError):
    """A plan that contradicts what the executor holds (a scheduler bug, or lost state)."""


class PlanValidator:
    """Checks plans against the held requests and the executor's fixed limits.

    Owns no mutable state: it reads the persistent batch (never writes it), asks the
    verifier which rows may carry proposals, and keeps the limits it was built with.

    Invariants: every method either returns (the write it guards is safe) or raises PlanError
    with a sentence naming the request and the numbers; a method reads the batch as it is at
    the call, so the runner asks right before each write, in the plan's order.
    """

    def __init__(self, batch: InputBatch, verifier: SpecVerifier, *, vocab_size: int,
                 num_blocks: int, num_swap_blocks: int | None,
                 num_host_blocks: int | None = None):
        self.batch = batch
        self.verifier = verifier
        self.vocab_size = vocab_size
        self.num_blocks = num_blocks  # the device KV cache's
        self.num_swap_blocks = num_swap_blocks  # the CPU swap pool's; None: no pool
        self.num_host_blocks = num_host_blocks  # the prefix cache's host tier; None: none

    # ---- a plan's block moves -------------------------------------------------------------

    def check_block_moves(self, plan: StepPlan) -> None:
        """Every pair names blocks that exist, and no block is written twice in one list (a
        repeated destination would make the batched scatter's result undefined)."""
        if (plan.swap_out or plan.swap_in) and self.num_swap_blocks is None:
            raise PlanError("the plan swaps blocks, but this executor has no CPU swap pool "
                            "(started with --swap-space 0; num_swap_blocks = 0)")
        if (plan.offload_out or plan.offload_in) and self.num_host_blocks is None:
            raise PlanError("the plan copies blocks to or from a host tier, but this executor "
                            "has none (started with --kv-offloading-size 0)")
        for key in plan.offload_keys:
            try:
                bytes.fromhex(key)
            except ValueError:
                raise PlanError(f"offload key {key[:80]!r} is not hex") from None
        num_gpu, num_cpu = self.num_blocks, self.num_swap_blocks or 0
        num_host = self.num_host_blocks or 0
        for what, pairs, src_space, dst_space in (
                ("offload out", plan.offload_out, ("device", num_gpu), ("host", num_host)),
                ("offload in", plan.offload_in, ("host", num_host), ("device", num_gpu)),
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

    # ---- one request of the plan, before each write ---------------------------------------

    def check_new(self, new: NewRequest) -> None:
        """A whole new row: its blocks, tokens, sampling parameters and size."""
        self._check_block_ids(new.req_id, new.block_ids)
        self._check_token_ids(new.req_id, new.token_ids)
        self._check_sampling(new.req_id, new.sampling)
        self._check_capacity(new.req_id, len(new.token_ids), len(new.block_ids))

    def held_row(self, cached: CachedRequest) -> int:
        """The row of a request the plan says is held, whose computed count must agree."""
        batch = self.batch
        row = batch.row_of.get(cached.req_id)
        if row is None:
            raise PlanError(f"request {cached.req_id} is not held by the executor")
        if cached.num_computed_tokens != batch.num_computed[row]:
            raise PlanError(
                f"request {cached.req_id}: scheduler counts {cached.num_computed_tokens} "
                f"computed tokens, executor {batch.num_computed[row]}")
        return row

    def check_new_blocks(self, cached: CachedRequest, row: int) -> None:
        """`cached.new_block_ids`, before they are appended to the row's block table."""
        batch = self.batch
        self._check_block_ids(cached.req_id, cached.new_block_ids)
        self._check_capacity(cached.req_id, int(batch.num_tokens[row]),
                             int(batch.num_blocks[row]) + len(cached.new_block_ids))

    def check_new_tokens(self, cached: CachedRequest, row: int) -> None:
        """`cached.new_token_ids`, before they are appended: only for rows whose samples the
        scheduler picks (append_sampled is False)."""
        batch = self.batch
        if batch.append_sampled[row]:
            raise PlanError(
                f"request {cached.req_id}: new_token_ids sent, but the executor appends "
                "this request's sampled tokens itself (append_sampled is True)")
        self._check_token_ids(cached.req_id, cached.new_token_ids)
        self._check_capacity(cached.req_id,
                             int(batch.num_tokens[row]) + len(cached.new_token_ids),
                             int(batch.num_blocks[row]))

    def check_proposals(self, cached: CachedRequest, row: int) -> None:
        """`cached.spec_token_ids`, before they are appended for this step's verification: a
        row the verifier accepts, in a decode step that schedules them all."""
        batch = self.batch
        why = self.verifier.refusal(row)
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

    # ---- the step as a whole, after the writes --------------------------------------------

    def check_scheduled(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Every entry's scheduled tokens are held, fit its blocks and max_model_len; no request
        is scheduled twice. Vectorised; the first offending entry (plan order) is reported."""
        batch = self.batch
        block_size, max_model_len = batch.block_size, batch.max_model_len
        if len(np.unique(rows)) != len(rows):
            seen: set[int] = set()
            twice = next(r for r in rows.tolist() if r in seen or seen.add(r))
            raise PlanError(f"request {batch.req_ids[twice]} appears twice in one plan")
        computed, held = batch.num_computed[rows], batch.num_tokens[rows]  # [num_entries]
        num_blocks = batch.num_blocks[rows] // batch.num_kv_groups  # positions
        end = computed + counts
        over_tokens = (counts < 0) | (end > held)
        over_blocks = end > num_blocks * block_size
        over_len = end > max_model_len
        bad = over_tokens | over_blocks | over_len
        if not bad.any():
            return
        i = int(np.argmax(bad))
        row, req_id = int(rows[i]), batch.req_ids[int(rows[i])]
        if over_tokens[i]:
            hint = ("" if batch.append_sampled[row] else
                    "; it does not append its samples (append_sampled is False), so the plan "
                    "must send the next tokens in new_token_ids")
            raise PlanError(f"request {req_id}: {computed[i]} computed + {counts[i]} scheduled "
                            f"exceeds its {held[i]} tokens{hint}")
        if over_blocks[i]:
            raise PlanError(f"request {req_id}: {end[i]} tokens do not fit its "
                            f"{num_blocks[i]} blocks of {block_size}")
        raise PlanError(f"request {req_id}: {end[i]} tokens exceed max_model_len "
                        f"{max_model_len}")

    # ---- the rules ------------------------------------------------------------------------

    def _check_block_ids(self, req_id: str, block_ids: list[int]) -> None:
        # Checked once, when the ids arrive: an id out of range would index past the cache.
        if any(not (0 <= b < self.num_blocks) for b in block_ids):
            raise PlanError(f"request {req_id}: block table names a block outside "
                            f"0..{self.num_blocks - 1}")
        if len(block_ids) % (groups := self.batch.num_kv_groups):
            raise PlanError(f"request {req_id}: {len(block_ids)} block ids are not whole "
                            f"positions of {groups} KV groups (one block per group each)")

    def _check_token_ids(self, req_id: str, token_ids: list[int]) -> None:
        # An id past the embedding table would be a device-side assert on CUDA.
        if token_ids and not (0 <= min(token_ids) and max(token_ids) < self.vocab_size):
            raise PlanError(f"request {req_id}: token ids outside the model's "
                            f"vocabulary of {self.vocab_size}")

    def _check_sampling(self, req_id: str, s: SamplingSpec) -> None:
        """What the scheduler validated, checked again where a bad value would fail a step
        for every request in it (an id past the vocabulary indexes out of bounds)."""
        if not 0 <= s.num_logprobs <= self.vocab_size:
            raise PlanError(f"request {req_id}: num_logprobs {s.num_logprobs} is outside "
                            f"0..{self.vocab_size} (the model's vocabulary)")
        for what, ids in (("min_tokens_stop_ids", s.min_tokens_stop_ids),
                          ("logit_bias", [t for t, _ in s.logit_bias]),
                          ("allowed_token_ids", s.allowed_token_ids),
                          ("bad_words", [t for word in s.bad_words for t in word])):
            if ids and max(ids) >= self.vocab_size:
                raise PlanError(f"request {req_id}: {what} names token id {max(ids)}, outside "
                                f"the model's vocabulary of {self.vocab_size}")
        values = (s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.min_p,
                  *(b for _, b in s.logit_bias))
        if not all(math.isfinite(v) for v in values) or s.repetition_penalty <= 0:
            raise PlanError(f"request {req_id}: penalties, min_p and logit_bias must be finite "
                            f"and repetition_penalty > 0")
        if not -1 <= s.prompt_logprobs <= self.vocab_size:
            raise PlanError(f"request {req_id}: prompt_logprobs {s.prompt_logprobs} is "
                            f"outside -1..{self.vocab_size} (-1 = off; the model's vocabulary)")

    def _check_capacity(self, req_id: str, num_tokens: int, num_blocks: int) -> None:
        # A row holds max_model_len + 1 tokens (the last one sampled, never computed) and the
        # blocks max_model_len tokens need.
        batch = self.batch
        if num_tokens > batch.max_num_tokens:
            raise PlanError(f"request {req_id}: {num_tokens} tokens held exceed max_model_len "
                            f"{batch.max_model_len} (+1 sampled)")
        if num_blocks > batch.max_num_blocks:
            raise PlanError(f"request {req_id}: {num_blocks} blocks exceed the "
                            f"{batch.max_num_blocks} that max_model_len {batch.max_model_len} "
                            f"needs at block size {batch.block_size}")

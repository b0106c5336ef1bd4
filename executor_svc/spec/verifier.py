"""Speculative decoding, the executor's side: verify each row's proposals against the logits
the step computed, and settle the row to the tokens it keeps.

A row verifying s proposals computed s + 1 positions: its last real token (already held) and
the proposals d_0..d_{s-1}, which the runner appended to its tokens for the step
(`InputBatch.num_spec`). The logits of the first s positions come at `SpecPositions.start`
(inputs.py); the row's sampling row holds the last.

Verification: at every position the sampler draws the token it would draw without
speculation (`sample`: the argmax for greedy rows; for the others temperature, top-k, top-p
and the exponential race, a seeded row's noise keyed by (seed, token index) as in plain
decoding), and proposals are accepted while they equal those draws; the first draw that
differs is emitted after them (spec_decode.verify). For greedy rows this is the argmax
rule. For sampling rows it is standard rejection sampling specialised to deterministic
proposals (both proposers are: q is one-hot): a proposal d is accepted with probability
p(d) = min(1, p(d) / q(d)), and on rejection the emitted token is distributed as the residual
max(0, p - q) renormalised, p without d, since the race's draw given that it is not d is
exactly that. Coupling both with one draw makes every emitted token the very token plain
decoding draws at its index: a seeded request gives the same tokens with speculation or
without, across batches, preemption and crash resume.

The verdict stays on the device (`Verification`): the runner reads it back with the step's
sampled ids, in the step's one transfer (outputs.py), and hands the host tokens to `settle`.

Settling: the proposals are removed from the row, the emitted tokens (the accepted proposals,
then one more) appended, and its computed count set to cover exactly its known tokens but the
last (the usual decode invariant): the KV written at rejected positions is simply overwritten
later. Rows with logits processors, logprobs or structured output never carry proposals (the
scheduler proposes none; `SpecVerifier.refusal` names why the executor refuses them).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from executor_svc.kv.kv_cache import to_device
from executor_svc.sample.sampler import GREEDY_EPS, SamplingBatch, sample
from executor_svc.sample.structured import StructuredRows
from executor_svc.spec.spec_decode import verify as accept_matching
from executor_svc.step.input_batch import InputBatch
from executor_svc.step.inputs import SpecPositions


class Verification(NamedTuple):
    """What verification decided, on the device, one row per spec row (`SpecPositions`)."""

    tokens: torch.Tensor  # [num_spec_seqs, k + 1] int64: the emitted tokens, then -1
    counts: torch.Tensor  # [num_spec_seqs] int64 in 1..s + 1: how many each emits


def emitted_tokens(tokens: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    """A `Verification` read back to the host -> each row's emitted tokens."""
    return [t[:c] for t, c in zip(tokens.tolist(), counts.tolist(), strict=True)]


class SpecVerifier:
    """Verifies the proposals a step's rows carry and settles those rows.

    Holds the persistent batch (whose spec rows it reads and settles) and the structured-output
    rows (read only, for `refusal`); it keeps no state of its own between steps.

    Invariants: a row carries proposals (``num_spec[row] > 0``) only from the plan's write to
    `settle` in the same step, and only when `refusal(row)` is None; after `settle` the row
    holds its real tokens plus the emitted ones, ``num_computed == num_tokens - 1`` and
    ``num_spec == 0``.
    """

    def __init__(self, batch: InputBatch, structured: StructuredRows):
        self.batch = batch
        self.structured = structured

    def refusal(self, row: int) -> str | None:
        """Why a row may not verify (or be drafted) proposals, or None."""
        batch = self.batch
        spec = batch.specs[row]
        if spec is None or not spec.append_sampled:
            return "proposals need a request whose sampled tokens the executor appends"
        if spec.num_logprobs or spec.sampled_logprob or spec.prompt_logprobs >= 0:
            return "proposals cannot be verified for a request that asks for logprobs"
        if len(self.structured.constrained(np.array([row]))) > 0 or batch.processors.uses[row]:
            return ("proposals cannot be verified for a request with logits processors or "
                    "structured output")
        return None

    def verify(self, logits: torch.Tensor, spec: SpecPositions,
               sampling: SamplingBatch) -> Verification:
        """The tokens each spec row emits (1..s + 1, accepted proposals first), on the device.
        Draws after the step's own sampling (unseeded rows share the device's generator)."""
        batch = self.batch
        device = logits.device
        num_reqs, k = len(spec.rows), int(spec.counts.max())
        counts = spec.counts  # [R]
        starts = spec.start + np.cumsum(counts) - counts  # [R] first proposal logits row
        j = np.arange(k + 1)[None, :]  # [1, k+1]
        index = np.where(j < counts[:, None], starts[:, None] + j, spec.logits_rows[:, None])
        target = logits[to_device(index, device)].float()  # [R, k+1, V]
        base = batch.num_tokens[spec.rows] - counts  # [R] real tokens of each row: T0
        draft_np = np.full((num_reqs, k), -1, np.int64)
        for i, (row, t0, n) in enumerate(zip(spec.rows, base, counts, strict=True)):
            draft_np[i, :n] = batch.token_ids[row, t0:t0 + n]
        draft = to_device(draft_np, device)
        num_draft = to_device(counts.astype(np.int64), device)
        tokens, emitted = accept_matching(self._draws(target, spec, sampling, base), draft,
                                          num_draft)
        return Verification(tokens, emitted)

    def _draws(self, target: torch.Tensor, spec: SpecPositions, sampling: SamplingBatch,
               base: np.ndarray) -> torch.Tensor:
        """[R, k+1]: the token the sampler itself draws at each position (the argmax for
        greedy rows; for the others the exponential race on the filtered distribution, a
        seeded row's noise keyed by (seed, T0 + j) exactly as plain decoding keys it)."""
        batch = self.batch
        num_reqs, width, vocab = target.shape
        if (batch.temperature[spec.rows] < GREEDY_EPS).all():
            return target.argmax(dim=-1)
        device = target.device
        per_pos = to_device(np.repeat(spec.logits_rows, width), device)  # [R * (k+1)]
        seeded = np.flatnonzero(np.repeat(batch.has_seed[spec.rows], width))  # flat positions
        index = (base[:, None] + np.arange(width)[None, :]).reshape(-1)  # token index drawn
        expanded = SamplingBatch(
            temperature=sampling.temperature[per_pos], top_p=sampling.top_p[per_pos],
            top_k=sampling.top_k[per_pos],
            seeded_rows=to_device(seeded, device),
            seeds=to_device(np.repeat(batch.seed[spec.rows], width)[seeded], device),
            token_indices=to_device(index[seeded], device),
            all_greedy=False, any_filter=sampling.any_filter)
        return sample(target.reshape(-1, vocab), expanded).view(num_reqs, width)

    def settle(self, spec: SpecPositions, emitted: list[list[int]]) -> None:
        """Each spec row back to its real tokens plus the emitted ones; computed = all but the
        last (the runner already added the step's query length to num_computed)."""
        batch = self.batch
        for row, n, tokens in zip(spec.rows.tolist(), spec.counts.tolist(), emitted,
                                  strict=True):
            t0 = int(batch.num_tokens[row]) - n
            batch.num_tokens[row] = t0
            batch.append_tokens(row, tokens)
            batch.num_computed[row] = t0 + len(tokens) - 1
            batch.num_spec[row] = 0

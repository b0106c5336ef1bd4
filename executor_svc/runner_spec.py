"""Speculative decoding, the executor's side: verify each row's proposals against the logits
the step computed, and settle the row to the tokens it keeps.

A row verifying s proposals computed s + 1 positions: its last real token (already held) and
the proposals d_0..d_{s-1}, which `ModelRunner._update` appended to its tokens for the step
(`InputBatch.num_spec`). The logits of the first s positions come at `SpecPositions.start`
(inputs.py); the row's sampling row holds the last. Verification (spec_decode.py): greedy rows
accept while the argmax agrees, so their output is token for token non-speculative greedy's;
the others run rejection sampling on the distribution the sampler would draw from at each
position (temperature, top-k, top-p), so what they emit is distributed as the target's own
draws. A seeded row's randomness is counter-based on (seed, the index of the token drawn):
the acceptance test's uniform and the draw's Exp(1) noise at position j depend only on the
seed and T0 + j (T0 the row's real token count), never on the batch, so a seeded request
repeats itself exactly.

Settling: the proposals are removed from the row, the emitted tokens (the accepted proposals,
then one more) appended, and its computed count set to cover exactly its known tokens but the
last (the usual decode invariant): the KV written at rejected positions is simply overwritten
later. Rows with logits processors, logprobs or structured output never carry proposals (the
scheduler proposes none; `check_proposals` refuses them).
"""

from __future__ import annotations

import numpy as np
import torch

from executor_svc.input_batch import InputBatch
from executor_svc.inputs import SpecPositions
from executor_svc.sampler import (
    GREEDY_EPS,
    SamplingBatch,
    sample_with_distribution,
    seeded_bits,
    seeded_exponentials,
)
from executor_svc.spec_decode import rejection_sample, verify_greedy

_UNIFORM_SALT = 0x5BD1E995  # the acceptance tests' stream, apart from the draws' noise


def refusal(batch: InputBatch, row: int, structured: bool) -> str | None:
    """Why a row may not verify proposals, or None."""
    spec = batch.specs[row]
    if spec is None or not spec.append_sampled:
        return "proposals need a request whose sampled tokens the executor appends"
    if spec.num_logprobs or spec.sampled_logprob or spec.prompt_logprobs >= 0:
        return "proposals cannot be verified for a request that asks for logprobs"
    if structured or batch.processors.uses[row]:
        return ("proposals cannot be verified for a request with logits processors or "
                "structured output")
    return None


def verify(logits: torch.Tensor, spec: SpecPositions, sampling: SamplingBatch,
           batch: InputBatch) -> list[list[int]]:
    """The tokens each spec row emits (1..s + 1, accepted proposals first)."""
    device = logits.device
    num_reqs, k = len(spec.rows), int(spec.counts.max())
    counts = spec.counts  # [R]
    starts = spec.start + np.cumsum(counts) - counts  # [R] first proposal logits row
    j = np.arange(k + 1)[None, :]  # [1, k+1]
    index = np.where(j < counts[:, None], starts[:, None] + j, spec.logits_rows[:, None])
    target = logits[torch.from_numpy(index).to(device)].float()  # [R, k+1, V]
    base = batch.num_tokens[spec.rows] - counts  # [R] real tokens of each row: T0
    draft_np = np.full((num_reqs, k), -1, np.int64)
    for i, (row, t0, n) in enumerate(zip(spec.rows, base, counts, strict=True)):
        draft_np[i, :n] = batch.token_ids[row, t0:t0 + n]
    draft = torch.from_numpy(draft_np).to(device)
    num_draft = torch.from_numpy(counts.astype(np.int64)).to(device)
    tokens, emitted = verify_greedy(target.argmax(dim=-1), draft, num_draft)
    temperature = batch.temperature[spec.rows]
    random_rows = np.flatnonzero(temperature >= GREEDY_EPS)
    if len(random_rows):
        sub = torch.from_numpy(random_rows).to(device)
        sampled_tokens, sampled_counts = _rejection(
            target[sub], draft[sub], num_draft[sub], spec.rows[random_rows],
            base[random_rows], sampling, spec.logits_rows[random_rows], batch)
        tokens[sub], emitted[sub] = sampled_tokens, sampled_counts
    host_tokens, host_counts = tokens.tolist(), emitted.tolist()
    return [t[:c] for t, c in zip(host_tokens, host_counts, strict=True)]


def _rejection(target: torch.Tensor, draft: torch.Tensor, num_draft: torch.Tensor,
               rows: np.ndarray, base: np.ndarray, sampling: SamplingBatch,
               logits_rows: np.ndarray, batch: InputBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for rows that draw: target [R, k+1, V] raw logits."""
    device = target.device
    num_reqs, width, vocab = target.shape
    k = width - 1
    per_pos = torch.from_numpy(np.repeat(logits_rows, width)).to(device)  # [R * (k+1)]
    expanded = SamplingBatch(
        temperature=sampling.temperature[per_pos], top_p=sampling.top_p[per_pos],
        top_k=sampling.top_k[per_pos],
        seeded_rows=torch.empty(0, dtype=torch.int64, device=device),
        seeds=torch.empty(0, dtype=torch.int64, device=device),
        token_indices=torch.empty(0, dtype=torch.int64, device=device),
        all_greedy=False, any_filter=sampling.any_filter)
    _, drawn = sample_with_distribution(target.reshape(-1, vocab), expanded)
    probs = drawn.softmax(dim=-1).view(num_reqs, width, vocab)
    noise = torch.empty(num_reqs, width, vocab, device=device).exponential_().clamp_min_(1e-20)
    uniforms = torch.rand(num_reqs, k, device=device)
    seeded = np.flatnonzero(batch.has_seed[rows])
    if len(seeded):
        seeds = np.repeat(batch.seed[rows[seeded]], width)  # [S * (k+1)]
        index = (base[seeded][:, None] + np.arange(width)[None, :]).reshape(-1)
        seeds_t = torch.from_numpy(seeds).to(device)
        index_t = torch.from_numpy(index).to(device)
        sub = torch.from_numpy(seeded).to(device)
        noise[sub] = seeded_exponentials(seeds_t, index_t, vocab).view(-1, width, vocab)
        bits = seeded_bits(seeds_t ^ _UNIFORM_SALT, index_t, 1).view(-1, width)[:, :k]
        uniforms[sub] = bits.double().add(0.5).mul(2.0 ** -32).float()
    return rejection_sample(probs, draft, num_draft, None, uniforms, noise)


def settle(batch: InputBatch, spec: SpecPositions, emitted: list[list[int]]) -> None:
    """Each spec row back to its real tokens plus the emitted ones; computed = all but the
    last (the runner already added the step's query length to num_computed)."""
    for row, n, tokens in zip(spec.rows.tolist(), spec.counts.tolist(), emitted, strict=True):
        t0 = int(batch.num_tokens[row]) - n
        batch.num_tokens[row] = t0
        batch.append_tokens(row, tokens)
        batch.num_computed[row] = t0 + len(tokens) - 1
        batch.num_spec[row] = 0

"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds; top logprobs.

One row of logits per request that samples this step. Greedy rows (temperature 0) take the exact
argmax. The other rows draw with the exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)``
picks token i with probability probs[i], so the only random input is a noise row.

A seeded request's noise row comes from a generator seeded with (seed, index of the token being
drawn). Its draws therefore depend on nothing but its own logits, seed and length: not on the
other requests in the batch, nor on whether it was preempted and recomputed in between.
Unseeded rows share one draw from the device's global generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protos.plan import SamplingSpec

_GREEDY_EPS = 1e-5  # temperatures below this are greedy
_MASK64 = (1 << 64) - 1


def _seed_for(seed: int, index: int) -> int:
    """Mix (seed, token index) into one 64-bit generator seed (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True)
class SamplingBatch:
    temperature: torch.Tensor  # [num_rows] float32, 0 = greedy
    top_p: torch.Tensor  # [num_rows] float32, 1 = off
    top_k: torch.Tensor  # [num_rows] int64, 0 = off
    seeds: list[int | None]  # per row; None = global generator
    token_indices: list[int]  # per row: index the sampled token will have in its request
    all_greedy: bool
    any_filter: bool  # some row uses top-k or top-p

    @classmethod
    def from_specs(cls, specs: list[SamplingSpec], token_indices: list[int],
                   device: torch.device) -> SamplingBatch:
        temperature = [s.temperature for s in specs]
        top_p = [s.top_p for s in specs]
        top_k = [s.top_k for s in specs]
        # One host-to-device copy for all three (top-k values are exact in float64).
        params = torch.tensor([temperature, top_p, top_k], dtype=torch.float64).to(device)
        return cls(
            temperature=params[0].float(),  # [num_rows]
            top_p=params[1].float(),
            top_k=params[2].long(),
            seeds=[s.seed for s in specs],
            token_indices=list(token_indices),
            all_greedy=all(t < _GREEDY_EPS for t in temperature),
            any_filter=any(p < 1.0 for p in top_p) or any(k > 0 for k in top_k),
        )


def _exponential_noise(batch: SamplingBatch, num_rows: int, vocab: int,
                       device: torch.device) -> torch.Tensor:
    noise = torch.empty(num_rows, vocab, dtype=torch.float32, device=device)
    noise.exponential_()
    # Seeded rows redraw from their own generator; this loop holds only the random draw.
    for row, seed in enumerate(batch.seeds):
        if seed is None:
            continue
        gen = torch.Generator(device=device)
        gen.manual_seed(_seed_for(seed, batch.token_indices[row]))
        noise[row].exponential_(generator=gen)
    return noise.clamp_min_(1e-20)  # [num_rows, vocab]


def _filter_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what falls outside top-k, then outside the top-p nucleus of the rest."""
    num_rows, vocab = sorted_logits.shape
    ranks = torch.arange(vocab, device=sorted_logits.device)  # [vocab]
    k = torch.where(top_k > 0, top_k, vocab)  # [num_rows]
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # [num_rows, vocab]
    # Keep a token while the mass strictly above it is below top_p; the top token always stays.
    mass_above = probs.cumsum(dim=-1) - probs
    outside = mass_above >= top_p[:, None]
    outside[:, 0] = False
    return sorted_logits.masked_fill(outside, float("-inf"))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [num_rows, vocab] float32 -> token ids [num_rows] int64 (on the logits' device)."""
    assert logits.shape[0] == len(batch.seeds), "one logits row per sampling request"
    greedy_ids = logits.argmax(dim=-1)  # [num_rows]
    if batch.all_greedy:
        return greedy_ids
    num_rows, vocab = logits.shape
    is_greedy = batch.temperature < _GREEDY_EPS
    temperature = torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature)
    scaled = logits / temperature[:, None]  # [num_rows, vocab]
    noise = _exponential_noise(batch, num_rows, vocab, logits.device)
    sampled_ids = (scaled.softmax(dim=-1) / noise).argmax(dim=-1)  # [num_rows]
    if batch.any_filter:
        # Work in sorted order; a stable sort keeps ties in index order, like argmax. Each
        # token keeps its own noise there. Rows without a filter keep the draw above: the
        # sorted path's sums round differently, and a row's draw must not depend on whether
        # another row in the batch needed this path.
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
        probs = _filter_sorted(sorted_logits, batch.top_k, batch.top_p).softmax(dim=-1)
        choice = (probs / noise.gather(1, sorted_ids)).argmax(dim=-1, keepdim=True)
        filtered_ids = sorted_ids.gather(1, choice).squeeze(1)  # [num_rows]
        has_filter = (batch.top_k > 0) | (batch.top_p < 1.0)
        sampled_ids = torch.where(has_filter, filtered_ids, sampled_ids)
    return torch.where(is_greedy, greedy_ids, sampled_ids)  # [num_rows]


def top_logprobs(logits: torch.Tensor, rows: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of the given logits rows, best first, with their logprobs.

    logits [num_rows, vocab]; rows [num_lp_rows] int64 -> (token ids [num_lp_rows, k] int64,
    logprobs [num_lp_rows, k] float32). Logprobs are log_softmax of the raw logits in fp32,
    before temperature, top-k or top-p: the scores beam search ranks by.
    """
    logprobs = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
    values, token_ids = logprobs.topk(k, dim=-1, largest=True, sorted=True)
    return token_ids, values

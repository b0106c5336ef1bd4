"""Batched sampling: logits processors, greedy, temperature, min-p, top-k, top-p, per-request
seeds; logprobs.

One row of logits per request that samples this step, and one batched computation for all of
them: the only Python branches test flags the host computed from the plan (all greedy, any
filter, any processor, how many rows are seeded), never a row's values. The order is vLLM v1's:

    raw logits ──► (logprobs are read here by default: the raw model distribution)
      └► allowed_token_ids + bad words ─► min_tokens ─► logit_bias ─► penalties
           (logits_processors.apply_processors; skipped when no row uses any)
      └► greedy rows: argmax
      └► other rows: / temperature ─► min_p ─► top-k / top-p ─► exponential-race draw
      (`sample_with_distribution` also returns what each row was drawn from: the processed
       logits for greedy rows, the filtered scaled ones for the others; PROCESSED logprobs)

Greedy rows (temperature 0) take the exact argmax of the processed logits. The other rows draw
with the exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)`` per vocab entry picks
token v with probability probs[v], so the only random input is a noise row.

The random stream. A seeded row's noise is counter-based: for vocab entry v of the token at
index i (the position the sampled token will have in its request) it is a pure function of
(seed, i, v), computed with batched integer ops on the device (``seeded_exponentials``):

    (k1, k2) = per-row keys, hashed from the seed's two 32-bit halves and i
    x = mix32(mix32((k1 + v * 0x9E3779B9) mod 2**32) xor k2)       32 random bits
    u = (x + 0.5) / 2**32  in (0, 1);   E = -log(u)                 in float64, then float32

mix32 is a 32-bit xor-shift-multiply finaliser. The 32-bit values live in int64 tensors and
every multiplier is below 2**31, so no product reaches 2**63: no signed overflow, and every
right shift sees a non-negative value (torch's >> is arithmetic). A seeded request's draws
therefore depend only on its logits, seed and token index: not on its neighbours in the batch,
its row, the device's generator, or whether it was preempted and recomputed. Unseeded rows
share one batched draw from the device's global generator (cheaper than the hash, and nothing
asks them to be reproducible).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.sample.logits_processors import LogitsProcessing, apply_min_p, apply_processors
from protos.plan import SamplingSpec

GREEDY_EPS = 1e-5  # temperatures below this are greedy
_MASK32 = 0xFFFFFFFF
_MIX_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)  # both < 2**31: see the docstring
_GOLDEN32 = 0x9E3779B9  # spreads consecutive vocab ids over the 32-bit key space
_KEY_SALTS = (0x243F6A88, 0x85A308D3)
_MASK64 = (1 << 64) - 1


def seed_bits(seed: int) -> int:
    """A seed's low 64 bits as a signed int64 (seeds are any int; the API allows 0..2**63-1)."""
    return ((seed & _MASK64) ^ (1 << 63)) - (1 << 63)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """x int64 in [0, 2**32) -> a bijective 32-bit hash of it, in place."""
    m1, m2 = _MIX_MULTIPLIERS
    x ^= x >> 16
    x.mul_(m1).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(m2).bitwise_and_(_MASK32)
    x ^= x >> 15
    return x


def seeded_bits(seeds: torch.Tensor, token_indices: torch.Tensor, vocab: int) -> torch.Tensor:
    """seeds [n] int64 (any 64-bit pattern), token_indices [n] int64 >= 0 -> [n, vocab] int64
    in [0, 2**32): the random bits of each (seed, token index, vocab entry)."""
    seed_lo, seed_hi = seeds & _MASK32, (seeds >> 32) & _MASK32  # [n]; & undoes the sign
    index = token_indices & _MASK32
    k1 = _mix32(_mix32(_mix32(seed_lo ^ _KEY_SALTS[0]) ^ seed_hi) ^ index)  # [n]
    k2 = _mix32(_mix32(_mix32(seed_hi ^ _KEY_SALTS[1]) ^ seed_lo) ^ index)  # [n]
    offsets = torch.arange(vocab, device=seeds.device).mul_(_GOLDEN32)  # [vocab], < 2**63
    x = (k1[:, None] + offsets[None, :]).bitwise_and_(_MASK32)  # [n, vocab]
    x = _mix32(x)
    x ^= k2[:, None]
    return _mix32(x)


def seeded_exponentials(seeds: torch.Tensor, token_indices: torch.Tensor,
                        vocab: int) -> torch.Tensor:
    """[n] seeds and token indices -> Exp(1) noise [n, vocab] float32, all > 0."""
    u = seeded_bits(seeds, token_indices, vocab).double().add_(0.5).mul_(2.0 ** -32)
    return u.log_().neg_().float()


@dataclass(frozen=True)
class SamplingBatch:
    """Sampling parameters of the rows that sample this step, already on the device."""

    temperature: torch.Tensor  # [num_rows] float32, 0 = greedy
    top_p: torch.Tensor  # [num_rows] float32, 1 = off
    top_k: torch.Tensor  # [num_rows] int64, 0 = off
    seeded_rows: torch.Tensor  # [num_seeded] int64, increasing: rows with their own seed
    seeds: torch.Tensor  # [num_seeded] int64: the seeds' low 64 bits
    token_indices: torch.Tensor  # [num_seeded] int64: index the sampled token will have
    all_greedy: bool
    any_filter: bool  # some row uses top-k or top-p
    processing: LogitsProcessing | None = None  # None: no row uses a logits processor

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_specs(cls, specs: list[SamplingSpec], token_indices: list[int],
                   device: torch.device) -> SamplingBatch:
        """For tests and tools. The runner builds its batches from the persistent batch's
        arrays, in the step's one host-to-device copy (inputs.py)."""
        seeded = [i for i, s in enumerate(specs) if s.seed is not None]
        return cls(
            temperature=torch.tensor([s.temperature for s in specs], device=device),
            top_p=torch.tensor([s.top_p for s in specs], device=device),
            top_k=torch.tensor([s.top_k for s in specs], dtype=torch.int64, device=device),
            seeded_rows=torch.tensor(seeded, dtype=torch.int64, device=device),
            seeds=torch.tensor([seed_bits(specs[i].seed or 0) for i in seeded],
                               dtype=torch.int64, device=device),
            token_indices=torch.tensor([token_indices[i] for i in seeded], dtype=torch.int64,
                                       device=device),
            all_greedy=all(s.temperature < GREEDY_EPS for s in specs),
            any_filter=any(s.top_p < 1.0 or s.top_k > 0 for s in specs),
        )


def _exponential_noise(batch: SamplingBatch, vocab: int, device: torch.device) -> torch.Tensor:
    num_rows, num_seeded = batch.num_rows, batch.seeded_rows.shape[0]
    if num_seeded == num_rows:
        return seeded_exponentials(batch.seeds, batch.token_indices, vocab)
    noise = torch.empty(num_rows, vocab, dtype=torch.float32, device=device)
    noise.exponential_().clamp_min_(1e-20)  # [num_rows, vocab]; some torch builds can draw 0
    if num_seeded:
        noise.index_copy_(0, batch.seeded_rows,
                          seeded_exponentials(batch.seeds, batch.token_indices, vocab))
    return noise


def _filter_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what falls outside top-k, then outside the top-p nucleus of the rest."""
    num_rows, vocab = sorted_logits.shape
    ranks = torch.arange(vocab, device=sorted_logits.device)  # [vocab]
    k = torch.where(top_k > 0, top_k, vocab)  # [num_rows]
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # [num_rows, vocab]
    # Keep a token while the mass strictly above it is below top_p; the top token always stays.
    # top_p = 1 is no nucleus: the fp32 cumsum can round to 1 before the tail, and top-k's
    # survivors must not be dropped by that rounding.
    mass_above = probs.cumsum(dim=-1) - probs
    outside = (mass_above >= top_p[:, None]) & (top_p < 1.0)[:, None]
    outside[:, 0] = False
    return sorted_logits.masked_fill(outside, float("-inf"))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [num_rows, vocab] float32 -> token ids [num_rows] int64 (on the logits' device)."""
    return _draw(logits, batch, processed=False)[0]


def sample_with_distribution(logits: torch.Tensor, batch: SamplingBatch
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample`'s ids (the same draws) and the distribution each row was drawn from, as
    [num_rows, vocab] float32 logits: after the processors, then for non-greedy rows after
    temperature, min_p, top-k and top-p, the tokens those remove at -inf."""
    ids, processed = _draw(logits, batch, processed=True)
    assert processed is not None
    return ids, processed


def _draw(logits: torch.Tensor, batch: SamplingBatch,
          processed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert logits.shape[0] == batch.num_rows, "one logits row per sampling request"
    processing = batch.processing
    if processing is not None:
        logits = apply_processors(logits, processing)  # a copy: the caller's stay raw
    greedy_ids = logits.argmax(dim=-1)  # [num_rows]
    if batch.all_greedy:
        return greedy_ids, (logits if processed else None)
    num_rows, vocab = logits.shape
    is_greedy = batch.temperature < GREEDY_EPS
    temperature = torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature)
    scaled = logits / temperature[:, None]  # [num_rows, vocab]
    if processing is not None and processing.min_p is not None:
        scaled = apply_min_p(scaled, processing.min_p)
    noise = _exponential_noise(batch, vocab, logits.device)  # [num_rows, vocab]
    sampled_ids = (scaled.softmax(dim=-1) / noise).argmax(dim=-1)  # [num_rows]
    drawn_from = scaled
    if batch.any_filter:
        # Work in sorted order; a stable sort keeps ties in index order, like argmax. Each
        # token keeps its own noise there. Rows without a filter keep the draw above: the
        # sorted path's sums round differently, and a row's draw must not depend on whether
        # another row in the batch needed this path.
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
        kept = _filter_sorted(sorted_logits, batch.top_k, batch.top_p)  # [num_rows, vocab]
        probs = kept.softmax(dim=-1)
        choice = (probs / noise.gather(1, sorted_ids)).argmax(dim=-1, keepdim=True)
        filtered_ids = sorted_ids.gather(1, choice).squeeze(1)  # [num_rows]
        has_filter = (batch.top_k > 0) | (batch.top_p < 1.0)
        sampled_ids = torch.where(has_filter, filtered_ids, sampled_ids)
        if processed:  # back to vocab order
            unsorted = torch.empty_like(kept).scatter_(1, sorted_ids, kept)
            drawn_from = torch.where(has_filter[:, None], unsorted, scaled)
    ids = torch.where(is_greedy, greedy_ids, sampled_ids)  # [num_rows]
    if not processed:
        return ids, None
    return ids, torch.where(is_greedy[:, None], logits, drawn_from)


def top_logprobs(logits: torch.Tensor, rows: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of the given logits rows, best first, with their logprobs.

    logits [num_rows, vocab]; rows [num_lp_rows] int64 -> (token ids [num_lp_rows, k] int64,
    logprobs [num_lp_rows, k] float32): log_softmax in fp32 of the rows given, the raw logits
    (the scores beam search ranks by) or, for PROCESSED logprobs, what the rows were drawn from.
    """
    logprobs = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
    values, token_ids = logprobs.topk(k, dim=-1, largest=True, sorted=True)
    return token_ids, values


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's given token: its logprob and rank, and the row's log_softmax for more.

    logits [n, vocab]; token_ids [n] int64 -> (logprobs [n] float32, ranks [n] int64,
    log_softmax [n, vocab] float32). The rank is 1 + the number of entries strictly greater
    (vLLM's rank: ties share the better rank). Raw logits, fp32, like `top_logprobs`.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    own = logprobs.gather(1, token_ids[:, None])  # [n, 1]
    ranks = (logprobs > own).sum(dim=-1) + 1  # [n]
    return own.squeeze(1), ranks, logprobs

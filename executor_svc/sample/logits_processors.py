"""The logits processors, as batched ops over the rows that sample.

Order (vLLM v1's sampler): allowed_token_ids and bad words, min_tokens, logit_bias, then the
repetition / frequency / presence penalties; the sampler then takes the greedy argmax or applies
temperature, then ``apply_min_p``, then top-k / top-p, then draws. Bans (bad words and
min_tokens) are one masked write, so their relative order does not matter. Every op touches only
the rows that use it, element by element, so a row's processed logits do not depend on its
neighbours in the batch; a row that uses no processor keeps its raw logits bit for bit.

Penalties are computed from the token history each step (scatter_add over the positions held),
not kept as running counts: nothing to keep in sync across preemption, resume or a failed step,
at a cost proportional to the penalised rows' lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitsProcessing:
    """One step's processor inputs on the device (rows are logits rows); see processor_rows."""

    ban_rows: torch.Tensor  # [num_bans] int64
    ban_ids: torch.Tensor  # [num_bans] int64
    restricted_rows: torch.Tensor  # [num_restricted] int64
    allowed_rows: torch.Tensor  # [num_allowed] int64
    allowed_ids: torch.Tensor  # [num_allowed] int64
    bias_rows: torch.Tensor  # [num_bias] int64
    bias_ids: torch.Tensor  # [num_bias] int64
    bias_values: torch.Tensor  # [num_bias] float32
    penalty_rows: torch.Tensor  # [num_pen] int64
    penalty_history: torch.Tensor  # [num_pen, width] int32
    penalty_num_prompt: torch.Tensor  # [num_pen] int64
    penalty_num_tokens: torch.Tensor  # [num_pen] int64
    repetition: torch.Tensor  # [num_pen] float32
    presence: torch.Tensor  # [num_pen] float32
    frequency: torch.Tensor  # [num_pen] float32
    min_p: torch.Tensor | None  # [num_rows] float32; None = no row uses min_p


def token_counts(history: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                 vocab: int) -> torch.Tensor:
    """history [n, width] int; start, end [n] -> [n, vocab] float32: how often each token
    occurs in history[i, start[i]:end[i]]."""
    n, width = history.shape
    pos = torch.arange(width, device=history.device)  # [width]
    inside = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])  # [n, width]
    index = torch.where(inside, history.long(), vocab)  # outside -> a spare column
    counts = torch.zeros(n, vocab + 1, dtype=torch.float32, device=history.device)
    counts.scatter_add_(1, index, torch.ones(n, width, dtype=torch.float32,
                                             device=history.device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, p: LogitsProcessing) -> torch.Tensor:
    """logits [num_pen, vocab] of the penalised rows -> penalised copy. Repetition (HF) over
    prompt + output: positive logits of seen tokens divided, the others multiplied. Frequency
    and presence (OpenAI) over output tokens: minus penalty x count, minus penalty x seen."""
    vocab = logits.shape[1]
    zero = torch.zeros_like(p.penalty_num_prompt)
    prompt = token_counts(p.penalty_history, zero, p.penalty_num_prompt, vocab)  # [n, vocab]
    output = token_counts(p.penalty_history, p.penalty_num_prompt, p.penalty_num_tokens, vocab)
    seen = (prompt > 0) | (output > 0)
    factor = torch.where(seen, p.repetition[:, None], 1.0)  # [n, vocab]
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    logits = logits - p.frequency[:, None] * output
    return logits - p.presence[:, None] * (output > 0).float()


def apply_processors(logits: torch.Tensor, p: LogitsProcessing) -> torch.Tensor:
    """logits [num_rows, vocab] float32 (left untouched: logprobs read them) -> processed copy."""
    logits = logits.clone()
    num_rows, vocab = logits.shape
    if len(p.restricted_rows):
        keep = torch.ones(num_rows, vocab, dtype=torch.bool, device=logits.device)
        keep[p.restricted_rows] = False
        keep[p.allowed_rows, p.allowed_ids] = True
        logits.masked_fill_(~keep, float("-inf"))
    if len(p.ban_rows):
        logits.index_put_((p.ban_rows, p.ban_ids),
                          logits.new_full((), float("-inf")))  # a fill, not a host copy
    if len(p.bias_rows):
        logits.index_put_((p.bias_rows, p.bias_ids), p.bias_values, accumulate=True)
    if len(p.penalty_rows):
        rows = p.penalty_rows
        logits[rows] = apply_penalties(logits[rows], p)
    return logits


def apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """scaled [num_rows, vocab] (after temperature), min_p [num_rows] -> tokens whose
    probability is below min_p x the row's top probability set to -inf. A row with min_p 0
    loses nothing (every probability is >= 0)."""
    probs = scaled.softmax(dim=-1)  # [num_rows, vocab]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return scaled.masked_fill(probs < threshold, float("-inf"))

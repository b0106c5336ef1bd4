"""Per-row logits-processor parameters of the persistent batch, and their per-step gather.

A request's processors (``SamplingSpec.min_tokens`` .. ``bad_words``) are written into its row
once, when it arrives; each step gathers what the rows that sample need into flat arrays with
numpy indexing over those rows (no per-row Python loop), for the one host-to-device copy
(``inputs.py``) and the batched ops of ``logits_processors.py``::

    row r ──► uses[r]                          any processor at all (the one gate per step)
              min_tokens[r], stop_ids[r, :]    ids banned while the output is shorter
              repetition/presence/frequency[r], has_penalty[r]
              min_p[r]
              bias_ids[r, :], bias_values[r, :]
              allowed_ids[r, :]                empty = every token
              bad_words[r, :, :]               [words, tokens], right-aligned, padded with -1

Variable-length lists live in ``PaddedRows``: one array padded to the longest list seen, which
widens (doubling) when a longer one arrives. A step that samples no row with ``uses`` set
gathers nothing. Output tokens are ``token_ids[r, num_prompt[r]:num_tokens[r]]`` of the input
batch: the prompt length travels in each NewRequest, so counts stay right after a resume.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos.plan import SamplingSpec

_MISSING = -2  # an output position before the first output token (matches no bad-word token)


class PaddedRows:
    """Per-row arrays of up to ``ndim`` variable dimensions in one padded array.

    ``data[r]`` holds row r's values in the corner ``[:n0, :n1, ...]`` (the last dimension
    right-aligned when ``right_align``), ``pad`` elsewhere; ``lengths[r]`` is its n0.
    """

    def __init__(self, capacity: int, dtype: type, pad: float, ndim: int = 1,
                 right_align: bool = False):
        self.pad, self.right_align = pad, right_align
        self.data = np.full((capacity,) + (0,) * ndim, pad, dtype)
        self.lengths = np.zeros(capacity, np.int64)

    def _place(self, shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple[slice, ...]:
        """Where values of `shape` sit inside a row of `dims`."""
        spans = [slice(0, n) for n in shape]
        if self.right_align:
            spans[-1] = slice(dims[-1] - shape[-1], dims[-1])
        return tuple(spans)

    def _reshape(self, capacity: int, dims: tuple[int, ...]) -> None:
        old = self.data
        self.data = np.full((capacity,) + dims, self.pad, old.dtype)
        rows = min(capacity, old.shape[0])
        self.data[(slice(0, rows),) + self._place(old.shape[1:], dims)] = old[:rows]
        lengths = np.zeros(capacity, np.int64)
        lengths[:rows] = self.lengths[:rows]
        self.lengths = lengths

    def grow(self, capacity: int) -> None:
        self._reshape(capacity, self.data.shape[1:])

    def set(self, row: int, values: np.ndarray) -> None:
        dims = self.data.shape[1:]
        if any(n > d for n, d in zip(values.shape, dims, strict=True)):
            self._reshape(self.data.shape[0],
                          tuple(d if n <= d else max(n, 2 * d)
                                for n, d in zip(values.shape, dims, strict=True)))
            dims = self.data.shape[1:]
        self.data[row] = self.pad
        self.data[row][self._place(values.shape, dims)] = values
        self.lengths[row] = values.shape[0]

    def clear(self, row: int) -> None:
        if self.lengths[row]:
            self.data[row] = self.pad
            self.lengths[row] = 0

    def flat(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """1-D lists of `rows` [n] -> (owner [m] int64: index into rows, values [m])."""
        lengths = self.lengths[rows]  # [n]
        width = int(lengths.max()) if len(rows) else 0
        mask = np.arange(width)[None, :] < lengths[:, None]  # [n, width]
        return np.nonzero(mask)[0], self.data[rows, :width][mask]


@dataclass(frozen=True)
class ProcessorInputs:
    """Host arrays one step's processors need; every row index is a logits row."""

    ban_rows: np.ndarray  # [num_bans] int64: min_tokens stop ids and bad-word last tokens
    ban_ids: np.ndarray  # [num_bans] int64
    restricted_rows: np.ndarray  # [num_restricted] int64: rows with allowed_token_ids
    allowed_rows: np.ndarray  # [num_allowed] int64
    allowed_ids: np.ndarray  # [num_allowed] int64
    bias_rows: np.ndarray  # [num_bias] int64
    bias_ids: np.ndarray  # [num_bias] int64
    bias_values: np.ndarray  # [num_bias] float32
    penalty_rows: np.ndarray  # [num_pen] int64
    penalty_history: np.ndarray  # [num_pen, width] int32: token_ids[:, :width], stale past the end
    penalty_num_prompt: np.ndarray  # [num_pen] int64
    penalty_num_tokens: np.ndarray  # [num_pen] int64
    repetition: np.ndarray  # [num_pen] float32
    presence: np.ndarray  # [num_pen] float32
    frequency: np.ndarray  # [num_pen] float32
    min_p: np.ndarray | None  # [num_logits] float32, None when no row uses min_p


class ProcessorRows:
    """The processor columns of ``InputBatch``; rows are the batch's rows."""

    def __init__(self, capacity: int):
        self.uses = np.zeros(capacity, bool)
        self.min_tokens = np.zeros(capacity, np.int64)
        self.has_penalty = np.zeros(capacity, bool)
        self.repetition = np.ones(capacity, np.float32)
        self.presence = np.zeros(capacity, np.float32)
        self.frequency = np.zeros(capacity, np.float32)
        self.min_p = np.zeros(capacity, np.float32)
        self.stop_ids = PaddedRows(capacity, np.int64, 0)
        self.bias_ids = PaddedRows(capacity, np.int64, 0)
        self.bias_values = PaddedRows(capacity, np.float32, 0.0)
        self.allowed_ids = PaddedRows(capacity, np.int64, 0)
        self.bad_words = PaddedRows(capacity, np.int64, -1, ndim=2, right_align=True)

    def _lists(self) -> tuple[PaddedRows, ...]:
        return self.stop_ids, self.bias_ids, self.bias_values, self.allowed_ids, self.bad_words

    def grow(self, capacity: int) -> None:
        num_old = len(self.uses)
        for name in ("uses", "min_tokens", "has_penalty", "repetition", "presence",
                     "frequency", "min_p"):
            old = getattr(self, name)
            new = np.zeros(capacity, old.dtype) if name != "repetition" else \
                np.ones(capacity, old.dtype)
            new[:num_old] = old
            setattr(self, name, new)
        for lists in self._lists():
            lists.grow(capacity)

    def add(self, row: int, s: SamplingSpec) -> None:
        has_penalty = (s.repetition_penalty != 1.0 or s.presence_penalty != 0.0
                       or s.frequency_penalty != 0.0)
        self.min_tokens[row] = s.min_tokens if s.min_tokens_stop_ids else 0
        self.has_penalty[row] = has_penalty
        self.repetition[row], self.presence[row] = s.repetition_penalty, s.presence_penalty
        self.frequency[row], self.min_p[row] = s.frequency_penalty, s.min_p
        if self.min_tokens[row]:
            self.stop_ids.set(row, np.array(s.min_tokens_stop_ids, np.int64))
        if s.logit_bias:
            self.bias_ids.set(row, np.array([t for t, _ in s.logit_bias], np.int64))
            self.bias_values.set(row, np.array([b for _, b in s.logit_bias], np.float32))
        if s.allowed_token_ids:
            self.allowed_ids.set(row, np.array(s.allowed_token_ids, np.int64))
        if s.bad_words:
            longest = max(map(len, s.bad_words))
            words = np.full((len(s.bad_words), longest), -1, np.int64)
            for i, word in enumerate(s.bad_words):  # once per request, not per step
                words[i, longest - len(word):] = word
            self.bad_words.set(row, words)
        self.uses[row] = bool(self.min_tokens[row] or has_penalty or s.min_p > 0
                              or s.logit_bias or s.allowed_token_ids or s.bad_words)

    def remove(self, row: int) -> None:
        if self.uses[row]:
            self.uses[row] = self.has_penalty[row] = False
            self.min_tokens[row] = 0
            self.min_p[row] = 0.0
            for lists in self._lists():
                lists.clear(row)

    def gather(self, sample_rows: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray,
               num_prompt: np.ndarray) -> ProcessorInputs | None:
        """sample_rows [num_logits]: the batch rows that sample, in logits order; token_ids,
        num_tokens, num_prompt: the input batch's arrays. None when no row uses a processor."""
        if not self.uses[sample_rows].any():
            return None
        held = num_tokens[sample_rows]  # [num_logits]
        num_output = held - num_prompt[sample_rows]
        # min_tokens: stop ids banned while the output is short.
        short = np.flatnonzero(num_output < self.min_tokens[sample_rows])
        owner, stop_ids = self.stop_ids.flat(sample_rows[short])
        ban_rows, ban_ids = [short[owner]], [stop_ids]
        # bad words: the last token of a word whose other tokens end the output.
        with_words = np.flatnonzero(self.bad_words.lengths[sample_rows])
        if len(with_words):
            rows = sample_rows[with_words]
            words = self.bad_words.data[rows]  # [n, num_words, length], right-aligned, -1 pad
            prefix, last = words[:, :, :-1], words[:, :, -1]
            width = prefix.shape[2]
            pos = held[with_words, None] - width + np.arange(width)  # [n, width]
            tail = np.where(pos >= num_prompt[rows, None],
                            token_ids[rows[:, None], np.maximum(pos, 0)], _MISSING)
            match = ((prefix == -1) | (prefix == tail[:, None, :])).all(axis=2) & (last >= 0)
            word_row, word = np.nonzero(match)  # [num_matches] each
            ban_rows.append(with_words[word_row])
            ban_ids.append(last[word_row, word])
        owner, allowed_ids = self.allowed_ids.flat(sample_rows)
        restricted = np.flatnonzero(self.allowed_ids.lengths[sample_rows])
        bias_owner, bias_ids = self.bias_ids.flat(sample_rows)
        _, bias_values = self.bias_values.flat(sample_rows)
        pen = np.flatnonzero(self.has_penalty[sample_rows])
        pen_rows = sample_rows[pen]
        width = int(held[pen].max()) if len(pen) else 0
        min_p = self.min_p[sample_rows]
        return ProcessorInputs(
            ban_rows=np.concatenate(ban_rows).astype(np.int64),
            ban_ids=np.concatenate(ban_ids).astype(np.int64),
            restricted_rows=restricted, allowed_rows=owner, allowed_ids=allowed_ids,
            bias_rows=bias_owner, bias_ids=bias_ids, bias_values=bias_values,
            penalty_rows=pen, penalty_history=token_ids[pen_rows, :width],
            penalty_num_prompt=num_prompt[pen_rows], penalty_num_tokens=held[pen],
            repetition=self.repetition[pen_rows], presence=self.presence[pen_rows],
            frequency=self.frequency[pen_rows],
            min_p=min_p if (min_p > 0).any() else None)

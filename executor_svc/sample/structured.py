"""Structured output in the executor: one llguidance matcher per constrained request, a token
bitmask for the rows that sample, and the matchers advanced with every token appended.

Where things live::

    NewRequest(structured) ──► StructuredRows.add(row)   matcher = compiled.deep_copy(),
                                  (a worker thread)       then the request's output tokens
                                                          replayed (a resume or a recompute)
    sampling rows ∩ constrained ──► bitmask [g, ceil(vocab / 32)] int32, filled by llguidance
                                  ──► apply_bitmask(logits, rows, bitmask): one batched op
    sampled / new token ids ──► StructuredRows.advance(row, ids)

Nothing crosses the wire per step: the executor already appends every token it samples, and
advances the row's matcher with it. A NewRequest (preemption by recompute, swap-in, crash
resume) always builds a fresh matcher and replays ``token_ids[num_prompt_tokens:]``, so the
matcher state is a function of the tokens held, whatever happened before.

Compilation: a constraint is compiled once per (kind, text, EOS ids) into a template matcher
(cached, least recently used dropped) and each request gets a deep copy (microseconds). The
compile and the replay run on a worker thread, started when the plan is applied: they overlap
the forward pass and are joined only when the row's mask is needed.

A matcher in an error state (a grammar that compiled in the scheduler but not against this
tokenizer, a resource limit hit mid-output) is logged and allowed only the EOS ids, so its
sequence ends and no other request notices.

Invariant: ``_by_row[row]`` holds an entry for the request that held ``row`` when it was added;
an entry whose request no longer holds the row (``req_ids[row]`` differs) is stale and ignored,
and is dropped when the row is next added.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import structlog
import torch

from protos.sampling_spec import StructuredSpec
from protos.structured_grammar import llguidance_grammar

log = structlog.get_logger(__name__)

CACHE_SIZE = 128  # compiled template matchers kept


@dataclass
class _Entry:
    req_id: str
    matcher: Future  # Future[llguidance.LLMatcher]
    eos_token_ids: tuple[int, ...]  # allowed alone when the matcher is in an error state


class GrammarCompiler:
    """The model's tokenizer for llguidance (one per EOS set) and a cache of compiled
    template matchers by (kind, text, EOS ids). Thread-safe enough for one worker thread: only
    that thread builds tokenizers and matchers."""

    def __init__(self, tokenizer_json: Path, vocab_size: int):
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._tokenizers: dict[tuple[int, ...], llguidance.LLTokenizer] = {}
        self._templates: OrderedDict[tuple[str, str, tuple[int, ...]], llguidance.LLMatcher] = (
            OrderedDict())
        self.num_compiled = 0  # cache misses, for tests

    def tokenizer(self, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
        tok = self._tokenizers.get(eos_token_ids)
        if tok is None:
            text = self.tokenizer_json.read_text(encoding="utf-8")
            tok = llguidance.LLTokenizer(text, n_vocab=self.vocab_size,
                                         eos_token=list(eos_token_ids) or None)
            self._tokenizers[eos_token_ids] = tok
        return tok

    def matcher(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        """A fresh matcher for `spec` at its start state (may be in an error state)."""
        key = (spec.kind, spec.text, spec.eos_token_ids)
        template = self._templates.get(key)
        if template is None:
            tok = self.tokenizer(spec.eos_token_ids)
            try:
                grammar = llguidance_grammar(spec.kind, spec.text)
            except Exception as e:  # the scheduler validated it; an error matcher says why
                template = _ErrorMatcher(f"{type(e).__name__}: {e}")
            else:
                template = llguidance.LLMatcher(tok, grammar, log_level=0)
            self.num_compiled += 1
            self._templates[key] = template
            if len(self._templates) > CACHE_SIZE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(key)
        return template.deep_copy()


class _ErrorMatcher:
    """Stands in for a matcher whose grammar could not even be built."""

    def __init__(self, error: str):
        self.error = error

    def deep_copy(self) -> _ErrorMatcher:
        return self

    def is_error(self) -> bool:
        return True

    def get_error(self) -> str:
        return self.error

    def consume_tokens(self, token_ids: list[int]) -> bool:
        return False


class StructuredRows:
    """The matchers of the persistent batch's constrained rows (see the module docstring)."""

    def __init__(self, tokenizer_json: Path | None, vocab_size: int):
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        self.compiler = GrammarCompiler(tokenizer_json, vocab_size) if tokenizer_json else None
        self._by_row: dict[int, _Entry] = {}
        self._rows = np.zeros(0, np.int64)  # sorted keys of _by_row, for np.isin
        # One thread: compiles are cached, so the common case is a deep copy and a replay.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="folio-grammar")
        self._llg_executor: llguidance.LLExecutor | None = None

    @property
    def active(self) -> bool:
        return bool(self._by_row)

    def add(self, row: int, req_id: str, spec: StructuredSpec | None,
            output_ids: list[int]) -> None:
        """Row `row` now holds `req_id` (a NewRequest): start building its matcher, advanced
        over `output_ids` (the tokens generated before a resume), or forget the row's old one."""
        if spec is None:
            if self._by_row.pop(row, None) is not None:
                self._rows = np.array(sorted(self._by_row), np.int64)
            return
        if self.compiler is None:
            raise ValueError("structured output needs the model's tokenizer.json, which this "
                             "executor's model directory lacks")
        compiler = self.compiler

        def build() -> llguidance.LLMatcher | _ErrorMatcher:
            try:
                matcher = compiler.matcher(spec)
            except Exception as e:  # e.g. a tokenizer.json llguidance cannot read: this
                # request ends (EOS only), the step and its other requests go on
                log.exception("structured output: cannot build a matcher", req_id=req_id)
                return _ErrorMatcher(f"{type(e).__name__}: {e}")
            if output_ids and not matcher.consume_tokens(output_ids):
                log.warning("structured output: generated tokens rejected on replay",
                            req_id=req_id, error=matcher.get_error())
            return matcher

        self._by_row[row] = _Entry(req_id, self._pool.submit(build), spec.eos_token_ids)
        self._rows = np.array(sorted(self._by_row), np.int64)

    def clear(self) -> None:
        self._by_row.clear()
        self._rows = np.zeros(0, np.int64)

    def bitmask(self, sample_rows: np.ndarray, req_ids: list[str | None]
                ) -> tuple[np.ndarray, np.ndarray]:
        """For the rows that sample (`sample_rows`, logits order): the indices of those with a
        live matcher, [g], and their bitmask [g, num_words] int32 (bit v set = token v allowed).
        Compiles are joined here. A matcher in an error state allows only its EOS ids."""
        idx = np.flatnonzero(np.isin(sample_rows, self._rows))
        keep, entries = [], []
        for i in idx.tolist():
            row = int(sample_rows[i])
            entry = self._by_row[row]
            if req_ids[row] == entry.req_id:  # else stale: the row was freed and reused
                keep.append(i)
                entries.append(entry)
        mask = np.zeros((len(entries), self.num_words), np.int32)
        matchers = [e.matcher.result() for e in entries]
        ok = [(m, i) for i, m in enumerate(matchers) if not m.is_error()]
        if ok:
            if self._llg_executor is None:
                self._llg_executor = llguidance.LLExecutor(num_threads=2)
            llg_numpy.fill_next_token_bitmask_par(self._llg_executor, ok, mask)
        for i, (m, entry) in enumerate(zip(matchers, entries, strict=True)):
            if m.is_error():
                log.warning("structured output: matcher in an error state; only EOS allowed",
                            req_id=entry.req_id, error=m.get_error()[:200])
                _allow(mask[i], entry.eos_token_ids)
        return np.array(keep, np.int64), mask

    def advance(self, rows: list[int], req_ids: list[str | None],
                token_ids: list[list[int]]) -> None:
        """Feed each constrained row the tokens appended to it this step."""
        for row, ids in zip(rows, token_ids, strict=True):
            entry = self._by_row.get(row)
            if entry is None or req_ids[row] != entry.req_id:
                continue
            matcher = entry.matcher.result()
            if not matcher.is_error() and not matcher.consume_tokens(ids):
                log.warning("structured output: a token the mask allowed was rejected",
                            req_id=entry.req_id, error=matcher.get_error()[:200])

    def constrained(self, rows: np.ndarray) -> np.ndarray:
        """The entries of `rows` that have a matcher (stale ones included: advance skips)."""
        return np.flatnonzero(np.isin(rows, self._rows))

    def matcher_of(self, row: int) -> llguidance.LLMatcher | None:
        """The row's matcher (for tests and introspection)."""
        entry = self._by_row.get(row)
        return None if entry is None else entry.matcher.result()


def _allow(mask_row: np.ndarray, token_ids: list[int]) -> None:
    words = mask_row.view(np.uint32)
    for t in token_ids:
        words[t // 32] |= np.uint32(1 << (t % 32))


def apply_bitmask(logits: torch.Tensor, idx: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [num_logits, vocab] float, idx [g] int64 (rows of logits), bitmask [g, words]
    int32 on logits' device: every token whose bit is clear gets -inf, in place, as one
    batched unpack + masked_fill over the g rows."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [g, words, 32]
    allowed = bits.flatten(1)[:, :vocab].bool()  # [g, vocab]
    rows = logits.index_select(0, idx)  # [g, vocab]
    rows.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, idx, rows)

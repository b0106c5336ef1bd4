"""Stop strings: matched on a sequence's detokenized text, across token boundaries.

Rule (what a check after every character would give): the sequence stops at the first point of
its text where the text ends with a stop string; if several end there, the longest wins. A stop
string only counts if it ends in the text of a token after the first `min_tokens` output tokens
(vLLM's rule; it may begin earlier). vLLM picks by list order when one step completes two stop
strings; Folio picks the one that ends first, which differs only in that case.

`StopChecker` is one sequence's state, fed the text deltas of its tokens in order:

    text received:  [ released to the stream ........ | held ]
                                                         the longest end of the text that is
                                                         a proper prefix of some stop string
                                                         (< the longest stop's length)

Invariants: a stop string never begins inside released text (a suffix that could begin one is
held), so a match is searched in `held + delta` only; released text is always a prefix of the
final text, so the stream never shows what a stop later cuts off. The checker lives in the
registry's SequenceOutput, so the held text survives the loss of an executor like the
detokenizer's offsets do.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence


def first_match(text: str, stop: Sequence[str], new_from: int) -> tuple[int, str] | None:
    """(start, stop string) of the earliest-ending stop string in `text` that ends after
    `new_from` (the length of text already checked); at equal ends, the longest."""
    best: tuple[int, int, str] | None = None  # (end, -len, stop)
    for s in stop:
        start = text.find(s, max(0, new_from - len(s) + 1))
        if start >= 0:
            key = (start + len(s), -len(s), s)
            if best is None or key < best:
                best = key
    return None if best is None else (best[0] + best[1], best[2])


def partial_suffix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of some stop string."""
    longest = 0
    for s in stop:
        # Candidate starts: where s's first character occurs within its reach of the end.
        i = text.find(s[0], max(0, len(text) - len(s) + 1))
        while 0 <= i and len(text) - i > longest:
            if s.startswith(text[i:]):
                longest = len(text) - i
                break
            i = text.find(s[0], i + 1)
    return longest


class StopChecker:
    """One sequence's stop-string state. `push` each token's text delta; once `matched` is set
    the sequence is over. Without stop strings it passes text through unchanged."""

    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 min_tokens: int = 0):
        self.stop = tuple(stop)
        self.include = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.held = ""  # received, not released: could still begin a stop string
        self.matched: str | None = None

    def push(self, delta: str, num_output_tokens: int) -> str:
        """The text of the sequence's token number `num_output_tokens` (1-based; may be ""
        while a character is incomplete). Returns the text to release now."""
        if not self.stop or self.matched is not None:
            return delta if self.matched is None else ""
        window = self.held + delta
        if delta and num_output_tokens > self.min_tokens:
            match = first_match(window, self.stop, len(self.held))
            if match is not None:
                start, self.matched = match
                self.held = ""
                return window[:start + len(self.matched) if self.include else start]
        keep = partial_suffix_len(window, self.stop)
        self.held = window[len(window) - keep:] if keep else ""
        return window[:len(window) - keep]

    def flush(self) -> str:
        """The sequence ended without a match: release what was held."""
        held, self.held = self.held, ""
        return held


class BeamStopStrings:
    """For beam search: which stop string, if any, a beam's text completes with its newest
    token (the same rule as StopChecker, on full decodes of the beam's output ids)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str],
                 min_tokens: int = 0):
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self._decode = functools.lru_cache(maxsize=256)(lambda ids: decode(list(ids)))

    def __call__(self, token_ids: Sequence[int]) -> str | None:
        if len(token_ids) <= self.min_tokens:
            return None
        before = self._decode(tuple(token_ids[:-1]))
        text = self._decode(tuple(token_ids))
        match = first_match(text, self.stop, len(os.path.commonprefix([before, text])))
        return None if match is None else match[1]

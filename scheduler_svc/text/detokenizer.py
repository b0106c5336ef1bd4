"""Incremental detokenization: text deltas per step that never split a UTF-8 character.

A byte-level token can end in the middle of a multi-byte character; decoding it alone yields
U+FFFD. Each step decodes a small window of recent ids twice (with and without the new ones)
and emits only the difference, holding it back while it ends in U+FFFD.

Invariant (per request):

    output ids:  [ ......... | prefix_offset ...... | read_offset ...... ]
                   emitted     decoded for context    not yet emitted
    "".join(all deltas) + flush() == decode(all output ids)

Decoding from `prefix_offset` rather than `read_offset` matters for tokenizers whose decoder
treats the first token specially (SentencePiece's leading "▁"): both decodes start on the same
token, so the difference is exact.
"""

from __future__ import annotations

from scheduler_svc.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Enough context that a window never starts inside a character still being assembled.
_INITIAL_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._spaces_between_special = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # everything emitted so far

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special,
                                      spaces_between_special_tokens=self._spaces_between_special)

    def push(self, new_ids: list[int]) -> str:
        """Add ids; return the text they complete (possibly empty)."""
        self.token_ids.extend(new_ids)
        prefix_text = self.decode(self.token_ids[self._prefix_offset:self._read_offset])
        full_text = self.decode(self.token_ids[self._prefix_offset:])
        if full_text.endswith(REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text):
            return ""  # an unfinished character (or nothing visible): wait for more ids
        if not full_text.startswith(prefix_text):
            # The window's decode changed its own past (rare normalisers); resync exactly.
            return self._resync()
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def _resync(self) -> str:
        full = self.decode(self.token_ids)
        if full.endswith(REPLACEMENT_CHAR) or not full.startswith(self.text):
            return ""
        delta = full[len(self.text):]
        self.text = full
        self._prefix_offset = max(0, len(self.token_ids) - _INITIAL_CONTEXT)
        self._read_offset = len(self.token_ids)
        return delta

    def flush(self) -> str:
        """At finish: whatever the full decode has beyond what was emitted (a dangling partial
        character included, as U+FFFD, since no more ids will complete it)."""
        full = self.decode(self.token_ids)
        if not full.startswith(self.text):
            return ""  # cannot retract emitted text; push() keeps this from happening
        delta = full[len(self.text):]
        self.text = full
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return delta

    def finish(self, undecoded_ids: list[int]) -> str:
        """`flush`, then record `undecoded_ids` as streamed without decoding them (a stop
        token whose text is left out). Nothing may be pushed afterwards."""
        delta = self.flush()
        self.token_ids.extend(undecoded_ids)
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return delta

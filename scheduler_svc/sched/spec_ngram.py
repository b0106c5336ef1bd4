"""N-gram (prompt lookup) proposals for speculative decoding: no model, only the request's own
tokens, which the scheduler holds.

The proposal for a sequence t[0..L) is found by matching its tail: for n from `max_n` down to
`min_n`, the last n tokens t[L-n..L) are searched for earlier in the sequence; at their most
recent earlier occurrence, starting at s < L - n, the tokens that followed it,
t[s+n .. s+n+k), are proposed. Where that runs past the sequence's end the sequence is taken
to repeat with period P = L - n - s (the match says t[s+n..] continues as t[L..] does), so the
proposal goes on cyclically: always k tokens. The longest matching n wins; no match proposes
nothing. Repetitive text (quoting a passage of the
prompt, code that repeats a name) is where the proposals are accepted.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence


def propose_ngram(tokens: Sequence[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to `k` proposed next tokens for `tokens` (see the module docstring)."""
    if k < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n, got k={k}, min_n={min_n}, "
                         f"max_n={max_n}")
    length = len(tokens)
    seq = list(tokens)
    # The search runs in C: tokens as 4-byte words (ids are < 2**31), bytes.rfind for the
    # tail, a hit counting only at a word boundary. Every decoding request runs it every step.
    words = array("i", seq).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = words[4 * (length - n):]
        # Most recent earlier start s (s + n <= length - 1: at least one token follows it).
        end = 4 * (length - 1)
        while (at := words.rfind(tail, 0, end)) >= 0 and at % 4:
            end = at + len(tail) - 1  # a match across words: search left of it
        if at < 0:
            continue
        s = at // 4
        out = seq[s + n:s + n + k]
        period = length - n - s
        while len(out) < k:  # past the end: the repeat the match implies
            out.append(out[len(out) - period])
        return out
    return []

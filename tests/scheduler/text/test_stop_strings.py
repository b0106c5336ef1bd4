"""The stop checker against a brute-force reference: the text checked after every character.

The reference knows nothing of hold-back or windows: it appends each token's text and looks
for the first character at which the text ends with a stop string (the longest if several),
counting only characters of tokens after the first `min_tokens`. The checker must give the
same text, stop string and stopping token, and the stream it releases must never show a
character that the final text does not have (no partial stop string that later matches).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.text.stop_strings import (
    BeamStopStrings,
    StopChecker,
    first_match,
    partial_suffix_len,
)


def reference(deltas: list[str], stop: list[str], include: bool, min_tokens: int = 0
              ) -> tuple[str, str | None, int]:
    """(final text, matched stop string, number of tokens consumed)."""
    text = ""
    for k, delta in enumerate(deltas, 1):
        before, text = len(text), text + delta
        if k <= min_tokens:
            continue
        for end in range(before + 1, len(text) + 1):
            hits = [s for s in stop if text[:end].endswith(s)]
            if hits:
                s = max(hits, key=len)
                return text[:end if include else end - len(s)], s, k
    return text, None, len(deltas)


def run(deltas: list[str], stop: list[str], include: bool, min_tokens: int = 0
        ) -> tuple[str, str | None, int, list[str]]:
    """The checker fed token by token, as the output processor does: (final text, match,
    tokens consumed, the released text after each token)."""
    checker = StopChecker(stop, include, min_tokens)
    released, text, k = [], "", 0
    longest = max(map(len, stop), default=1)
    for k, delta in enumerate(deltas, 1):
        text += checker.push(delta, k)
        released.append(text)
        if checker.matched is not None:
            return text, checker.matched, k, released
        assert len(checker.held) <= longest - 1
    text += checker.flush()
    return text, None, k, released


def check(deltas, stop, include, min_tokens=0):
    want = reference(deltas, stop, include, min_tokens)
    text, matched, k, released = run(deltas, stop, include, min_tokens)
    assert (text, matched, k) == want, (deltas, stop)
    for shown in released:  # nothing shown is ever taken back
        assert text.startswith(shown), (shown, text)
    return text, matched, k, released


def test_a_stop_across_token_boundaries_is_cut_and_never_shown():
    deltas = ["Hello", " wor", "ld! ", "STO", "P", " more"]
    text, matched, k, released = check(deltas, ["STOP"], include=False)
    assert (text, matched, k) == ("Hello world! ", "STOP", 5)
    assert released[3] == "Hello world! "  # "STO" held: it could still become STOP
    assert not any("S" in r for r in released)


def test_include_keeps_the_stop_string():
    text, matched, _, _ = check(["a", "b\n", "\nc"], ["\n\n"], include=True)
    assert (text, matched) == ("ab\n\n", "\n\n")


def test_a_prefix_that_does_not_complete_is_released():
    _, matched, _, released = check(["ST", "O", "RY", " time"], ["STOP"], include=False)
    assert matched is None
    assert released == ["", "", "STORY", "STORY time"]


def test_held_text_is_flushed_at_the_end():
    text, matched, _, released = check(["x", "ST"], ["STOP"], include=False)
    assert (text, matched, released[-1]) == ("xST", None, "x")


def test_the_first_stop_to_complete_wins_then_the_longest():
    # "bc" completes before "abcd" inside one token: the text is cut before "bc".
    assert check(["abcd"], ["abcd", "bc"], include=False)[:2] == ("a", "bc")
    # Two stops ending at the same character: the longer one.
    assert check(["xabc"], ["bc", "abc"], include=False)[:2] == ("x", "abc")
    # Overlapping occurrences: the earliest end, whatever the list order.
    assert check(["aXbY", "Zc"], ["YZc", "bY"], include=False)[:2] == ("aX", "bY")


def test_unicode_is_matched_by_characters():
    deltas = ["naïve ", "café ", "😀", "🎉 fin"]
    text, matched, k, _ = check(deltas, ["😀🎉"], include=False)
    assert (text, matched, k) == ("naïve café ", "😀🎉", 4)
    assert check(["e\u0301t", "é"], ["\u0301"], include=True)[:2] == ("e\u0301", "\u0301")


def test_min_tokens_ignores_stops_that_end_in_the_first_tokens():
    deltas = ["END", "xE", "ND", "END"]
    # Token 1 completes END: only counted from token 2 on (vLLM: after the first min_tokens).
    assert check(deltas, ["END"], include=False, min_tokens=1)[:3] == ("ENDx", "END", 3)
    # A stop that began before min_tokens was reached and ends after it still counts.
    assert check(deltas, ["END"], include=False, min_tokens=2)[:3] == ("ENDx", "END", 3)
    assert check(deltas, ["END"], include=False, min_tokens=3)[:3] == ("ENDxEND", "END", 4)


def test_no_stop_strings_pass_text_through():
    checker = StopChecker()
    assert [checker.push(d, i) for i, d in enumerate(["a", "", "b"], 1)] == ["a", "", "b"]
    assert checker.flush() == "" and checker.matched is None


def test_helpers():
    assert first_match("xxabc", ["abc", "c"], new_from=4) == (2, "abc")  # same end: longer
    assert first_match("xxabcd", ["abcd", "c"], new_from=4) == (4, "c")  # ends first
    assert first_match("abc", ["ab"], new_from=2) is None  # ended before the new text
    assert partial_suffix_len("hello wo", ["world", "o w"]) == 2
    assert partial_suffix_len("aaaa", ["aaab"]) == 3
    assert partial_suffix_len("abc", ["x"]) == 0


def test_beam_stop_strings_see_only_the_newest_token():
    pieces = {1: "he", 2: "llo", 3: " wor", 4: "ld"}
    stops = BeamStopStrings(lambda ids: "".join(pieces[i] for i in ids), ["lo w", "he"],
                            min_tokens=1)
    assert stops([1]) is None  # "he" ends in the first token: not counted (min_tokens=1)
    assert stops([1, 2]) is None
    assert stops([1, 2, 3]) == "lo w"
    assert stops([3, 1]) == "he"


# ---- the property: any text, any split into tokens, any stops ------------------------------

ALPHABET = "ab \n😀é"
texts = st.text(alphabet=ALPHABET, max_size=30)


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(deltas=st.lists(st.text(alphabet=ALPHABET, max_size=4), max_size=12),
       stop=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), max_size=4),
       include=st.booleans(), min_tokens=st.integers(0, 3))
def test_the_checker_equals_the_reference_and_never_leaks(deltas, stop, include, min_tokens):
    check(deltas, stop, include, min_tokens)


@pytest.mark.parametrize("include", [False, True])
def test_many_long_stops_stay_bounded(include):
    stop = ["ab" * 128, "b" * 200, "x"]
    deltas = ["ab"] * 300 + ["x"]
    text, matched, k, _ = check(deltas, stop, include)
    assert matched == "ab" * 128 and k == 128


def test_a_beam_candidate_completing_a_stop_string_finishes():
    from scheduler_svc.sched.beam_search import BeamSearch

    search = BeamSearch(2, 3, frozenset({9}), length_penalty=1.0,
                        text_stop=lambda ids: "END" if ids[-1] == 7 else None)
    pairs = [(7, -0.1), (8, -0.5), (9, -0.7), (10, -2.0)]
    running = search.step([pairs])
    # 7 finishes on its text; 9, a stop id outside the best two, neither finishes nor runs.
    assert [(h.token_ids, h.stopped, h.stop_str) for h in search.finished] == \
        [((7,), True, "END")]
    assert [r.token_id for r in running] == [8, 10]

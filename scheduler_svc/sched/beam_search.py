"""Beam-search bookkeeping, with the selection rules of HF transformers' `generate(num_beams=k,
do_sample=False)`, so Folio's beams are token-exact with it.

Pure Python and model-free: each step the caller gives every running beam's top logprobs (the
executor's `StepResult.logprobs`), and `BeamSearch.step` says which beams continue, with which
token, in which order. The caller maps beams to executor requests (continue, fork, drop).

One step, for `k = beam_width` running beams of equal length:

    candidates = top C of {(beam, token): beam.logprob_sum + logprob(token | beam)}
                 C = max(2, 1 + num_stop_ids) * k, so that even if every beam proposes every stop
                 id, at least k candidates can keep running
    finished  += the stop candidates (stop id, a stop string the beam's text completes, or
                 max_new_tokens reached) among the first k,
                 scored logprob_sum / num_generated ** length_penalty; the best k are kept
    running    = the first k candidates that did not stop
    done       when max_new_tokens is reached, or (early_stopping TRUE) k hypotheses are
                 finished, or no running beam can still beat the worst of k finished ones:
                 its best possible score uses its current length (HEURISTIC, TRUE), or
                 max_new_tokens when length_penalty > 0 (NEVER)

Scores are float32, rounded after every operation exactly as torch computes them, so candidate
order never differs from HF's through accumulated rounding. A fresh search has a single beam:
HF starts with k copies of the prompt, all but one scored -1e9, which selects the same
candidates as long as the vocabulary holds at least C tokens.

Every finite length_penalty is accepted, so the arithmetic follows IEEE float32 as torch does
instead of raising: num_tokens ** length_penalty is computed in float64 (as Python computes
HF's expression) and rounded to float32, so it overflows to inf (score -0.0) or underflows to 0
(score -inf; 0 / 0 is NaN). Orderings treat NaN as the largest score, as torch.topk does, and a
comparison with NaN is false, as in torch. (HF itself raises OverflowError where the float64
power overflows; below that, results are HF's.)
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field


def f32(x: float) -> float:
    """Round to the nearest float32. An fp32 op computed in float64 then rounded is exact.
    Beyond float32's range the rounding gives +-inf, as a C cast does (struct raises)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def f32_div(a: float, b: float) -> float:
    """a / b for float32 a and b, as torch divides float32 tensors (IEEE: x / 0 is +-inf,
    0 / 0 is NaN) instead of raising ZeroDivisionError."""
    if b == 0.0:
        if a == 0.0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
    return f32(a / b)


def length_penalized(logprob_sum: float, num_tokens: int, length_penalty: float) -> float:
    """HF's finished-beam score, logprob_sum / num_tokens ** length_penalty, in float32.

    HF computes the power as Python int ** float (float64) and torch rounds that scalar to
    float32 before dividing the float32 scores by it. The float64 power overflows only to
    values far beyond float32's range, so inf is what torch would see."""
    try:
        denominator = f32(num_tokens ** length_penalty)
    except OverflowError:
        denominator = math.inf
    return f32_div(logprob_sum, denominator)


def score_order(score: float) -> tuple[int, float]:
    """Sort key, best first: NaN ranks above every number (as in torch.topk), then descending."""
    return (0, 0.0) if math.isnan(score) else (1, -score)


# A beam's output ids (newest last) -> the stop string its text completes with the newest.
TextStop = Callable[[list[int]], "str | None"]


class EarlyStopping(enum.Enum):
    HEURISTIC = "heuristic"  # HF early_stopping=False
    TRUE = "true"  # HF early_stopping=True
    NEVER = "never"  # HF early_stopping="never"


@dataclass
class Beam:
    """A running beam: its generated tokens (prompt excluded) and their summed logprob."""

    token_ids: list[int] = field(default_factory=list)
    logprob_sum: float = 0.0


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: generated tokens (ending in the stop id if one ended it) and score."""

    token_ids: tuple[int, ...]
    score: float  # logprob_sum / len(token_ids) ** length_penalty, float32
    stopped: bool  # True: ended by a stop id or stop string; False: by max_new_tokens
    stop_str: str | None = None  # the stop string its text completed, if that ended it


@dataclass(frozen=True)
class NextBeam:
    """Running beam `i` after a step continues beam `parent` (an index before the step)."""

    parent: int
    token_id: int


@dataclass(frozen=True)
class _Candidate:
    score: float  # accumulated logprob, float32
    parent: int
    token_id: int


class BeamSearch:
    """One request's beam search.

    Invariants: all running beams have the same length and are sorted by logprob_sum, best
    first; `finished` holds at most beam_width hypotheses, best first; after `done` no beam runs.
    """

    def __init__(self, beam_width: int, max_new_tokens: int, stop_token_ids: frozenset[int],
                 length_penalty: float = 1.0,
                 early_stopping: EarlyStopping = EarlyStopping.HEURISTIC,
                 text_stop: TextStop | None = None):
        if beam_width < 1 or max_new_tokens < 1:
            raise ValueError(f"need beam_width >= 1 and max_new_tokens >= 1, got "
                             f"{beam_width} and {max_new_tokens}")
        self.beam_width = beam_width
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = stop_token_ids
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.text_stop = text_stop
        self.beams: list[Beam] = [Beam()]
        self.finished: list[Hypothesis] = []
        self.done = False

    @property
    def num_candidates(self) -> int:
        """How many top logprobs each beam must provide: the candidates kept per step."""
        return max(2, 1 + len(self.stop_token_ids)) * self.beam_width

    def step(self, top_logprobs: list[list[tuple[int, float]]]) -> list[NextBeam]:
        """Advance by one token. `top_logprobs[i]` holds running beam i's best (token id,
        logprob) pairs, at least `num_candidates` of them (fewer only if the vocabulary is
        smaller). Returns the new running beams, best first; empty when the search is done."""
        assert not self.done and len(top_logprobs) == len(self.beams)
        candidates = self._top_candidates(top_logprobs)
        num_generated = len(self.beams[0].token_ids) + 1  # every beam, after this token
        at_limit = num_generated >= self.max_new_tokens
        stop_strs = self._stop_strings(candidates)
        stops = [at_limit or c.token_id in self.stop_token_ids or i in stop_strs
                 for i, c in enumerate(candidates)]
        self._add_finished(candidates[:self.beam_width], stops[:self.beam_width],
                           num_generated, stop_strs)
        running = [c for c, stop in zip(candidates, stops, strict=True)
                   if not stop][:self.beam_width]
        self.beams = [Beam(self.beams[c.parent].token_ids + [c.token_id], c.score)
                      for c in running]
        self.done = all(stops) or not self.beams or self._cannot_improve() or (
            self.early_stopping is EarlyStopping.TRUE
            and len(self.finished) == self.beam_width)
        if self.done:
            self.beams = []
            return []
        return [NextBeam(c.parent, c.token_id) for c in running]

    def best(self, n: int) -> list[Hypothesis]:
        """The n best finished hypotheses, best first (call once `done`)."""
        return self.finished[:n]

    # ---- helpers ---------------------------------------------------------------------------

    def _top_candidates(self, top_logprobs: list[list[tuple[int, float]]]) -> list[_Candidate]:
        candidates = [_Candidate(f32(f32(logprob) + beam.logprob_sum), parent, token_id)
                      for parent, (beam, pairs) in enumerate(zip(self.beams, top_logprobs,
                                                                 strict=True))
                      for token_id, logprob in pairs]
        # Ties (bit-equal float32 scores) go to the lower (beam, token) index.
        candidates.sort(key=lambda c: (score_order(c.score), c.parent, c.token_id))
        return candidates[:self.num_candidates]

    def _penalized(self, logprob_sum: float, num_tokens: int) -> float:
        return length_penalized(logprob_sum, num_tokens, self.length_penalty)

    def _stop_strings(self, candidates: list[_Candidate]) -> dict[int, str]:
        """{candidate index: the stop string its beam's text completes}, for the candidates
        that can finish (the first beam_width) or run (until beam_width others do not stop);
        a candidate with a stop id is a token stop."""
        if self.text_stop is None:
            return {}
        found: dict[int, str] = {}
        num_running = 0
        for i, c in enumerate(candidates):
            if i >= self.beam_width and num_running >= self.beam_width:
                break
            if c.token_id in self.stop_token_ids:
                continue
            stop = self.text_stop(self.beams[c.parent].token_ids + [c.token_id])
            if stop is not None:
                found[i] = stop
            else:
                num_running += 1
        return found

    def _add_finished(self, top: list[_Candidate], stops: list[bool], num_generated: int,
                      stop_strs: dict[int, str]) -> None:
        # Only candidates among the best beam_width may finish; the rest only back up the
        # running set. Earlier hypotheses win ties, as in a stable top-k.
        new = [Hypothesis(tuple(self.beams[c.parent].token_ids + [c.token_id]),
                          self._penalized(c.score, num_generated),
                          stopped=c.token_id in self.stop_token_ids or i in stop_strs,
                          stop_str=stop_strs.get(i))
               for i, (c, stop) in enumerate(zip(top, stops, strict=True)) if stop]
        if not new:
            return
        merged = self.finished + new
        order = sorted(range(len(merged)), key=lambda i: (score_order(merged[i].score), i))
        self.finished = [merged[i] for i in order[:self.beam_width]]

    def _cannot_improve(self) -> bool:
        """True when the best running beam cannot beat the worst of beam_width finished."""
        if len(self.finished) < self.beam_width:
            return False
        if self.early_stopping is EarlyStopping.NEVER and self.length_penalty > 0:
            best_length = self.max_new_tokens
        else:
            best_length = len(self.beams[0].token_ids)
        best_possible = self._penalized(self.beams[0].logprob_sum, best_length)
        scores = [h.score for h in self.finished]
        # torch.min propagates NaN, and any comparison with NaN is false.
        worst = math.nan if any(math.isnan(x) for x in scores) else min(scores)
        return not best_possible > worst

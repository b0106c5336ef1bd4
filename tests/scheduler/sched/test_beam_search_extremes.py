"""Beam scores for extreme length penalties follow IEEE float32 as torch computes them.

HF computes a finished beam's score as `scores / (num_tokens ** length_penalty)`: a Python
float64 power, rounded to float32 by torch when it divides the float32 scores. The oracle here
is that expression with numpy's float64 power (inf on overflow, where Python raises) and a real
torch float32 division; our pure-Python scores must be bit-equal to it, signed zeros and NaN
included, and a whole search must run to its end without raising.
"""

from __future__ import annotations

import math
import random
import struct

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from scheduler_svc.sched.beam_search import BeamSearch, EarlyStopping, f32, length_penalized  # noqa: E402

FLT_MAX = 3.4028234663852886e38
PENALTIES = [1e4, -130.0, 1e30, 3.4e38, -3.4e38, FLT_MAX, -FLT_MAX, 1e-45, -1e-45, 0.0, -0.0,
             88.7, -88.7, 127.9, -149.5, 1.0, -1.0, 2.5]
# Scores are float32 values: the inputs are rounded to float32 first.
LOGPROB_SUMS = [float(np.float32(x)) for x in (0.0, -0.0, -1e-45, -1.17549435e-38, -0.693,
                                                -30.25, -1e30, -FLT_MAX, -math.inf)]
NUM_TOKENS = [1, 2, 3, 12, 255, 4096]


def torch_score(logprob_sum: float, num_tokens: int, length_penalty: float) -> float:
    with np.errstate(all="ignore"):
        denominator = float(np.power(np.float64(num_tokens), np.float64(length_penalty)))
    scores = torch.tensor([logprob_sum], dtype=torch.float32)
    return (scores / denominator).item()


def bits(x: float) -> bytes:
    """float32 bit pattern, NaNs folded to one (torch and Python may differ in NaN payload)."""
    return b"nan" if math.isnan(x) else struct.pack("<f", x)


@pytest.mark.parametrize("length_penalty", PENALTIES, ids=repr)
def test_scores_are_bit_equal_to_torch_float32(length_penalty):
    for num_tokens in NUM_TOKENS:
        for logprob_sum in LOGPROB_SUMS:
            got = length_penalized(logprob_sum, num_tokens, length_penalty)
            expected = torch_score(logprob_sum, num_tokens, length_penalty)
            assert bits(got) == bits(expected), (logprob_sum, num_tokens, length_penalty,
                                                 got, expected)


def test_overflow_and_underflow_give_the_ieee_results():
    assert bits(length_penalized(-3.5, 2, 1e4)) == bits(-0.0)  # 2 ** 1e4 overflows to inf
    assert length_penalized(-3.5, 2, -1e4) == -math.inf  # 2 ** -1e4 underflows to 0
    assert math.isnan(length_penalized(0.0, 2, -1e4))  # 0 / 0
    assert math.isnan(length_penalized(-math.inf, 2, 1e4))  # inf / inf
    assert length_penalized(-3.5, 1, 3.4e38) == -3.5  # 1 ** anything is 1


def fake_logprobs(prefix: tuple[int, ...], vocab: int) -> list[float]:
    """A deterministic stand-in for a model: log_softmax of logits seeded by the prefix."""
    gen = torch.Generator().manual_seed(hash(prefix) & 0xFFFF_FFFF)
    logits = torch.randn(vocab, generator=gen) * 4
    return torch.log_softmax(logits, dim=-1).tolist()


def torch_path_score(tokens: tuple[int, ...], vocab: int, length_penalty: float) -> float:
    """HF's accumulation: a float32 running score plus each step's float32 logprob."""
    total = torch.zeros(1, dtype=torch.float32)
    for i, token in enumerate(tokens):
        total = total + torch.tensor([fake_logprobs(tokens[:i], vocab)[token]],
                                     dtype=torch.float32)
    return torch_score(total.item(), len(tokens), length_penalty)


@pytest.mark.parametrize("early_stopping", list(EarlyStopping), ids=lambda e: e.value)
@pytest.mark.parametrize("length_penalty", [1e4, -130.0, 1e30, 3.4e38, -3.4e38, -1e4],
                         ids=repr)
def test_a_search_with_an_extreme_penalty_runs_to_its_end(length_penalty, early_stopping):
    vocab, width, max_new_tokens = 40, 3, 8
    stop_ids = frozenset({3, 7})
    search = BeamSearch(width, max_new_tokens, stop_ids, length_penalty, early_stopping)
    num_steps = 0
    while not search.done:
        top = []
        for beam in search.beams:
            logprobs = fake_logprobs(tuple(beam.token_ids), vocab)
            order = sorted(range(vocab), key=lambda t: (-logprobs[t], t))
            top.append([(t, logprobs[t]) for t in order[:search.num_candidates]])
        search.step(top)
        num_steps += 1
        assert num_steps <= max_new_tokens
    best = search.best(width)
    assert best, "a finished search returns hypotheses"
    for h in best:
        assert bits(h.score) == bits(torch_path_score(h.token_ids, vocab, length_penalty))
        assert h.stopped == (h.token_ids[-1] in stop_ids)
        assert h.stopped or len(h.token_ids) == max_new_tokens


def test_f32_rounds_past_the_float32_range_to_infinity():
    rng = random.Random(0)
    for x in [FLT_MAX, -FLT_MAX, 3.4028235e38, 3.40282357e38, 1e39, -1e300, math.inf,
              *(rng.uniform(-4e38, 4e38) for _ in range(200))]:
        expected = torch.tensor([x], dtype=torch.float64).to(torch.float32).item()
        assert bits(f32(x)) == bits(expected), x

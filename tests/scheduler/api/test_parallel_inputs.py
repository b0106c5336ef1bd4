"""Validation of n and beam-search parameters, and the seeds of parallel sequences."""

from __future__ import annotations

import math

import pytest

from protos.folio.v1 import generator_pb2 as pb
from scheduler_svc.api.inputs import sequence_params
from scheduler_svc.errors import InvalidRequest
from scheduler_svc.sched.beam_search import EarlyStopping
from scheduler_svc.sched.sequence_params import MAX_BEAM_WIDTH, MAX_N, SequenceParams, sequence_seed


def test_defaults_are_one_plain_sequence():
    params = sequence_params(pb.SamplingParams())
    assert params == SequenceParams() and params.is_single and not params.is_beam_search


def test_beam_search_fields_are_carried():
    params = sequence_params(pb.SamplingParams(
        n=2, beam_width=4, length_penalty=0.5, early_stopping=pb.EARLY_STOPPING_NEVER))
    assert params == SequenceParams(n=2, beam_width=4, length_penalty=0.5,
                                    early_stopping=EarlyStopping.NEVER)
    assert params.is_beam_search and not params.is_single


def test_greedy_n_is_allowed():
    assert sequence_params(pb.SamplingParams(n=3, temperature=0.0)).n == 3


@pytest.mark.parametrize("fields, message", [
    (dict(n=0), "n must be between 1 and"),
    (dict(n=MAX_N + 1), "n must be between 1 and"),
    (dict(beam_width=0), "beam_width must be between 1"),
    (dict(beam_width=MAX_BEAM_WIDTH + 1), "beam_width must be between 1"),
    (dict(beam_width=2, n=3), "n = 3 > beam_width = 2"),
    (dict(beam_width=2, length_penalty=math.inf), "length_penalty must be a finite number"),
    (dict(beam_width=2, length_penalty=math.nan), "length_penalty must be a finite number"),
    (dict(early_stopping=7), "unknown early_stopping value 7"),
])
def test_bad_values_say_what_to_change(fields, message):
    with pytest.raises(InvalidRequest, match=message):
        sequence_params(pb.SamplingParams(**fields))


def test_sequence_seeds_are_stable_distinct_and_keep_sequence_0():
    seeds = [sequence_seed(42, i) for i in range(64)]
    assert seeds[0] == 42
    assert len(set(seeds)) == 64 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [sequence_seed(42, i) for i in range(64)]
    assert sequence_seed(43, 1) != sequence_seed(42, 1)
    assert sequence_seed(None, 3) is None

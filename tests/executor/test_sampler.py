"""The batched sampler: greedy is argmax, filters hold, seeds reproduce regardless of batch."""

from __future__ import annotations

import torch

from executor_svc.sampler import SamplingBatch, sample
from protos.plan import SamplingSpec

CPU = torch.device("cpu")


def _sample(logits, specs, token_indices=None):
    token_indices = token_indices or [10] * len(specs)
    return sample(logits, SamplingBatch.from_specs(specs, token_indices, CPU))


def test_greedy_rows_are_exact_argmax_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 500)
    specs = [SamplingSpec(temperature=0.0), SamplingSpec(temperature=1.0, seed=3),
             SamplingSpec(temperature=0.0, top_k=5), SamplingSpec(temperature=0.7, top_p=0.5),
             SamplingSpec(temperature=0.0, top_p=0.1), SamplingSpec(temperature=2.0)]
    ids = _sample(logits, specs)
    expected = logits.argmax(-1)
    for row in (0, 2, 4):
        assert ids[row] == expected[row]
    assert torch.equal(_sample(logits, [SamplingSpec(temperature=0.0)] * 6), expected)


def test_top_k_one_equals_greedy():
    torch.manual_seed(1)
    logits = torch.randn(8, 300)
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1  # a tie: both must pick the first index
    specs = [SamplingSpec(temperature=1.5, top_k=1, seed=s) for s in range(4)]
    specs += [SamplingSpec(temperature=0.9, top_k=1) for _ in range(4)]
    assert torch.equal(_sample(logits, specs), logits.argmax(-1))


def test_seeded_draws_reproduce_and_ignore_batch_composition():
    torch.manual_seed(2)
    logits = torch.randn(5, 1000)
    spec = SamplingSpec(temperature=1.0, top_p=0.95, seed=1234)
    alone = _sample(logits[2:3], [spec], [17])
    # The same request in a different batch position, among other seeded and unseeded rows.
    others = [SamplingSpec(temperature=1.0), SamplingSpec(temperature=0.5, seed=9),
              SamplingSpec(temperature=0.0), SamplingSpec(temperature=1.0, top_k=3)]
    batch_specs = others[:2] + [spec] + others[2:]
    in_batch = _sample(logits, batch_specs, [3, 4, 17, 5, 6])
    assert in_batch[2] == alone[0]
    assert torch.equal(_sample(logits[2:3], [spec], [17]), alone)
    # Different token indices give different draws (the seed is not a constant stream).
    draws = {int(_sample(logits[2:3], [spec], [i])[0]) for i in range(30)}
    assert len(draws) > 5


def test_an_unfiltered_seeded_row_draws_the_same_next_to_a_filtered_one():
    # A row without top-k/top-p is sampled on the sorted path when another row needs it; its
    # draw must not change with that (a resumed or preempted stream meets other batches).
    torch.manual_seed(3)
    logits = torch.randn(2, 2000)
    spec = SamplingSpec(temperature=1.0, seed=77)
    for index in range(40):
        alone = _sample(logits[:1], [spec], [index])
        beside_top_p = _sample(logits, [spec, SamplingSpec(temperature=1.0, top_p=0.9)],
                               [index, 5])
        beside_top_k = _sample(logits.flip(0), [SamplingSpec(temperature=0.8, top_k=4), spec],
                               [5, index])
        assert alone[0] == beside_top_p[0] == beside_top_k[1], index


def test_unseeded_draws_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(6000, 1)
    ids = _sample(logits, [SamplingSpec(temperature=1.0)] * 6000)
    freqs = torch.bincount(ids, minlength=3).float() / 6000
    torch.testing.assert_close(freqs, torch.tensor([0.5, 0.3, 0.2]), atol=0.03, rtol=0)


def test_top_p_restricts_to_the_nucleus():
    probs = torch.tensor([0.05, 0.4, 0.02, 0.3, 0.13, 0.1])
    logits = probs.log().repeat(3000, 1)
    # Sorted: 0.4, 0.3, 0.13, 0.1, ... ; mass above 0.13 is 0.7 < 0.8, above 0.1 is 0.83.
    ids = _sample(logits, [SamplingSpec(temperature=1.0, top_p=0.8)] * 3000)
    assert set(ids.tolist()) == {1, 3, 4}
    freqs = torch.bincount(ids, minlength=6).float() / 3000
    expected = torch.zeros(6)
    expected[[1, 3, 4]] = probs[[1, 3, 4]] / probs[[1, 3, 4]].sum()
    torch.testing.assert_close(freqs, expected, atol=0.04, rtol=0)


def test_top_k_then_top_p_and_temperature():
    probs = torch.tensor([0.1, 0.35, 0.25, 0.2, 0.1])
    logits = probs.log().repeat(2000, 1)
    ids = _sample(logits, [SamplingSpec(temperature=1.0, top_k=3)] * 2000)
    assert set(ids.tolist()) == {1, 2, 3}
    # top-k 3 renormalises to 0.35/0.8, 0.25/0.8, 0.2/0.8; top-p 0.5 keeps the first two.
    ids = _sample(logits, [SamplingSpec(temperature=1.0, top_k=3, top_p=0.5)] * 2000)
    assert set(ids.tolist()) == {1, 2}
    # A very low temperature concentrates on the argmax.
    ids = _sample(logits[:200], [SamplingSpec(temperature=0.01)] * 200)
    assert set(ids.tolist()) == {1}

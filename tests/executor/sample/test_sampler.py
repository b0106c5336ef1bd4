"""The batched sampler: greedy is argmax, filters hold, seeds reproduce regardless of batch, and
the seeded random stream is the integer hash it is defined as, with the right distribution."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.sample.sampler import (
    SamplingBatch,
    sample,
    sample_with_distribution,
    seed_bits,
    seeded_bits,
    seeded_exponentials,
)
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


# ---- the seeded random stream ----------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & _M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def _reference_bits(seed: int, index: int, v: int) -> int:
    """The stream the sampler's docstring defines, in Python's unbounded ints."""
    lo, hi = seed & _M32, (seed >> 32) & _M32
    k1 = _mix32(_mix32(_mix32(lo ^ 0x243F6A88) ^ hi) ^ index)
    k2 = _mix32(_mix32(_mix32(hi ^ 0x85A308D3) ^ lo) ^ index)
    return _mix32(_mix32((k1 + v * 0x9E3779B9) & _M32) ^ k2)


def test_seeded_bits_equal_the_integer_definition():
    # Seeds with the top bit set, beyond 64 bits, negative: int64 tensors must not overflow
    # or sign-extend anywhere.
    seeds = [0, 1, 2**31, 2**32 + 5, 2**63 - 1, 2**64 + 9, -1, -(2**40)]
    indices = [0, 1, 7, 2**20, 3, 2**31 - 1, 12, 99]
    bits = seeded_bits(torch.tensor([seed_bits(s) for s in seeds]), torch.tensor(indices), 5000)
    assert bits.dtype == torch.int64 and int(bits.min()) >= 0 and int(bits.max()) <= _M32
    for row, (seed, index) in enumerate(zip(seeds, indices, strict=True)):
        for v in (0, 1, 2, 1234, 4999):
            assert int(bits[row, v]) == _reference_bits(seed & (2**64 - 1), index, v)


def test_seeded_bits_are_uniform_and_streams_differ():
    seeds = torch.tensor([seed_bits(s) for s in (0, 1, 2**32, 2**63 - 1)])
    bits = seeded_bits(seeds.repeat_interleave(64), torch.arange(256) % 64, 4096)  # [256, 4096]
    counts = torch.bincount((bits >> 24).flatten(), minlength=256).double()  # top byte
    expected = bits.numel() / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 340, chi2  # 255 degrees of freedom; p ~ 3e-4
    # Every (seed, index) gets its own row: no two rows share even their first entries.
    assert len({tuple(row[:4].tolist()) for row in bits}) == 256
    # Adjacent vocab entries and adjacent token indices are uncorrelated.
    u = bits.double() / 2**32
    assert abs(float(torch.corrcoef(torch.stack([u[:, :-1].flatten(),
                                                   u[:, 1:].flatten()]))[0, 1])) < 0.01
    assert abs(float(torch.corrcoef(torch.stack([u[:-1].flatten(),
                                                   u[1:].flatten()]))[0, 1])) < 0.01


def test_seeded_noise_is_exponential():
    noise = seeded_exponentials(torch.full((400,), seed_bits(5)), torch.arange(400), 5000)
    assert noise.dtype == torch.float32 and bool((noise > 0).all())
    assert abs(float(noise.double().mean()) - 1.0) < 0.005  # sd of the mean: 0.0007
    assert abs(float(noise.double().var()) - 1.0) < 0.02
    # P(E > t) = exp(-t), checked in the tail too.
    for t in (0.01, 1.0, 5.0):
        assert abs(float((noise > t).double().mean()) - math.exp(-t)) < 0.004, t


def _chi_square(ids: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(ids, minlength=len(probs)).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the support was drawn"
    expected = probs[keep].double() * len(ids)
    return float(((counts[keep] - expected) ** 2 / expected).sum())


def test_seeded_draws_follow_the_distribution_exactly():
    # One seed, 20000 consecutive token indices: the race over the hash's noise must draw each
    # token with its probability (chi-square, 7 degrees of freedom: 24.3 is p = 0.001).
    probs = torch.tensor([0.3, 0.25, 0.15, 0.1, 0.08, 0.07, 0.04, 0.01])
    n = 20000
    logits = probs.log().repeat(n, 1)
    ids = _sample(logits, [SamplingSpec(temperature=1.0, seed=42)] * n, list(range(n)))
    assert _chi_square(ids, probs) < 24.3
    # Through the filtered (sorted) path: top-k 5 then top-p 0.7 keeps the first three.
    ids = _sample(logits, [SamplingSpec(temperature=1.0, top_k=5, top_p=0.7, seed=43)] * n,
                  list(range(n)))
    kept = torch.where(torch.arange(8) < 3, probs, 0.0)
    assert _chi_square(ids, kept / kept.sum()) < 13.8  # 2 degrees of freedom, p = 0.001
    # Different seeds at the same token index are draws from the same distribution too.
    specs = [SamplingSpec(temperature=0.5, seed=s) for s in range(n)]
    tempered = probs ** 2 / (probs ** 2).sum()
    assert _chi_square(_sample(logits, specs, [100] * n), tempered) < 24.3


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_a_seeded_row_draws_the_same_in_any_batch(data):
    vocab = data.draw(st.sampled_from([7, 300, 4099]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    mine = torch.randn(1, vocab, generator=gen) * 3
    spec = SamplingSpec(temperature=data.draw(st.sampled_from([0.3, 1.0, 1.7])),
                        top_k=data.draw(st.sampled_from([0, 1, 5])),
                        top_p=data.draw(st.sampled_from([1.0, 0.9, 0.5])),
                        seed=data.draw(st.integers(0, 2**63 - 1)))
    index = data.draw(st.integers(0, 10**6))
    alone = _sample(mine, [spec], [index])
    neighbours = data.draw(st.lists(st.builds(
        SamplingSpec, temperature=st.sampled_from([0.0, 0.7, 1.0]),
        top_k=st.sampled_from([0, 3]), top_p=st.sampled_from([1.0, 0.8]),
        seed=st.one_of(st.none(), st.integers(0, 2**63 - 1))), max_size=6))
    at = data.draw(st.integers(0, len(neighbours)))
    specs = neighbours[:at] + [spec] + neighbours[at:]
    logits = torch.randn(len(specs), vocab, generator=gen)
    logits[at] = mine[0]
    indices = [data.draw(st.integers(0, 10**6)) for _ in specs]
    indices[at] = index
    assert _sample(logits, specs, indices)[at] == alone[0]


def test_sampling_creates_no_generator(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the sampler must not build a torch.Generator")

    monkeypatch.setattr(torch, "Generator", refuse)
    logits = torch.randn(4, 100)
    specs = [SamplingSpec(seed=1), SamplingSpec(seed=2, top_k=5), SamplingSpec(),
             SamplingSpec(temperature=0.0)]
    assert _sample(logits, specs).shape == (4,)


def _drawn_from(row: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """What one row is drawn from, by the definition: logits / temperature, then the top_k
    largest (ties to the lower id), then, when top_p < 1, the smallest prefix, best first,
    whose mass before each kept token is below top_p; everything else -inf. Greedy rows: the
    logits. (top_p = 1 is off: summing rounded probabilities can reach 1 before the tail.)"""
    if spec.temperature == 0:
        return row
    scaled = row / spec.temperature
    order = sorted(range(len(row)), key=lambda v: (-float(scaled[v]), v))
    if spec.top_k:
        order = order[:spec.top_k]
    probs = torch.softmax(scaled[order], dim=0).tolist()
    kept, mass = [], 0.0
    for v, p in zip(order, probs, strict=True):
        if kept and spec.top_p < 1.0 and mass >= spec.top_p:
            break
        kept.append(v)
        mass += p
    out = torch.full_like(row, float("-inf"))
    out[kept] = scaled[kept]
    return out


def test_top_k_without_top_p_keeps_every_token_top_k_keeps():
    # The top token's fp32 probability rounds to 1, so the mass above the next ones does too:
    # only a nucleus (top_p < 1) may cut there.
    logits = torch.tensor([[20.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0]] * 2)
    specs = [SamplingSpec(temperature=1.0, top_k=4, seed=1),
             SamplingSpec(temperature=1.0, top_k=4, top_p=0.5, seed=1)]
    assert logits[0].softmax(-1)[0] == 1.0
    _, drawn = sample_with_distribution(logits, SamplingBatch.from_specs(specs, [0, 0], CPU))
    assert torch.equal(drawn[0, :4], logits[0, :4]) and drawn[0, 4:].isinf().all()
    assert torch.equal(drawn[1, :1], logits[1, :1]) and drawn[1, 1:].isinf().all()


def test_the_distribution_drawn_from_is_the_filtered_scaled_row():
    """PROCESSED logprobs' source: greedy rows keep their logits, the others are divided by
    their temperature and lose what top-k and top-p remove; the draws are `sample`'s."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=gen) * 3
    specs = [SamplingSpec(temperature=0.0), SamplingSpec(temperature=0.7, seed=1),
             SamplingSpec(temperature=1.3, top_k=6, seed=2),
             SamplingSpec(temperature=0.9, top_p=0.6, seed=3),
             SamplingSpec(temperature=1.0, top_k=10, top_p=0.8, seed=4)]
    batch = SamplingBatch.from_specs(specs, [7] * len(specs), CPU)
    ids, drawn = sample_with_distribution(logits, batch)
    assert torch.equal(ids, sample(logits, batch))
    for i, spec in enumerate(specs):
        expected = _drawn_from(logits[i], spec)
        assert torch.equal(drawn[i].isinf(), expected.isinf()), f"row {i} kept other tokens"
        kept = ~expected.isinf()
        torch.testing.assert_close(drawn[i][kept], expected[kept])
        assert not drawn[i][ids[i]].isinf(), "the drawn token was removed"
    all_greedy = SamplingBatch.from_specs([SamplingSpec(temperature=0.0)] * 2, [1, 1], CPU)
    ids, drawn = sample_with_distribution(logits[:2], all_greedy)
    assert torch.equal(drawn, logits[:2]) and torch.equal(ids, logits[:2].argmax(-1))

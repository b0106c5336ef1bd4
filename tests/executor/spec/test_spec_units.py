"""Speculative decoding's pure parts: n-gram proposals (scheduler) and the verification of
proposals (executor): greedy verification against plain greedy decoding of a deterministic
target; sampled verification (rejection sampling for deterministic proposals) through
SpecVerifier.verify against the target's distribution with chi-square tests, and seeded draws
against plain decoding's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.sample.sampler import SamplingBatch, sample
from executor_svc.sample.structured import StructuredRows
from executor_svc.spec.spec_decode import verify as verify_tokens
from executor_svc.spec.verifier import SpecVerifier, emitted_tokens
from executor_svc.step.input_batch import InputBatch
from executor_svc.step.inputs import SpecPositions
from protos.plan import SamplingSpec
from scheduler_svc.sched.spec_ngram import propose_ngram

# Chi-square critical values at significance 1e-3 (df -> value).
CHI2_CRIT = {2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 15: 37.70}  # p = 0.001


def test_ngram_proposals():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3], k=3) == [9, 1, 2]
    # The longest tail that matched wins over a shorter, more recent one.
    assert propose_ngram([5, 6, 7, 1, 4, 7, 2, 6, 7], k=2, max_n=2) == [1, 4]
    # The most recent earlier occurrence of the tail.
    assert propose_ngram([3, 1, 3, 2, 3], k=1, max_n=1) == [2]
    # Past the end, the period the match implies: [1, 2] repeating, [4] repeating.
    assert propose_ngram([1, 2, 1], k=5) == [2, 1, 2, 1, 2]
    assert propose_ngram([1, 2, 3], k=2) == [] and propose_ngram([], k=2) == []
    assert propose_ngram([4, 4, 4], k=2) == [4, 4]
    assert propose_ngram([7, 8, 9, 7, 8, 9, 7], k=4) == [8, 9, 7, 8]
    with pytest.raises(ValueError, match="k >= 1"):
        propose_ngram([1], k=0)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=40), k=st.integers(1, 5),
       min_n=st.integers(1, 3), extra=st.integers(0, 2))
def test_ngram_proposal_follows_an_earlier_occurrence_of_the_tail(tokens, k, min_n, extra):
    max_n = min_n + extra
    got = propose_ngram(tokens, k, min_n, max_n)
    assert len(got) in (0, k)
    if not got:  # then no tail of an allowed length occurs earlier with a token after it
        for n in range(min_n, max_n + 1):
            tail = tokens[len(tokens) - n:] if n <= len(tokens) else None
            assert tail is None or n >= len(tokens) or not any(
                tokens[s:s + n] == tail for s in range(len(tokens) - n))
        return
    # The tokens after an earlier occurrence of the tail, read on into the proposal itself.
    extended = tokens + got
    assert any(tokens[s:s + n] == tokens[len(tokens) - n:] and extended[s + n:s + n + k] == got
               for n in range(min_n, max_n + 1) for s in range(len(tokens) - n))


def _target(prefix: tuple[int, ...], vocab: int) -> int:
    """A deterministic 'model': the next greedy token of a prefix."""
    return hash(prefix) % vocab


@pytest.mark.parametrize("seed", range(5))
def test_greedy_verification_equals_plain_greedy(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab, k, steps = 7, 4, 12
    prompts = [tuple(torch.randint(0, vocab, (n,), generator=gen).tolist()) for n in (1, 3, 6)]
    for prompt in prompts:
        plain = list(prompt)
        for _ in range(steps * (k + 1)):
            plain.append(_target(tuple(plain), vocab))
        seq = list(prompt)
        while len(seq) < len(plain):
            # Proposals: right with probability 1/2 each, some rows shorter than k.
            num = int(torch.randint(0, k + 1, (1,), generator=gen))
            draft = []
            for _ in range(num):
                right = _target(tuple(seq + draft), vocab)
                wrong = (right + 1) % vocab
                draft.append(right if torch.rand(1, generator=gen) < 0.5 else wrong)
            targets = [_target(tuple(seq + draft[:i]), vocab) for i in range(k + 1)]
            tokens, counts = verify_tokens(torch.tensor([targets]),
                                           torch.tensor([draft + [-1] * (k - num)]),
                                           torch.tensor([num]))
            emitted = tokens[0, :counts[0]].tolist()
            assert 1 <= len(emitted) <= num + 1 and -1 not in emitted
            seq += emitted
        assert seq[:len(plain)] == plain


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _spec_step(first_logits: torch.Tensor, second_logits: torch.Tensor, proposal: int,
               specs: list[SamplingSpec], prompt_len: int = 5):
    """One proposal per row through SpecVerifier.verify, as a step lays it out: row i holds
    a prompt, then `proposal` (appended for the step); its sampling row's logits (the bonus
    position) are rows 0..R-1, its proposal position's rows R..2R-1."""
    n = len(specs)
    batch = InputBatch(64, 16)
    rows = np.array([batch.add(f"r{i}", [1] * prompt_len + [proposal], [0], prompt_len, spec)
                     for i, spec in enumerate(specs)], np.int64)
    batch.num_spec[rows] = 1
    logits = torch.cat([second_logits, first_logits])  # [2n, V]
    token_indices = [prompt_len + 1] * n  # the sampling rows' own (unused by verify)
    sampling = SamplingBatch.from_specs(specs, token_indices, torch.device("cpu"))
    spec_pos = SpecPositions(rows, np.arange(n), np.ones(n, np.int64), n)
    verdict = SpecVerifier(batch, StructuredRows(None, logits.shape[1])).verify(
        logits, spec_pos, sampling)
    return emitted_tokens(verdict.tokens.numpy(), verdict.counts.numpy())


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampled_verification_is_distributed_as_the_target(top_k):
    """Rejection sampling with a deterministic proposal: over many seeded requests, the first
    emitted token is distributed as the target's (filtered) p0, the proposal is accepted with
    probability p0(d), and after an accepted proposal the next token follows p1."""
    gen = torch.Generator().manual_seed(3)
    vocab, n, d = 6, 12000, 2
    p0 = torch.softmax(torch.randn(vocab, generator=gen) * 1.2, dim=-1)
    p1 = torch.softmax(torch.randn(vocab, generator=gen) * 1.2, dim=-1)
    specs = [SamplingSpec(temperature=1.0, top_k=top_k, seed=i) for i in range(n)]
    out = _spec_step(p0.log().expand(n, vocab), p1.log().expand(n, vocab), d, specs)
    def filtered(p):  # the sampler's top-k: the most likely tokens, renormalised
        if not top_k:
            return p
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[p.topk(top_k).indices] = True
        return torch.where(keep, p, 0.0) / p[keep].sum()

    def check(tokens, p):
        counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
        support = p > 0
        assert counts[~support].sum() == 0
        assert _chi2(counts[support], p[support].double()) < CHI2_CRIT[int(support.sum()) - 1]

    p0, p1 = filtered(p0), filtered(p1)
    check([t[0] for t in out], p0)
    accepted = [t for t in out if len(t) == 2]
    assert all(t[0] == d for t in accepted) and all(len(t) == 1 for t in out if t[0] != d)
    assert abs(len(accepted) / n - float(p0[d])) < 4 * (float(p0[d]) / n) ** 0.5 + 0.01
    check([t[1] for t in accepted], p1)


def test_seeded_verification_draws_what_plain_decoding_draws():
    """Every emitted token is the one plain decoding would draw at its index: the first one
    equals `sample` on the same logits with the same seed and index."""
    gen = torch.Generator().manual_seed(4)
    vocab, n, prompt_len = 50, 300, 7
    first = torch.randn(n, vocab, generator=gen)
    specs = [SamplingSpec(temperature=0.8, top_p=0.9, seed=1000 + i) for i in range(n)]
    out = _spec_step(first, torch.randn(n, vocab, generator=gen), 3, specs, prompt_len)
    plain = sample(first, SamplingBatch.from_specs(specs, [prompt_len] * n,
                                                   torch.device("cpu")))
    assert [t[0] for t in out] == plain.tolist()


def test_greedy_rows_accept_what_the_argmax_agrees_with():
    vocab = 6
    first = torch.full((2, vocab), -5.0)
    first[0, 2] = first[1, 4] = 5.0  # row 0 agrees with the proposal 2, row 1 does not
    second = torch.full((2, vocab), -5.0)
    second[:, 1] = 5.0
    specs = [SamplingSpec(temperature=0.0), SamplingSpec(temperature=0.0)]
    assert _spec_step(first, second, 2, specs) == [[2, 1], [4]]

"""Speculative decoding's pure parts: n-gram proposals (scheduler) and the verification of
proposals (executor): greedy verification against plain greedy decoding of a deterministic
target, rejection sampling against the target's distribution with chi-square tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.spec_decode import rejection_sample, verify_greedy
from scheduler_svc.spec_ngram import propose_ngram

# Chi-square critical values at significance 1e-3 (df -> value).
CHI2_CRIT = {3: 16.27, 4: 18.47, 15: 37.70}


def test_ngram_proposals():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3], k=3) == [9, 1, 2]
    # The longest tail that matched wins over a shorter, more recent one.
    assert propose_ngram([5, 6, 7, 1, 4, 7, 2, 6, 7], k=2, max_n=2) == [1, 4]
    # The most recent earlier occurrence of the tail.
    assert propose_ngram([3, 1, 3, 2, 3], k=1, max_n=1) == [2]
    assert propose_ngram([1, 2, 1], k=5) == [2, 1]  # fewer than k left
    assert propose_ngram([1, 2, 3], k=2) == [] and propose_ngram([], k=2) == []
    assert propose_ngram([4, 4, 4], k=2) == [4]
    with pytest.raises(ValueError, match="k >= 1"):
        propose_ngram([1], k=0)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=40), k=st.integers(1, 5),
       min_n=st.integers(1, 3), extra=st.integers(0, 2))
def test_ngram_proposal_follows_an_earlier_occurrence_of_the_tail(tokens, k, min_n, extra):
    max_n = min_n + extra
    got = propose_ngram(tokens, k, min_n, max_n)
    assert len(got) <= k
    if not got:  # then no tail of an allowed length occurs earlier with a token after it
        for n in range(min_n, max_n + 1):
            tail = tokens[len(tokens) - n:] if n <= len(tokens) else None
            assert tail is None or n >= len(tokens) or not any(
                tokens[s:s + n] == tail for s in range(len(tokens) - n))
        return
    assert any(tokens[s:s + n] == tokens[len(tokens) - n:] and tokens[s + n:s + n + k] == got
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
            tokens, counts = verify_greedy(torch.tensor([targets]),
                                           torch.tensor([draft + [-1] * (k - num)]),
                                           torch.tensor([num]))
            emitted = tokens[0, :counts[0]].tolist()
            assert 1 <= len(emitted) <= num + 1 and -1 not in emitted
            seq += emitted
        assert seq[:len(plain)] == plain


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_first_token_is_distributed_as_the_target(one_hot):
    gen = torch.Generator().manual_seed(11)
    vocab, k, n = 5, 3, 20000
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, dim=-1)
    # Each trial's drafts drawn from q (the n-gram case: a fixed guess, its one-hot q).
    draft = (torch.multinomial(q, n, replacement=True, generator=gen).t() if not one_hot
             else torch.tensor([[2, 0, 4]]).expand(n, k))
    tokens, counts = rejection_sample(
        p.expand(n, k + 1, vocab), draft, torch.full((n,), k),
        None if one_hot else q.expand(n, k, vocab),
        torch.rand(n, k, generator=gen), torch.empty(n, k + 1, vocab).exponential_(
            generator=gen))
    assert ((counts >= 1) & (counts <= k + 1)).all()
    first = torch.bincount(tokens[:, 0], minlength=vocab).double()
    assert _chi2(first, p[0].double()) < CHI2_CRIT[vocab - 1]


def test_rejection_sampling_pairs_follow_the_target_chain():
    """k = 1 over a two-step chain: the first two tokens of the output (the second drawn
    plainly from the target when only one was emitted) are distributed as p0(x) p1(y | x)."""
    gen = torch.Generator().manual_seed(5)
    vocab, n = 4, 40000
    p0 = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, dim=-1)
    p1 = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 1.5, dim=-1)  # [x, y]
    q0 = torch.softmax(torch.randn(vocab, generator=gen), dim=-1)
    draft = torch.multinomial(q0, n, replacement=True, generator=gen)[:, None]  # [n, 1]
    target = torch.stack([p0.expand(n, vocab), p1[draft[:, 0]]], dim=1)  # [n, 2, V]
    tokens, counts = rejection_sample(target, draft, torch.ones(n, dtype=torch.long),
                                      q0.expand(n, 1, vocab), torch.rand(n, 1, generator=gen),
                                      torch.empty(n, 2, vocab).exponential_(generator=gen))
    first = tokens[:, 0]
    second = torch.where(counts == 2, tokens[:, 1],
                         torch.multinomial(p1[first], 1, generator=gen)[:, 0])
    cells = torch.bincount(first * vocab + second, minlength=vocab * vocab).double()
    joint = (p0[:, None] * p1).reshape(-1).double()
    assert _chi2(cells, joint) < CHI2_CRIT[vocab * vocab - 1]


def test_rejection_sampling_accepts_proposals_the_target_is_sure_of():
    vocab, k = 6, 3
    draft = torch.tensor([[1, 2, 3], [4, 5, -1]])
    p = torch.full((2, k + 1, vocab), 0.0)
    p[0, 0, 1] = p[0, 1, 2] = p[0, 2, 3] = p[0, 3, 0] = 1.0
    p[1, 0, 4] = p[1, 1, 0] = 1.0  # rejects the second draft, must emit 0 there
    p[1, 2:, 0] = 1.0
    tokens, counts = rejection_sample(p, draft, torch.tensor([3, 2]), None,
                                      torch.full((2, k), 0.5), torch.ones(2, k + 1, vocab))
    assert counts.tolist() == [4, 2]
    assert tokens.tolist() == [[1, 2, 3, 0], [4, 0, -1, -1]]

"""The logits processors (min_tokens, penalties, min_p, logit_bias, allowed_token_ids, bad
words) through the real path: rows written into the persistent batch, gathered by
build_step_inputs, applied by the batched sampler. The oracle is a per-row reference written the
slow, obvious way (Python loops over one row's tokens), on random batches mixing rows with and
without each feature."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from executor_svc.sample.logits_processors import apply_processors
from executor_svc.sample.sampler import GREEDY_EPS, sample, seed_bits, seeded_exponentials
from executor_svc.step.input_batch import InputBatch
from executor_svc.step.inputs import build_step_inputs
from protos.plan import SamplingSpec

CPU = torch.device("cpu")
VOCAB = 48
BLOCK_SIZE = 8
MAX_MODEL_LEN = 64


def _reference_processed(logits: torch.Tensor, spec: SamplingSpec, tokens: list[int],
                         num_prompt: int) -> torch.Tensor:
    """One row: allowed ids, bad words, min_tokens, logit_bias, penalties (vLLM's order)."""
    x = logits.clone()
    output = tokens[num_prompt:]
    if spec.allowed_token_ids:
        for t in range(VOCAB):
            if t not in spec.allowed_token_ids:
                x[t] = float("-inf")
    for word in spec.bad_words:
        prefix = list(word[:-1])
        if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
            x[word[-1]] = float("-inf")
    if len(output) < spec.min_tokens:
        for t in spec.min_tokens_stop_ids:
            x[t] = float("-inf")
    for t, b in spec.logit_bias:
        x[t] = x[t] + torch.tensor(b, dtype=torch.float32)
    rep = torch.tensor(spec.repetition_penalty, dtype=torch.float32)
    freq = torch.tensor(spec.frequency_penalty, dtype=torch.float32)
    pres = torch.tensor(spec.presence_penalty, dtype=torch.float32)
    for t in set(tokens):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(output):
        x[t] = x[t] - freq * output.count(t)
        x[t] = x[t] - pres
    return x


def _reference_token(processed: torch.Tensor, spec: SamplingSpec, token_index: int) -> int:
    """Greedy argmax, or temperature -> min_p -> top-k/top-p -> seeded exponential race."""
    if spec.temperature < GREEDY_EPS:
        return int(processed.argmax())
    scaled = processed / torch.tensor(spec.temperature, dtype=torch.float32)
    probs = scaled.softmax(-1)
    top = probs.max()
    for t in range(VOCAB):
        if probs[t] < spec.min_p * top:
            scaled[t] = float("-inf")
    assert spec.top_k == 0 and spec.top_p == 1.0  # filters are test_sampler.py's business
    noise = seeded_exponentials(torch.tensor([seed_bits(spec.seed)]),
                                torch.tensor([token_index]), VOCAB)[0]
    return int((scaled.softmax(-1) / noise).argmax())


def _random_spec(rng: random.Random) -> SamplingSpec:
    def maybe(p, value, default):
        return value if rng.random() < p else default

    words = tuple(tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 3)))
                  for _ in range(rng.randint(1, 4)))
    allowed = tuple(rng.sample(range(VOCAB), rng.randint(5, 20)))
    bias_ids = rng.sample(range(VOCAB), rng.randint(1, 6))
    return SamplingSpec(
        temperature=rng.choice([0.0, 0.0, 0.7, 1.3]), seed=rng.randrange(2**40),
        min_tokens=maybe(0.3, rng.randint(1, 10), 0),
        min_tokens_stop_ids=tuple(rng.sample(range(VOCAB), 3)),
        repetition_penalty=maybe(0.4, rng.choice([0.7, 1.3, 2.0]), 1.0),
        presence_penalty=maybe(0.3, rng.uniform(-2, 2), 0.0),
        frequency_penalty=maybe(0.3, rng.uniform(-2, 2), 0.0),
        min_p=maybe(0.3, rng.choice([0.05, 0.3, 0.9]), 0.0),
        logit_bias=maybe(0.3, tuple((t, rng.uniform(-100, 100)) for t in bias_ids), ()),
        allowed_token_ids=maybe(0.2, allowed, ()),
        bad_words=maybe(0.3, words, ()))


def _batch(rng: random.Random, num_rows: int, device: torch.device = CPU):
    """A persistent batch whose rows all sample this step, after some rows came and went."""
    ib = InputBatch(MAX_MODEL_LEN, BLOCK_SIZE, capacity=4)  # small: rows grow the arrays
    rows, specs, tokens, prompts = [], [], [], []
    for i in range(num_rows):
        if rng.random() < 0.3:  # a departed neighbour leaves a stale row behind
            ib.add(f"gone{i}", [1] * 30, [0] * 4, 29, _random_spec(rng))
            ib.remove(f"gone{i}")
        num_prompt = rng.randint(1, 20)
        # Outputs drawn from a few ids, so penalties and bad-word prefixes hit.
        toks = [rng.randrange(VOCAB) for _ in range(num_prompt)]
        toks += [rng.randrange(6) for _ in range(rng.randint(0, 25))]
        spec = _random_spec(rng) if rng.random() < 0.7 else SamplingSpec(
            temperature=rng.choice([0.0, 1.0]), seed=rng.randrange(2**40))
        row = ib.add(f"r{i}", toks, list(range(-(-len(toks) // BLOCK_SIZE))), len(toks) - 1,
                     spec, num_prompt)
        rows.append(row)
        specs.append(spec)
        tokens.append(toks)
        prompts.append(num_prompt)
    inputs = build_step_inputs(ib, np.array(rows, np.int64), np.ones(num_rows, np.int64),
                               device)
    return inputs, specs, tokens, prompts


@pytest.mark.parametrize("seed", range(12))
def test_processed_logits_and_tokens_match_the_per_row_reference(seed):
    rng = random.Random(seed)
    num_rows = rng.randint(1, 12)
    inputs, specs, tokens, prompts = _batch(rng, num_rows)
    torch.manual_seed(seed)
    logits = torch.randn(num_rows, VOCAB) * 3
    raw = logits.clone()
    processing = inputs.sampling.processing
    expected = torch.stack([_reference_processed(logits[i], specs[i], tokens[i], prompts[i])
                            for i in range(num_rows)])
    if processing is None:
        assert torch.equal(expected, logits)
    else:
        assert torch.equal(apply_processors(logits, processing), expected)
    got = sample(logits, inputs.sampling).tolist()
    assert torch.equal(logits, raw), "the caller's logits stay raw (logprobs read them)"
    want = [_reference_token(expected[i], specs[i], len(tokens[i])) for i in range(num_rows)]
    assert got == want


def test_a_row_alone_samples_what_it_samples_in_a_batch():
    rng = random.Random(99)
    inputs, specs, tokens, prompts = _batch(rng, 10)
    torch.manual_seed(5)
    logits = torch.randn(10, VOCAB) * 3
    together = sample(logits, inputs.sampling).tolist()
    for i in range(10):
        ib = InputBatch(MAX_MODEL_LEN, BLOCK_SIZE)
        row = ib.add("alone", tokens[i], list(range(-(-len(tokens[i]) // BLOCK_SIZE))),
                     len(tokens[i]) - 1, specs[i], prompts[i])
        alone = build_step_inputs(ib, np.array([row], np.int64), np.ones(1, np.int64), CPU)
        assert sample(logits[i:i + 1], alone.sampling).tolist() == [together[i]]


def test_rows_without_processors_gather_nothing():
    ib = InputBatch(MAX_MODEL_LEN, BLOCK_SIZE)
    ib.add("p", [1, 2, 3], [0], 2, SamplingSpec(repetition_penalty=1.2))
    ib.remove("p")  # its row is reused below and must carry nothing over
    rows = [ib.add(f"r{i}", [1, 2, 3], [0], 2, SamplingSpec(temperature=0.0, seed=i))
            for i in range(3)]
    inputs = build_step_inputs(ib, np.array(rows, np.int64), np.ones(3, np.int64), CPU)
    assert inputs.sampling.processing is None


def test_min_tokens_counts_outputs_from_the_prompt_length_after_a_resume():
    """A resumed request holds prompt + outputs; only the outputs count towards min_tokens."""
    spec = SamplingSpec(temperature=0.0, min_tokens=3, min_tokens_stop_ids=(7,))
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 5.0
    for num_prompt, banned in ((4, True), (3, True), (2, False)):  # outputs: 1, 2, 3
        ib = InputBatch(MAX_MODEL_LEN, BLOCK_SIZE)
        row = ib.add("r", [1, 2, 3, 4, 5], [0], 4, spec, num_prompt)
        inputs = build_step_inputs(ib, np.array([row], np.int64), np.ones(1, np.int64), CPU)
        assert (sample(logits, inputs.sampling).item() != 7) == banned

"""Seeded workloads: the same prompts (token ids), output lengths and arrival times for every peer.

Lengths come from `seed` alone; token ids from (`seed`, repetition), so repetition r of every
peer runs the same prompts while consecutive repetitions do not share prefixes (a prefix
cache would otherwise turn the second repetition's prefill into a cache hit on Folio and
vLLM, and not on HF). Warm-up prompts come from a stream of their own, for the same reason.

    random         every request input_len in / output_len out
    sharegpt-like  log-normal lengths with ShareGPT's means (about 202 in / 179 out), capped so
                   prompt + output fits the model's context
    repeat         random's lengths, each prompt one random 16-token phrase repeated: a model
                   continues the pattern, the repetitive text speculative decoding's n-gram
                   proposals are for (like quoting a passage)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

DATASETS = ("random", "sharegpt-like", "repeat")
REPEAT_PHRASE_LEN = 16
SHAREGPT_MEAN_INPUT = 202
SHAREGPT_MEAN_OUTPUT = 179
SHAREGPT_SIGMA = 1.0  # log-space spread: ShareGPT's lengths span two orders of magnitude
MIN_INPUT_LEN = 4
MIN_OUTPUT_LEN = 2  # TPOT needs a second token
WARMUP_STREAM = 1_000_003  # keeps warm-up ids apart from every repetition's


@dataclass(frozen=True)
class WorkloadSpec:
    dataset: str = "random"
    num_prompts: int = 16
    input_len: int = 128
    output_len: int = 32
    request_rate: float = math.inf  # requests/s, Poisson; inf = all at once
    seed: int = 0
    vocab_size: int = 32000  # token ids are drawn from [0, vocab_size)
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset is one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.num_prompts < 1:
            raise ValueError("the workload needs at least one prompt")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be at least 1")
        if self.dataset != "sharegpt-like" and (
                self.input_len + self.output_len > self.max_model_len):
            raise ValueError(f"input_len + output_len = {self.input_len + self.output_len} "
                             f"exceeds the model's context of {self.max_model_len} tokens")
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be positive (inf: all at once)")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate
        return d


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    output_len: int
    arrival_s: float  # offset from the start of the run

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def _lengths(spec: WorkloadSpec) -> tuple[list[int], list[int]]:
    n = spec.num_prompts
    if spec.dataset in ("random", "repeat"):
        return [spec.input_len] * n, [spec.output_len] * n
    rng = np.random.default_rng([spec.seed, 0])

    def lognormal(mean: float) -> np.ndarray:
        # E[exp(N(mu, s^2))] = exp(mu + s^2 / 2): pick mu so the mean is `mean`.
        mu = math.log(mean) - SHAREGPT_SIGMA**2 / 2
        return np.rint(rng.lognormal(mu, SHAREGPT_SIGMA, size=n)).astype(int)

    inputs = np.maximum(lognormal(SHAREGPT_MEAN_INPUT), MIN_INPUT_LEN)
    outputs = np.maximum(lognormal(SHAREGPT_MEAN_OUTPUT), MIN_OUTPUT_LEN)
    # Cap each pair to the context, shrinking the longer side first (outputs keep >= 2 tokens).
    budget = spec.max_model_len
    outputs = np.minimum(outputs, budget // 2)
    inputs = np.minimum(inputs, budget - outputs)
    return inputs.tolist(), outputs.tolist()


def _arrivals(spec: WorkloadSpec) -> list[float]:
    if math.isinf(spec.request_rate):
        return [0.0] * spec.num_prompts
    rng = np.random.default_rng([spec.seed, 1])
    gaps = rng.exponential(1.0 / spec.request_rate, size=spec.num_prompts)
    gaps[0] = 0.0  # the first request starts the clock
    return np.cumsum(gaps).tolist()


def _prompt_ids(spec: WorkloadSpec, stream: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng([spec.seed, 2, stream])
    if spec.dataset == "repeat":
        phrases = [rng.integers(0, spec.vocab_size, size=REPEAT_PHRASE_LEN) for _ in lengths]
        return [np.resize(p, n).tolist() for p, n in zip(phrases, lengths, strict=True)]
    return [rng.integers(0, spec.vocab_size, size=n).tolist() for n in lengths]


def make_requests(spec: WorkloadSpec, rep: int = 0) -> list[Request]:
    """Repetition `rep` of the workload: same lengths and arrivals for every rep."""
    input_lens, output_lens = _lengths(spec)
    prompts = _prompt_ids(spec, rep, input_lens)
    return [Request(p, o, a) for p, o, a in zip(prompts, output_lens, _arrivals(spec), strict=True)]


def warmup_requests(spec: WorkloadSpec, num: int = 2, output_len: int = 4) -> list[Request]:
    """A few short requests, shaped like the workload's first ones, on ids of their own."""
    input_lens, _ = _lengths(spec)
    lens = input_lens[:num]
    return [Request(p, output_len, 0.0) for p in _prompt_ids(spec, WARMUP_STREAM, lens)]

"""From per-request timings to the reported metrics, and from repetitions to median and range.

One run of one peer is a `RunResult`: wall time of the whole run and, per request, the tokens
it produced and whatever timings the peer can observe. Folio (a gRPC stream) sees every token
arrive; the offline peers see when the batch finished, so their latency mode measures TTFT as
a run of the same batch with one output token (see `runners/`).

    TTFT  time to the first output token
    TPOT  (e2e - TTFT) / (output tokens - 1), per request
    ITL   gaps between consecutive token arrivals of one request (streamed runs only)

Percentiles are nearest-rank (an observed value), as in bench/scheduler.py.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

# An output position whose id a streaming peer could not observe (llamacpp_peer.py): it counts
# as a token and matches any id in same_tokens.
UNSEEN_ID = -1
MODES = ("throughput", "latency", "serve", "context", "chat")  # context: latency at several
# lengths; chat: multi-turn conversations (chat.py)


@dataclass
class RequestTiming:
    prompt_len: int
    output_ids: list[int]
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.num_output < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output - 1)


@dataclass
class RunResult:
    elapsed_s: float
    requests: list[RequestTiming]
    extra: dict[str, float] = field(default_factory=dict)  # peer-specific numbers (Folio's stats)

    @classmethod
    def from_dict(cls, d: dict) -> RunResult:
        return cls(d["elapsed_s"], [RequestTiming(**r) for r in d["requests"]],
                   dict(d.get("extra") or {}))


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank q-th percentile (0 < q <= 100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(math.ceil(q / 100 * len(ordered)), 1)
    return ordered[rank - 1]


def _ms_percentiles(name: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"{name} p50 (ms)": percentile(values, 50) * 1e3,
            f"{name} p99 (ms)": percentile(values, 99) * 1e3}


def summarize(mode: str, run: RunResult) -> dict[str, float]:
    """The metrics of one run, keyed by the row names of the report."""
    num_output = sum(r.num_output for r in run.requests)
    num_prompt = sum(r.prompt_len for r in run.requests)
    out = {
        "output tok/s": num_output / run.elapsed_s,
        "total tok/s": (num_output + num_prompt) / run.elapsed_s,
        "req/s": len(run.requests) / run.elapsed_s,
        "elapsed (s)": run.elapsed_s,
        "output tokens": float(num_output),
    }
    if mode in ("latency", "serve"):
        out |= _ms_percentiles("TTFT", [r.ttft_s for r in run.requests if r.ttft_s is not None])
        out |= _ms_percentiles("TPOT", [t for r in run.requests if (t := r.tpot_s) is not None])
    if mode == "serve":
        out |= _ms_percentiles("ITL", [gap for r in run.requests for gap in r.itl_s])
    return out | run.extra


def same_ids(ids: list[int], reference: list[int]) -> bool:
    """Equal lengths and equal ids wherever both were observed (UNSEEN_ID matches any id)."""
    return len(ids) == len(reference) and all(
        a == b or UNSEEN_ID in (a, b) for a, b in zip(ids, reference, strict=True))


def same_tokens(run: RunResult, reference: RunResult) -> float:
    """Fraction of requests whose output ids equal the reference run's (same workload)."""
    pairs = list(zip(run.requests, reference.requests, strict=True))
    return sum(same_ids(a.output_ids, b.output_ids) for a, b in pairs) / len(pairs)


@dataclass
class Aggregate:
    median: float
    low: float
    high: float
    values: list[float]


def aggregate(per_rep: list[dict[str, float]]) -> dict[str, Aggregate]:
    """Median and range over repetitions, for every metric that all of them have."""
    names = [k for k in per_rep[0] if all(k in rep for rep in per_rep)]
    return {k: Aggregate(statistics.median(v), min(v), max(v), v)
            for k in names for v in [[rep[k] for rep in per_rep]]}


def tpot_ratio(cells: dict[str, dict[str, Aggregate]]) -> dict | None:
    """`folio bench context`: TPOT at the longest over the shortest context that ran, from one
    column's cells (prompt length as a string -> metric -> Aggregate)."""
    lens = sorted(int(n) for n, c in cells.items() if "TPOT (ms)" in c)
    if len(lens) < 2:
        return None
    short, long = cells[str(lens[0])]["TPOT (ms)"], cells[str(lens[-1])]["TPOT (ms)"]
    return {"shortest": lens[0], "longest": lens[-1],
            "ratio": long.median / short.median if short.median else None}

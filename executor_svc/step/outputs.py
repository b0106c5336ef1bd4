"""What a step brings back: one device-to-host transfer of named, typed segments, and the
records the runner answers the scheduler with.

The mirror of inputs.py's staging buffer. The runner's `_sample` names every device tensor the
host needs this step; `read_back` packs them into one device buffer of 16-byte-aligned typed
segments, moves it to the host in one copy (the step's only sync), and hands back a numpy view
of each segment under its name, with its dtype and shape::

    int64:   token_ids [num_logits]
             top_ids [num_lp, k]              sampled_ranks [num_slp]
             prompt_ranks [num_pl]            prompt_top_ids [num_pl, pl_k]
             spec_tokens [num_spec_seqs, s + 1]   spec_counts [num_spec_seqs]
    float32: top_logprobs [num_lp, k]         sampled_logprobs [num_slp]
             prompt_logprobs [num_pl]         prompt_top_logprobs [num_pl, pl_k]

A segment is present only when a row asks for it; the common step names ``token_ids`` alone,
which crosses as it is (no packing). `read_sampled` builds the step's records from the
segments by name. Token ids, ranks (int64) and fp32 logprobs come back exactly as the device
held them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import numpy as np
import torch

from executor_svc.spec.verifier import emitted_tokens
from executor_svc.step.inputs import PromptPositions, StepInputs
from protos.plan import PromptLogprobs

ALIGN = 16  # bytes, of every read-back segment's start (a multiple of every itemsize)

_NUMPY_DTYPES = {torch.int64: np.int64, torch.float32: np.float32}


class SampledTokens(NamedTuple):
    """A request's tokens from this step: one sampled id, or with speculative proposals the
    accepted ones and one more."""

    req_id: str
    token_ids: list[int]


class TopLogprobs(NamedTuple):
    """A sampled request's most likely tokens (SamplingSpec.num_logprobs of them), best
    first."""

    req_id: str
    token_ids: list[int]
    logprobs: list[float]


class SampledLogprob(NamedTuple):
    """The sampled token's own logprob and rank (1 + the entries strictly more likely)."""

    req_id: str
    logprob: float
    rank: int


class Proposal(NamedTuple):
    """The draft model's proposals for a request's next step."""

    req_id: str
    token_ids: list[int]


@dataclass(frozen=True)
class StepOutput:
    """What `ModelRunner.execute` answers for one plan (the fields of a StepResult)."""

    sampled: list[SampledTokens]  # logits order: every request that sampled
    num_tokens: int  # tokens computed this step
    execute_time_s: float
    logprobs: list[TopLogprobs]  # requests with num_logprobs > 0
    sampled_logprobs: list[SampledLogprob] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    proposals: list[Proposal] = field(default_factory=list)  # the draft model's


@dataclass
class Sampled:
    """What `_sample` brings back from the device, in its one transfer."""

    token_ids: list[int]  # [num_logits] one per sampling row
    logprobs: list[TopLogprobs] = field(default_factory=list)
    sampled_logprobs: list[SampledLogprob] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    emitted: list[list[int]] = field(default_factory=list)  # per spec row (SpecPositions)


def read_back(segments: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Every named device tensor (int64 or float32, on one device) on the host, in one
    transfer: a numpy array of the same dtype and shape under the same name."""
    if len(segments) == 1:  # the common step: its sampled ids cross as they are
        (name, only), = segments.items()
        return {name: only.cpu().numpy()}
    spans: dict[str, tuple[int, int]] = {}
    offset = 0
    for name, t in segments.items():
        nbytes = t.numel() * t.element_size()
        spans[name] = (offset, offset + nbytes)
        offset += -(-nbytes // ALIGN) * ALIGN
    device = next(iter(segments.values())).device
    packed = torch.empty(offset, dtype=torch.uint8, device=device)
    for name, t in segments.items():
        a, b = spans[name]
        packed[a:b].view(t.dtype).view(t.shape).copy_(t)
    host = packed.cpu().numpy()
    return {name: host[a:b].view(_NUMPY_DTYPES[t.dtype]).reshape(t.shape)
            for (name, t), (a, b) in zip(segments.items(), spans.values(), strict=True)}


def read_sampled(host: dict[str, np.ndarray], inputs: StepInputs,
                 req_ids: list[str | None]) -> Sampled:
    """The step's records from its read-back segments (`read_back`), by name; req_ids: the
    persistent batch's, by row."""
    out = Sampled(host["token_ids"].tolist())
    sample_rows = inputs.sample_rows
    if "top_ids" in host:
        out.logprobs = [
            TopLogprobs(req_ids[int(sample_rows[row])], ids[:n].tolist(), lps[:n].tolist())
            for row, n, ids, lps in zip(inputs.logprob_rows_host.tolist(),
                                        inputs.num_logprobs.tolist(), host["top_ids"],
                                        host["top_logprobs"], strict=True)]
    if "sampled_logprobs" in host:
        out.sampled_logprobs = [
            SampledLogprob(req_ids[int(sample_rows[row])], lp, rank) for row, lp, rank
            in zip(inputs.sampled_lp_rows_host.tolist(), host["sampled_logprobs"].tolist(),
                   host["sampled_ranks"].tolist(), strict=True)]
    if "prompt_logprobs" in host:
        assert inputs.prompt_lp is not None
        out.prompt_logprobs = prompt_logprobs_records(
            inputs.prompt_lp, req_ids, host["prompt_logprobs"], host["prompt_ranks"],
            host["prompt_top_ids"], host["prompt_top_logprobs"])
    if "spec_tokens" in host:
        out.emitted = emitted_tokens(host["spec_tokens"], host["spec_counts"])
    return out


def prompt_logprobs_records(pl: PromptPositions, req_ids: list[str | None],
                            own: np.ndarray, ranks: np.ndarray, top_ids: np.ndarray,
                            top_lps: np.ndarray) -> list[PromptLogprobs]:
    """Per prompt row: its positions' own logprobs and ranks ([num_pl]) and its top `num_top`
    of the [num_pl, pl_k] alternatives."""
    out, start = [], 0
    for row, first, count, n in zip(pl.rows.tolist(), pl.starts.tolist(), pl.counts.tolist(),
                                    pl.num_top.tolist(), strict=True):
        end = start + count
        req_id = req_ids[row]
        assert req_id is not None
        out.append(PromptLogprobs(
            req_id=req_id, start=first, token_logprobs=own[start:end].tolist(),
            ranks=ranks[start:end].tolist(), top_ids=top_ids[start:end, :n].tolist(),
            top_logprobs=top_lps[start:end, :n].tolist()))
        start = end
    return out


_SAMPLED_TOKENS = partial(tuple.__new__, SampledTokens)  # NamedTuple._make, minus its frame


def sampled_tokens(req_ids: list[str | None], tokens: list[list[int]]) -> list[SampledTokens]:
    """One record per sampling row (every request, every step: built at C speed)."""
    return list(map(_SAMPLED_TOKENS, zip(req_ids, tokens, strict=True)))

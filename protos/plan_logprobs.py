"""Prompt logprobs in a StepResult (protos/plan.py): one entry per request that computed
prompt positions with SamplingSpec.prompt_logprobs >= 0, checked field by field on decode."""

from __future__ import annotations

from typing import NamedTuple

from protos.wire import _floats, _list, _nat, _nats, _str


class PromptLogprobs(NamedTuple):
    """Logprobs of consecutive prompt tokens ``start .. start + len(token_logprobs) - 1`` of one
    request, each given the tokens before it (so start >= 1), computed in one step."""

    req_id: str
    start: int  # index of the first prompt token covered
    token_logprobs: list[float]  # [m] each token's own logprob
    ranks: list[int]  # [m] 1 + the number of tokens strictly more likely
    top_ids: list[list[int]]  # [m][k] the k most likely tokens at each position, best first
    top_logprobs: list[list[float]]  # [m][k] their logprobs


def _prompt_logprobs_from_wire(w: object) -> list[PromptLogprobs]:
    out = []
    for entry in _list(w):
        req_id, start, lps, ranks, top_ids, top_lps = _list(entry, 6)
        lps, ranks = _floats(lps), _nats(ranks)
        top_ids = [_nats(ids) for ids in _list(top_ids)]
        top_lps = [_floats(x) for x in _list(top_lps)]
        m = len(lps)
        if not (len(ranks) == len(top_ids) == len(top_lps) == m):
            raise ValueError("prompt logprobs: as many ranks and top lists as positions")
        if any(len(a) != len(b) for a, b in zip(top_ids, top_lps, strict=True)):
            raise ValueError("prompt logprobs: as many top ids as top values")
        if _nat(start) < 1 or (m and min(ranks) < 1):
            raise ValueError("prompt logprobs: start and ranks must be >= 1")
        out.append(PromptLogprobs(req_id=_str(req_id), start=start, token_logprobs=lps,
                                  ranks=ranks, top_ids=top_ids, top_logprobs=top_lps))
    return out

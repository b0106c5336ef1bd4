"""Speculative decoding, the scheduler's side: which decoding requests propose tokens, and how
many (the proposer: n-gram lookup over the request's own tokens, spec_ngram.py).

A request speculates when speculation is on (`--speculative-method ngram
--num-speculative-tokens k`) and it is a plain decode: its own sequence (no n > 1 group, no beam
search), the executor appends its samples, and no per-token logits work applies that the
verification does not replay (logprobs of any kind, penalties, logit bias, allowed or banned
tokens, min_tokens with stop ids to mask, structured output, min_p), including prompt logprobs
the executor's copy of the request still asks for (`Request.executor_prompt_logprobs`). Those
requests decode one token per step as before. Proposals never reach past max_tokens or
max_model_len, and take from the step's token budget like any token.

With a draft model (method draft) the executor proposes after each step
(StepResult.proposals) for the next; every speculating decode then also gets k lookahead KV
slots, the positions the draft model writes while proposing (executor_svc/spec/draft.py).

Steps that carry proposals run in lockstep (schedule() waits for the previous result): the
next proposal reads the tokens the last step accepted.
"""

from __future__ import annotations

from scheduler_svc.sched.request import Request
from scheduler_svc.sched.spec_ngram import propose_ngram

SPECULATIVE_METHODS = ("ngram", "draft")


def speculates(req: Request) -> bool:
    """Whether a decoding request may carry proposals (see the module docstring)."""
    s = req.sampling
    return (req.group is None and s.append_sampled and s.num_logprobs == 0
            and not s.sampled_logprob and s.prompt_logprobs < 0
            and not req.executor_prompt_logprobs and s.structured is None
            and s.repetition_penalty == 1.0 and s.presence_penalty == 0.0
            and s.frequency_penalty == 0.0 and s.min_p == 0.0 and not s.logit_bias
            and not s.allowed_token_ids and not s.bad_words
            and not (s.min_tokens and s.min_tokens_stop_ids))


def proposal(req: Request, k: int, max_model_len: int, budget: int,
             method: str = "ngram") -> list[int]:
    """Up to k proposed tokens for a decoding request with nothing in flight: at most what
    max_tokens and max_model_len leave after the token this step samples anyway, and what the
    budget leaves after that token's own position. ngram looks them up; draft takes the
    executor's last proposals, if they follow the request's current tokens."""
    room = min(k, req.max_tokens - len(req.output_token_ids) - 1,
               max_model_len - req.num_tokens, budget - 1)
    if room < 1 or not speculates(req):
        return []
    if method == "draft":
        if req.draft_proposals is None or req.draft_proposals[0] != req.num_tokens:
            return []
        return req.draft_proposals[1][:room]
    return propose_ngram(req.all_token_ids, room)

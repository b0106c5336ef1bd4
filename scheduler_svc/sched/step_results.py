"""The result side of a step: `StepResults.update` applies an executor's StepResult to the
requests (the in-flight placeholders become real tokens, stops finish requests, logprobs are
filed) and returns a StepOutput per request that sampled; the Scheduler (scheduler.py), which
builds the plans, extends it. See scheduler.py for overlap and the invariants both keep."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from protos.plan import StepResult
from scheduler_svc.sched.prefix_cache import cache_computed_blocks_many
from scheduler_svc.sched.request import Request, RequestStatus, TokenLogprobs
from scheduler_svc.sched.scheduler_state import SchedulerState


class StepOutput(NamedTuple):
    """What one step produced for one request (immutable; a NamedTuple because one is made per
    sampled request per step, and a frozen dataclass's __init__ costs several times more)."""

    req: Request
    new_token_ids: list[int]
    finished: bool
    logprobs: list[TokenLogprobs] | None = None  # one per new token, if the request asks


class StepResults(SchedulerState):
    """Applies step results to the state it inherits."""

    def update(self, result: StepResult) -> list[StepOutput]:
        """Apply the oldest in-flight plan's sampled tokens; finish requests that hit a stop."""
        assert self._in_flight and self._in_flight[0].plan.step_id == result.step_id, \
            f"result for step {result.step_id} does not match the oldest plan in flight"
        plan = self._in_flight.popleft().plan
        self.num_steps += 1
        requests, running = self.requests, RequestStatus.RUNNING
        if self.num_speculative_tokens:
            self._settle_proposals(plan, result)
        if self.enable_prefix_caching:
            # The step wrote its blocks: full ones become reusable, before anything is freed.
            cache_computed_blocks_many(self.block_manager, [
                req for scheduled in (*plan.new_reqs, *plan.cached_reqs)
                if (req := requests.get(scheduled.req_id)) is not None
                and req.status is running])
        outputs: list[StepOutput] = []
        new_output = tuple.__new__  # StepOutput's own __new__ is Python code: one per request
        num_generated = 0
        logprobs = {r: list(zip(ids, lps, strict=True)) for r, ids, lps in result.logprobs}
        if result.prompt_logprobs:
            self._record_prompt_logprobs(result)
        sampled_lps = {r: (lp, rank) for r, lp, rank in result.sampled_logprobs}
        for req_id, token_ids in result.sampled:
            req = requests.get(req_id)
            if req is None or req.status is not running:
                continue  # finished or aborted while the step ran: a token past its end
            if req.group is not None and req not in req.group.outputs:
                if req.num_computed_tokens < req.num_tokens:
                    continue  # mid-prompt: the executor must not sample (protocol)
                # A parallel-sampling parent or a beam: its draw is no client's token.
                outputs += [StepOutput(r, list(r.output_token_ids), True)
                            for r in self._on_hidden_sample(req, logprobs.get(req_id))]
                continue
            if req.num_placeholders == 0:
                continue  # no step in flight samples for it: the executor must not (protocol)
            req.num_placeholders -= 1
            new_token_ids = token_ids  # all of them, unless a stop comes first
            finished = False
            for i, token_id in enumerate(token_ids):
                req.output_token_ids.append(token_id)
                if (status := self._stop_status(req, token_id)) is not None:
                    if status is RequestStatus.FINISHED_STOPPED:
                        req.matched_stop = token_id
                    self._finish(req, status)
                    finished = True
                    new_token_ids = token_ids[:i + 1]
                    break
            num_generated += len(new_token_ids)
            if req.sampling.prompt_logprobs >= 0:
                # The prompt is computed: a recompute or a resume never asks for its logprobs
                # again (they go out with this token's message).
                req.sampling = replace(req.sampling, prompt_logprobs=-1)
            token_lps = None
            if req.sampling.sampled_logprob:
                token_lps = self._token_logprobs(req, new_token_ids, sampled_lps, logprobs)
            outputs.append(new_output(StepOutput, (req, new_token_ids, finished, token_lps)))
            if req.group is not None and req.group.is_done():
                self.groups.pop(req.group.req_id, None)
        self.num_generated_tokens += num_generated
        for req_id, ids in result.proposals:  # the draft model's, for the next step
            if (req := requests.get(req_id)) is not None:
                req.draft_proposals = (req.num_tokens, ids)
        return outputs

    def _settle_proposals(self, plan, result: StepResult) -> None:
        """Speculative decoding: each request's computed count, which counted its proposals,
        rolled back to what the executor kept (the accepted proposals and the token before
        them), before prefix caching keys a block and the tokens are appended. The block
        table keeps its tail: the next steps' lookahead."""
        emitted = None
        for scheduled in plan.cached_reqs:
            if not scheduled.spec_token_ids:
                continue
            req = self.requests.get(scheduled.req_id)
            if req is None or not req.spec_token_ids:
                continue
            if emitted is None:
                emitted = {r: len(ids) for r, ids in result.sampled}
            num_drafts = len(req.spec_token_ids)
            num_accepted = max(0, min(emitted.get(req.req_id, 1) - 1, num_drafts))
            req.num_computed_tokens -= num_drafts - num_accepted
            req.spec_token_ids = []
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted

    def _token_logprobs(self, req: Request, token_ids: list[int],
                        sampled_lps: dict[str, tuple[float, int]],
                        top: dict[str, list[tuple[int, float]]]) -> list[TokenLogprobs]:
        """The logprobs of a request's new token (one per step)."""
        # The executor reports every row with sampled_logprob; rank 0 would mark a breach.
        lp, rank = sampled_lps.get(req.req_id, (float("nan"), 0))
        alternatives = top.get(req.req_id, [])
        return [TokenLogprobs(t, lp, rank, [i for i, _ in alternatives],
                              [v for _, v in alternatives]) for t in token_ids]

    def _record_prompt_logprobs(self, result: StepResult) -> None:
        """File each reported prompt position under its token (index - 1), by position, so a
        chunk computed again after a recompute preemption replaces rather than repeats."""
        for entry in result.prompt_logprobs:
            req = self.requests.get(entry.req_id)
            if req is None or req.sampling.prompt_logprobs < 0:
                continue
            prompt = req.prompt_token_ids
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None] * (len(prompt) - 1)
            for j, (lp, rank, ids, lps) in enumerate(zip(
                    entry.token_logprobs, entry.ranks, entry.top_ids, entry.top_logprobs,
                    strict=True)):
                index = entry.start + j
                if index < len(prompt):
                    req.prompt_logprobs[index - 1] = TokenLogprobs(prompt[index], lp, rank,
                                                                   ids, lps)

    def _stop_status(self, req: Request, token_id: int) -> RequestStatus | None:
        num_output_tokens = len(req.output_token_ids)  # once: checked for every sampled token
        if ((not req.ignore_eos and token_id in req.eos_token_ids)
                or token_id in req.stop_token_ids) and num_output_tokens >= req.min_tokens:
            # The executor masks these ids before min_tokens; checked here as well, so no
            # EOS or stop id ends a sequence early whatever was sampled (vLLM does the same).
            return RequestStatus.FINISHED_STOPPED
        if (num_output_tokens >= req.max_tokens
                or len(req.prompt_token_ids) + num_output_tokens >= self.max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None

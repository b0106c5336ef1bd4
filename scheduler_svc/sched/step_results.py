"""Applying a step's result: the executor's sampled tokens become the requests' tokens, stops
finish requests, logprobs are filed, a sequence group's hidden samples fork children or feed
its beam search, and speculative proposals are settled. `ResultApplier.apply` returns a
StepOutput per request that sampled, for the output processor (engine/output_processor.py).

See scheduler.py, "Overlap", for the placeholders a plan in flight leaves behind.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from protos.plan import StepPlan, StepResult
from scheduler_svc.sched.block_manager import BlockManager
from scheduler_svc.sched.counters import SchedulerCounters
from scheduler_svc.sched.prefix_cache import cache_computed_blocks_many
from scheduler_svc.sched.queues import RequestQueues
from scheduler_svc.sched.request import Request, RequestStatus, TokenLogprobs
from scheduler_svc.sched.sequence_group import BeamGroup, ParallelGroup


class StepOutput(NamedTuple):
    """What one step produced for one request (immutable; a NamedTuple because one is made per
    sampled request per step, and a frozen dataclass's __init__ costs several times more)."""

    req: Request
    new_token_ids: list[int]
    finished: bool
    logprobs: list[TokenLogprobs] | None = None  # one per new token, if the request asks


class ResultApplier:
    """Applies each step's result to the requests, in plan order (one call per plan).

    What it keeps true, once `apply` returns:
    - each request the plan sampled for that still runs has its oldest placeholder turned
      into the sampled token(s); a token for a request that ended meanwhile (a stop, an abort)
      is dropped;
    - a request whose token is a stop (EOS or stop id after min_tokens, max_tokens,
      max_model_len) is finished, so its blocks are free before the next plan;
    - with prefix caching, every full block the step computed is offered to the cache before
      anything is freed; a speculating request's computed count is back to what the executor
      kept (its accepted proposals);
    - a sequence group's hidden samples (a parallel-sampling parent's, a beam's) reach no
      stream: they fork children or feed the beam search, whose decisions move requests
      through the queues.
    Beyond its settings it holds no state: it changes requests and, through its methods only,
    the queues.
    """

    def __init__(self, queues: RequestQueues, block_manager: BlockManager,
                 counters: SchedulerCounters, max_model_len: int, *,
                 enable_prefix_caching: bool, num_speculative_tokens: int):
        self._queues = queues
        self._block_manager = block_manager
        self._counters = counters
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.num_speculative_tokens = num_speculative_tokens

    def apply(self, plan: StepPlan, result: StepResult) -> list[StepOutput]:
        """Apply `plan`'s result: its sampled tokens; finish requests that hit a stop."""
        self._counters.num_steps += 1
        requests, running = self._queues.requests, RequestStatus.RUNNING
        if self.num_speculative_tokens:
            self._settle_proposals(plan, result)
        if self.enable_prefix_caching:
            # The step wrote its blocks: full ones become reusable, before anything is freed.
            cache_computed_blocks_many(self._block_manager, [
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
                    self._queues.finish(req, status)
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
            if req.group is not None:
                self._queues.forget_group_if_done(req.group)
        self._counters.num_generated_tokens += num_generated
        for req_id, ids in result.proposals:  # the draft model's, for the next step
            if (req := requests.get(req_id)) is not None:
                req.draft_proposals = (req.num_tokens, ids)
        return outputs

    def _on_hidden_sample(self, req: Request, logprobs: list[tuple[int, float]] | None
                          ) -> list[Request]:
        """A parallel-sampling parent or a beam finished computing its tokens: fork the
        children, or feed the beam search. Returns the group outputs now complete."""
        queues, group = self._queues, req.group
        if isinstance(group, ParallelGroup):
            for child in group.outputs:
                queues.fork(req, child)
            queues.finish(req, RequestStatus.FINISHED_STOPPED)  # its draw is discarded
            return []
        assert isinstance(group, BeamGroup) and logprobs, f"beam {req.req_id} without logprobs"
        decision = group.on_logprobs(req, logprobs)
        if decision is None:
            return []
        for parent, child in decision.forks:  # before the parents grow: children copy their KV
            queues.fork(parent, child)
        for beam, token_id in decision.continues:
            beam.output_token_ids.append(token_id)
            beam.pending_token_ids.append(token_id)
        for beam in decision.dropped:
            queues.finish(beam, RequestStatus.FINISHED_ABORTED)
        self._counters.num_generated_tokens += len(decision.forks) + len(decision.continues)
        if decision.finals:
            queues.forget_group(group)
            self._counters.num_finished_requests += len(decision.finals)
        return decision.finals

    def _settle_proposals(self, plan: StepPlan, result: StepResult) -> None:
        """Speculative decoding: each request's computed count, which counted its proposals,
        rolled back to what the executor kept (the accepted proposals and the token before
        them), before prefix caching keys a block and the tokens are appended. The block
        table keeps its tail: the next steps' lookahead."""
        emitted = None
        for scheduled in plan.cached_reqs:
            if not scheduled.spec_token_ids:
                continue
            req = self._queues.requests.get(scheduled.req_id)
            if req is None or not req.spec_token_ids:
                continue
            if emitted is None:
                emitted = {r: len(ids) for r, ids in result.sampled}
            num_drafts = len(req.spec_token_ids)
            num_accepted = max(0, min(emitted.get(req.req_id, 1) - 1, num_drafts))
            req.num_computed_tokens -= num_drafts - num_accepted
            req.spec_token_ids = []
            self._counters.num_draft_tokens += num_drafts
            self._counters.num_accepted_tokens += num_accepted

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
            req = self._queues.requests.get(entry.req_id)
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

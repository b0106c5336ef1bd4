"""Continuous batching: which tokens of which requests the executor computes next.

Every request carries `num_computed_tokens`; a step gives each scheduled request
min(tokens it still lacks, token budget left). A decode lacks one token, a prompt lacks many, so
prefill chunks and decodes share a step and a long prompt spreads over several steps.

Invariants between plans (one plan is in flight at a time):
- `running` is sorted by arrival (oldest first), so `running[-1]` is the newest: the
  preemption victim. `waiting` is FCFS with preempted requests put back at the front.
- every running request has a block table covering its computed tokens; waiting ones have none.
- `_executor_req_ids` are the requests whose state the executor holds: sent as NewRequest and
  not since reported finished or preempted. Only these appear in CachedRequest, finished and
  preempted lists.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from protos.plan import CachedRequest, NewRequest, StepPlan, StepResult
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.request import Request, RequestStatus


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request."""

    req: Request
    new_token_ids: list[int]
    finished: bool


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self._executor_req_ids: set[str] = set()
        self._pending_finished_ids: list[str] = []  # finished or aborted since the last plan
        self._pending_preempted_ids: list[str] = []
        self._next_step_id = 0
        self._in_flight: StepPlan | None = None
        # Counters for stats.
        self.num_preemptions = 0
        self.num_finished_requests = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_steps = 0

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        assert req.req_id not in self.requests, f"duplicate request id {req.req_id}"
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def abort_request(self, req_id: str) -> Request | None:
        """Finish a waiting or running request as aborted; None if it is not unfinished."""
        req = self.requests.get(req_id)
        if req is not None:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def fail_requests(self, req_ids: list[str]) -> list[Request]:
        """Finish these requests with an error: their step failed, and the executor dropped
        their state (protos.plan.ExecutorError), so they are not reported back as finished."""
        failed = [self.requests[r] for r in req_ids if r in self.requests]
        for req in failed:
            self._executor_req_ids.discard(req.req_id)
            self._finish(req, RequestStatus.FINISHED_ERROR)
        return failed

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when no token can be scheduled."""
        assert self._in_flight is None, "schedule() called with a plan still in flight"
        budget = self.max_num_batched_tokens
        new_reqs: list[NewRequest] = []
        cached_reqs: list[CachedRequest] = []
        preempted_now = False

        # 1. Running requests, oldest first: decodes (1 token) and unfinished prompt chunks.
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            new_block_ids = self.block_manager.allocate(req.req_id,
                                                        req.num_computed_tokens + num_new)
            while new_block_ids is None:
                # Out of blocks: recompute-preempt the newest request (maybe `req` itself).
                victim = self.running[-1]
                self._preempt(victim)
                preempted_now = True
                if victim is req:
                    break
                new_block_ids = self.block_manager.allocate(req.req_id,
                                                            req.num_computed_tokens + num_new)
            if new_block_ids is None:
                break  # `req` was the newest left and is now waiting
            cached_reqs.append(CachedRequest(req.req_id, new_block_ids,
                                             req.num_computed_tokens, num_new))
            self._advance(req, num_new)
            budget -= num_new
            index += 1

        # 2. Waiting requests, FCFS, while budget, sequence slots and blocks last. After a
        #    preemption admitting more would only evict someone again next step.
        while (self.waiting and budget > 0 and not preempted_now
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.block_manager.allocate(req.req_id, req.num_computed_tokens + num_new) is None:
                break  # head-of-line waits for blocks; FCFS lets no one overtake it
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.arrival)
            new_reqs.append(NewRequest(req.req_id, req.all_token_ids, req.sampling,
                                       self.block_manager.block_table(req.req_id),
                                       req.num_computed_tokens, num_new))
            self._executor_req_ids.add(req.req_id)
            self._advance(req, num_new)
            budget -= num_new

        if not new_reqs and not cached_reqs:
            return None  # nothing to run; pending finished/preempted ids ride the next plan
        plan = StepPlan(step_id=self._next_step_id, new_reqs=new_reqs, cached_reqs=cached_reqs,
                        finished_req_ids=self._pending_finished_ids,
                        preempted_req_ids=self._pending_preempted_ids)
        self._pending_finished_ids, self._pending_preempted_ids = [], []
        self._next_step_id += 1
        self._in_flight = plan
        return plan

    def update(self, result: StepResult) -> list[StepOutput]:
        """Apply the in-flight plan's sampled tokens; finish requests that hit a stop."""
        plan = self._in_flight
        assert plan is not None and plan.step_id == result.step_id, \
            f"result for step {result.step_id} does not match the plan in flight"
        self._in_flight = None
        self.num_steps += 1
        outputs: list[StepOutput] = []
        for req_id, token_ids in result.sampled:
            req = self.requests.get(req_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if req.num_computed_tokens < req.num_tokens:
                continue  # mid-prompt: the executor must not sample (protocol), ignore it
            new_token_ids: list[int] = []
            for token_id in token_ids:
                req.output_token_ids.append(token_id)
                new_token_ids.append(token_id)
                if (status := self._stop_status(req, token_id)) is not None:
                    self._finish(req, status)
                    break
            self.num_generated_tokens += len(new_token_ids)
            outputs.append(StepOutput(req, new_token_ids, req.is_finished))
        return outputs

    def abandon_in_flight(self) -> list[str]:
        """The in-flight step failed: forget it and return the ids it scheduled."""
        plan, self._in_flight = self._in_flight, None
        if plan is None:
            return []
        return [r.req_id for r in plan.new_reqs] + [r.req_id for r in plan.cached_reqs]

    # ---- helpers ---------------------------------------------------------------------------

    def _advance(self, req: Request, num_new: int) -> None:
        # Tokens count as computed once scheduled: only one plan is in flight, and a failed
        # step fails its requests, so the count never has to roll back.
        prompt_end = min(req.num_computed_tokens + num_new, req.num_prompt_tokens)
        self.num_prompt_tokens += max(0, prompt_end - req.num_computed_tokens)
        req.num_computed_tokens += num_new

    def _stop_status(self, req: Request, token_id: int) -> RequestStatus | None:
        if not req.ignore_eos and token_id in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in req.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req.req_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        if req.req_id in self._executor_req_ids:
            self._executor_req_ids.discard(req.req_id)
            self._pending_preempted_ids.append(req.req_id)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = status
        self.block_manager.free(req.req_id)
        del self.requests[req.req_id]
        self.num_finished_requests += 1
        if req.req_id in self._executor_req_ids:
            self._executor_req_ids.discard(req.req_id)
            self._pending_finished_ids.append(req.req_id)

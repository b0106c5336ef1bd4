"""The scheduler's state and every transition of it: the queues (waiting, running, swapped),
each request's status and block table, the sequence groups, and what the executor holds.

`SchedulerState` is the one owner of that state: `Scheduler` (scheduler.py) builds steps on top
of it, and `preemption.py` and the sequence groups only return decisions that these methods
apply. The invariants are in scheduler.py's docstring.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from protos.plan import StepPlan
from scheduler_svc.config import PREEMPTION_MODES
from scheduler_svc.sched.block_manager import BlockManager
from scheduler_svc.sched.request import Request, RequestStatus
from scheduler_svc.sched.sequence_group import BeamGroup, ParallelGroup, SequenceGroup


@dataclass
class InFlight:
    """A plan sent to the executor whose result has not been applied yet."""

    plan: StepPlan
    swapped_out: list[Request] = field(default_factory=list)  # victims of its swap_out


class SchedulerState:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, *,
                 enable_prefix_caching: bool = True, preemption_mode: str = "auto",
                 first_step_id: int = 0, reset_executor: bool = False,
                 num_speculative_tokens: int = 0, speculative_method: str = "ngram"):
        assert preemption_mode in PREEMPTION_MODES, preemption_mode
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.preemption_mode = preemption_mode
        self.num_speculative_tokens = num_speculative_tokens  # 0: no speculative decoding
        self.speculative_method = speculative_method  # ngram | draft (speculation.py)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.groups: dict[str, SequenceGroup] = {}  # n > 1 / beam search, by public id
        self._executor_req_ids: set[str] = set()
        self._pending_finished_ids: list[str] = []  # finished or aborted since the last plan
        self._pending_preempted_ids: list[str] = []
        self._next_step_id = first_step_id
        self._reset_executor = reset_executor  # the first plan tells the executor to drop all
        # Oldest first; at most two (overlapped scheduling, scheduler.py "Overlap").
        self._in_flight: deque[InFlight] = deque()
        # Counters for stats.
        self.num_preemptions = 0
        self.num_swap_outs = 0  # preemptions by swap (the rest recomputed)
        self.num_finished_requests = 0
        self.num_prompt_tokens = 0  # prompt tokens computed (cache hits are not)
        self.num_generated_tokens = 0
        self.num_steps = 0
        self.prefix_cache_queries = 0  # tokens of admitted requests looked up in the cache
        self.prefix_cache_hits = 0  # of those, tokens found cached
        self.num_draft_tokens = 0  # proposals verified (speculative decoding)
        self.num_accepted_tokens = 0  # of those, accepted

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        assert req.req_id not in self.requests, f"duplicate request id {req.req_id}"
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def add_group(self, group: SequenceGroup) -> None:
        """Queue the sequences of one public request (scheduler_svc.sched.sequence_group)."""
        assert group.req_id not in self.groups, f"duplicate request id {group.req_id}"
        self.groups[group.req_id] = group
        for req in group.initial_requests():
            self.add_request(req)

    def abort_request(self, req_id: str) -> Request | None:
        """Finish an unfinished request as aborted; None if there is no such request. A
        group's sequences are aborted together, with `abort_group`."""
        req = self.requests.get(req_id)
        if req is not None and req.group is None:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            return req
        return None

    def abort_group(self, req_id: str) -> list[Request]:
        """Abort every sequence of a group; returns its outputs that had not finished."""
        group = self.groups.get(req_id)
        return self._end_group(group, RequestStatus.FINISHED_ABORTED) if group else []

    def fail_requests(self, req_ids: list[str]) -> list[Request]:
        """Finish these requests with an error: their step failed, and the executor dropped
        their state (protos.plan.ExecutorError), so they are not reported back as finished."""
        failed = [self.requests[r] for r in req_ids if r in self.requests]
        for req in failed:
            self._executor_req_ids.discard(req.req_id)
            self._finish(req, RequestStatus.FINISHED_ERROR)
        # A group cannot go on without one of its sequences: the whole request fails.
        for group in {id(r.group): r.group for r in failed if r.group is not None}.values():
            failed += self._end_group(group, RequestStatus.FINISHED_ERROR)
        return failed

    def running_ids(self) -> list[str]:
        return [r.req_id for r in self.running]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_beam_search(self) -> bool:
        return any(isinstance(g, BeamGroup) for g in self.groups.values())

    @property
    def next_step_id(self) -> int:
        return self._next_step_id

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def oldest_in_flight(self) -> StepPlan | None:
        """The plan whose result comes next (the executor runs plans in order)."""
        return self._in_flight[0].plan if self._in_flight else None
    # ---- transitions shared by the phases of a step ------------------------------------------

    def _start_running(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=lambda r: r.arrival)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.SWAPPED:
            self.swapped.remove(req)
        req.status = status
        self.block_manager.free(req.req_id)
        del self.requests[req.req_id]
        if req.group is None or req in req.group.outputs:  # not a parent or a beam
            self.num_finished_requests += 1
        if req.req_id in self._executor_req_ids:
            self._executor_req_ids.discard(req.req_id)
            self._pending_finished_ids.append(req.req_id)

    # ---- sequence groups: the scheduler applies what a group decides -----------------------

    def _fork(self, parent: Request, child: Request) -> None:
        """`child` takes over `parent`'s computed tokens on shared blocks (ref counts + 1) and
        runs from the next step, sent to the executor as a new request with the forked table."""
        assert child.req_id not in self.requests, f"request id {child.req_id} is in use"
        self.block_manager.fork(parent.req_id, child.req_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.block_keys = list(parent.block_keys)  # the child's tokens extend the parent's
        self.requests[child.req_id] = child
        self._start_running(child)

    def _on_hidden_sample(self, req: Request, logprobs: list[tuple[int, float]] | None
                          ) -> list[Request]:
        """A parallel-sampling parent or a beam finished computing its tokens: fork the
        children, or feed the beam search. Returns the group outputs now complete."""
        group = req.group
        if isinstance(group, ParallelGroup):
            for child in group.outputs:
                self._fork(req, child)
            self._finish(req, RequestStatus.FINISHED_STOPPED)  # its draw is discarded
            return []
        assert isinstance(group, BeamGroup) and logprobs, f"beam {req.req_id} without logprobs"
        decision = group.on_logprobs(req, logprobs)
        if decision is None:
            return []
        for parent, child in decision.forks:  # before the parents grow: children copy their KV
            self._fork(parent, child)
        for beam, token_id in decision.continues:
            beam.output_token_ids.append(token_id)
            beam.pending_token_ids.append(token_id)
        for beam in decision.dropped:
            self._finish(beam, RequestStatus.FINISHED_ABORTED)
        self.num_generated_tokens += len(decision.forks) + len(decision.continues)
        if decision.finals:
            self.groups.pop(group.req_id, None)
            self.num_finished_requests += len(decision.finals)
        return decision.finals

    def _restart_beam_search(self, group: BeamGroup) -> None:
        """Free every beam and queue the search again from its prompt."""
        for beam in group.beams:
            if self.requests.get(beam.req_id) is beam:
                self._finish(beam, RequestStatus.FINISHED_ABORTED)
        root = group.restart()
        assert root.req_id not in self.requests, f"request id {root.req_id} is in use"
        self.requests[root.req_id] = root
        self.waiting.appendleft(root)

    def _end_group(self, group: SequenceGroup, status: RequestStatus) -> list[Request]:
        """Finish every sequence of `group` with `status` (abort, error); returns the outputs
        that had not finished, each of which owes its stream a last message."""
        self.groups.pop(group.req_id, None)
        pending = [r for r in group.outputs if not r.is_finished]
        for req in group.members():
            if self.requests.get(req.req_id) is req:
                self._finish(req, status)
        for req in pending:  # result holders and children not forked yet were never scheduled
            req.status = status
        return pending

"""The executor as the scheduler knows it: which requests it holds, what the next plan must tell
it, and the plans it is running.

    schedule() ──make_plan──> in flight: [step N, step N+1] ──complete(N)──> update()
                              (oldest first: the executor runs and answers them in order)

A plan is a diff against what the executor holds (docs/architecture.md, "The plan is a diff"),
so the scheduler must know exactly what that is: this is its record.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from protos.plan import CachedRequest, NewRequest, StepPlan
from scheduler_svc.sched.request import Request


@dataclass
class InFlight:
    """A plan sent to the executor whose result has not been applied yet."""

    plan: StepPlan
    swapped_out: list[Request] = field(default_factory=list)  # victims of its swap_out


class ExecutorView:
    """What one executor connection holds and has yet to be told, and its plans in flight.

    Invariants:
    - `held_req_ids` are the requests whose state the executor holds: sent whole (a
      NewRequest) and not since reported finished or preempted, nor dropped by the executor
      itself (a failed step). Only these may appear in a plan's CachedRequest, finished and
      preempted lists; anything else is sent whole.
    - `pending_finished_ids` / `pending_preempted_ids` are held requests that finished / were
      preempted since the last plan, each once; the next plan carries them and empties them
      (an empty step carries nothing: they wait for the next plan that runs).
    - the plans in flight are oldest first, with consecutive step ids from `first_step_id`;
      a result completes only the oldest (the executor runs plans in order).
    - only the first plan carries `reset` (the executor drops what it held before).
    """

    def __init__(self, first_step_id: int = 0, reset_executor: bool = False):
        # Read-only outside: changed through mark_sent / mark_finished / mark_preempted / forget.
        self.held_req_ids: set[str] = set()
        self.pending_finished_ids: list[str] = []  # finished or aborted since the last plan
        self.pending_preempted_ids: list[str] = []
        self._next_step_id = first_step_id
        self._reset_executor = reset_executor  # the first plan tells the executor to drop all
        self._in_flight: deque[InFlight] = deque()

    # ---- what the executor holds -----------------------------------------------------------

    def mark_sent(self, req_id: str) -> None:
        """Sent whole (NewRequest): the executor holds it now, or replaces its copy."""
        self.held_req_ids.add(req_id)

    def mark_finished(self, req_id: str) -> None:
        """Finished or aborted: the next plan tells the executor, if it holds the request."""
        if req_id in self.held_req_ids:
            self.held_req_ids.discard(req_id)
            self.pending_finished_ids.append(req_id)

    def mark_preempted(self, req_id: str) -> None:
        """Preempted: the next plan tells the executor, if it holds the request."""
        if req_id in self.held_req_ids:
            self.held_req_ids.discard(req_id)
            self.pending_preempted_ids.append(req_id)

    def forget(self, req_id: str) -> None:
        """The executor dropped the request itself (its step failed): nothing to tell it."""
        self.held_req_ids.discard(req_id)

    # ---- plans -----------------------------------------------------------------------------

    def make_plan(self, *, new_reqs: list[NewRequest], cached_reqs: list[CachedRequest],
                  block_copies: list[tuple[int, int]], swap_out: list[tuple[int, int]],
                  swap_in: list[tuple[int, int]], swapped_out: list[Request],
                  offload_out: list[tuple[int, int]] | None = None,
                  offload_in: list[tuple[int, int]] | None = None,
                  offload_keys: list[str] | None = None) -> StepPlan:
        """The next step's plan with what the executor must be told, now in flight."""
        plan = StepPlan(step_id=self._next_step_id, new_reqs=new_reqs,
                        cached_reqs=cached_reqs,
                        finished_req_ids=self.pending_finished_ids,
                        preempted_req_ids=self.pending_preempted_ids,
                        block_copies=block_copies, swap_out=swap_out,
                        swap_in=swap_in, offload_out=offload_out or [],
                        offload_in=offload_in or [], offload_keys=offload_keys or [],
                        reset=self._reset_executor)
        self._reset_executor = False
        self.pending_finished_ids, self.pending_preempted_ids = [], []
        self._next_step_id += 1
        self._in_flight.append(InFlight(plan, swapped_out))
        return plan

    @property
    def next_step_id(self) -> int:
        return self._next_step_id

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def oldest_plan(self) -> StepPlan | None:
        """The plan whose result comes next (the executor runs plans in order)."""
        return self._in_flight[0].plan if self._in_flight else None

    def newest_plan(self) -> StepPlan | None:
        return self._in_flight[-1].plan if self._in_flight else None

    def complete(self, step_id: int) -> StepPlan:
        """The oldest plan, whose result (for `step_id`) has come: no longer in flight."""
        assert self._in_flight and self._in_flight[0].plan.step_id == step_id, \
            f"result for step {step_id} does not match the oldest plan in flight"
        return self._in_flight.popleft().plan

    def abandon_oldest(self) -> InFlight | None:
        """The oldest plan failed: no longer in flight, and no result will come."""
        return self._in_flight.popleft() if self._in_flight else None

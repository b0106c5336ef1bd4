"""The scheduler's requests: where each unfinished one is (waiting, running, swapped), the
sequence groups they serve, and every move between those places, with the block table and the
executor's copy following each move.

    add ──> waiting ──admit──> running ──finish──> gone (blocks freed, executor told;
             ^   ^              │  │ ^             a request leaves from any queue)
             │   └─recompute────┘  │ └──swap_in─────┐
             │                     └───swap out──> swapped
             └── requeue_swapped (its step failed) ─┘

A forked child (n > 1, a beam picked twice) joins `running` directly, on its parent's blocks.
The planner (scheduler.py) decides who moves and when, and `preemption.py` how a victim leaves;
the sequence groups decide forks, continuations and drops (`BeamDecision`), which the result
applier (step_results.py) carries out here. Nothing else changes these queues.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence

from scheduler_svc.sched.block_manager import BlockManager
from scheduler_svc.sched.counters import SchedulerCounters
from scheduler_svc.sched.executor_view import ExecutorView
from scheduler_svc.sched.request import Request, RequestStatus
from scheduler_svc.sched.sequence_group import BeamGroup, SequenceGroup


class RequestQueues:
    """Every unfinished request of one Scheduler, and its moves.

    Invariants (between calls; the attributes are read-only outside, changed by the methods):
    - `requests` holds every unfinished request by id, and each is in exactly the queue its
      status names: `waiting` (WAITING), `running` (RUNNING), `swapped` (SWAPPED). A finished
      request is in none, and so are a beam search's result holders and the children of a
      parallel-sampling parent until the fork.
    - `running` and `swapped` are sorted by arrival (oldest first); `waiting` is FCFS, with
      recompute-preempted requests and restarted beam searches put back at the front.
    - a waiting request has no block table, a running one a GPU table, a swapped one a CPU
      table. Tables change kind only here: `admit` makes one (cached prefix + fresh blocks),
      `preempt` swaps it out or frees it, `swap_in` brings it back, `fork` shares the parent's,
      `finish` frees it. The planner only grows the tables of running requests.
    - a request that finishes or is preempted is reported to the executor view, which tells
      the executor in the next plan if it holds the request.
    - `groups` holds the sequence groups being served (n > 1, beam search), by public id,
      until their last output finishes or they end together (abort, error).
    """

    def __init__(self, block_manager: BlockManager, executor_view: ExecutorView,
                 counters: SchedulerCounters):
        self._block_manager = block_manager
        self._executor_view = executor_view
        self._counters = counters
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.groups: dict[str, SequenceGroup] = {}  # n > 1 / beam search, by public id

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
            self.finish(req, RequestStatus.FINISHED_ABORTED)
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
            self._executor_view.forget(req.req_id)
            self.finish(req, RequestStatus.FINISHED_ERROR)
        # A group cannot go on without one of its sequences: the whole request fails.
        for group in {id(r.group): r.group for r in failed if r.group is not None}.values():
            failed += self._end_group(group, RequestStatus.FINISHED_ERROR)
        return failed

    def stop_request(self, req_id: str) -> None:
        """Finish a sequence as stopped (its text completed a stop string); no-op if it
        already finished."""
        req = self.requests.get(req_id)
        if req is None:
            return
        self.finish(req, RequestStatus.FINISHED_STOPPED)
        if req.group is not None:
            self.forget_group_if_done(req.group)

    def running_ids(self) -> list[str]:
        return [r.req_id for r in self.running]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_beam_search(self) -> bool:
        return any(isinstance(g, BeamGroup) for g in self.groups.values())

    # ---- moves the planner makes ---------------------------------------------------------

    def admit(self, req: Request, num_tokens: int, cached_block_ids: Sequence[int]) -> bool:
        """Move the head of `waiting` to running with a new table for `num_tokens` tokens,
        starting with `cached_block_ids`; False (nothing changed) if too few blocks are free."""
        assert req is self.waiting[0], f"{req.req_id} is not the head of the waiting queue"
        if self._block_manager.allocate_new(req.req_id, num_tokens, cached_block_ids) is None:
            return False
        self.waiting.popleft()
        self._start_running(req)
        return True

    def swap_in(self, req: Request) -> list[tuple[int, int]]:
        """Move the head of `swapped` back to running (the caller checked that its blocks
        fit: `preemption.swap_in_fits`); returns the (cpu, gpu) block pairs to copy."""
        assert req is self.swapped[0], f"{req.req_id} is not the oldest swapped request"
        self.swapped.pop(0)
        pairs = self._block_manager.swap_in([req.req_id])
        assert pairs is not None, "swap_in_fits checked the free blocks"
        self._start_running(req)
        return pairs

    def preempt(self, req: Request, mode: str) -> list[tuple[int, int]]:
        """Take a running request off the GPU, by "swap" (its table to the CPU pool; it joins
        `swapped`, returning the (gpu, cpu) pairs to copy) or "recompute" (its blocks freed; it
        goes back to the front of `waiting` with nothing computed). A beam's preemption ends
        its whole search instead: `restart_beam_search`."""
        self.running.remove(req)
        swap_out: list[tuple[int, int]] = []
        if mode == "swap":
            pairs = self._block_manager.swap_out([req.req_id])
            assert pairs is not None, "preemption_mode swaps only into a CPU pool with room"
            swap_out = pairs
            req.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, req, key=lambda r: r.arrival)
        else:
            self._block_manager.free(req.req_id)
            req.status = RequestStatus.WAITING
            req.num_computed_tokens = 0
            self.waiting.appendleft(req)
        req.num_preemptions += 1
        self._executor_view.mark_preempted(req.req_id)
        return swap_out

    def restart_beam_search(self, group: BeamGroup) -> None:
        """Free every beam and queue the search again from its prompt."""
        for beam in group.beams:
            if self.requests.get(beam.req_id) is beam:
                self.finish(beam, RequestStatus.FINISHED_ABORTED)
        root = group.restart()
        assert root.req_id not in self.requests, f"request id {root.req_id} is in use"
        self.requests[root.req_id] = root
        self.waiting.appendleft(root)

    def requeue_swapped(self, req: Request) -> None:
        """A request swapped out by a step that failed may have no KV on the CPU: it starts
        over by recompute, at the front of `waiting`. No-op unless it is still swapped."""
        if req.status is RequestStatus.SWAPPED:
            self.swapped.remove(req)
            self._block_manager.free(req.req_id)
            req.status, req.num_computed_tokens = RequestStatus.WAITING, 0
            self.waiting.appendleft(req)

    # ---- moves a step's result makes ----------------------------------------------------

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Out of its queue and `requests`, its blocks freed, its end told to the executor."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.SWAPPED:
            self.swapped.remove(req)
        req.status = status
        self._block_manager.free(req.req_id)
        del self.requests[req.req_id]
        if req.group is None or req in req.group.outputs:  # not a parent or a beam
            self._counters.num_finished_requests += 1
        self._executor_view.mark_finished(req.req_id)

    def fork(self, parent: Request, child: Request) -> None:
        """`child` takes over `parent`'s computed tokens on shared blocks (ref counts + 1) and
        runs from the next step, sent to the executor as a new request with the forked table."""
        assert child.req_id not in self.requests, f"request id {child.req_id} is in use"
        self._block_manager.fork(parent.req_id, child.req_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.block_keys = list(parent.block_keys)  # the child's tokens extend the parent's
        self.requests[child.req_id] = child
        self._start_running(child)

    def forget_group(self, group: SequenceGroup) -> None:
        """The group's outputs are all out (its search ended, or its last sequence finished)."""
        self.groups.pop(group.req_id, None)

    def forget_group_if_done(self, group: SequenceGroup) -> None:
        if group.is_done():
            self.forget_group(group)

    # ---- helpers ---------------------------------------------------------------------------

    def _start_running(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=lambda r: r.arrival)

    def _end_group(self, group: SequenceGroup, status: RequestStatus) -> list[Request]:
        """Finish every sequence of `group` with `status` (abort, error); returns the outputs
        that had not finished, each of which owes its stream a last message."""
        self.groups.pop(group.req_id, None)
        pending = [r for r in group.outputs if not r.is_finished]
        for req in group.members():
            if self.requests.get(req.req_id) is req:
                self.finish(req, status)
        for req in pending:  # result holders and children not forked yet were never scheduled
            req.status = status
        return pending

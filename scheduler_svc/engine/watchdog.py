"""The stall watchdog: defense in depth against a request the engine holds but never serves.

Every accepted request must end with a final message or a status (admission, the scheduler
and the output processor are built so that it does). Should a bug break that, a stream would
otherwise wait until the client's deadline with no word; the watchdog ends it instead, with
INTERNAL and an ERROR log line naming its state, and counts it (`num_stalled_requests`).

A request *progresses* when a plan computes tokens for any of its sequences (their computed
counts, summed, change) or its stream receives tokens. It is *stalled* when it has not
progressed for `timeout_s` while the engine could have served it:
- an executor is connected (requests of a lost executor wait for the next one under
  --resume-timeout instead), and
- it is not simply waiting its turn: a request all of whose sequences are queued (waiting or
  swapped out) when a step has completed since the last check is behind requests that
  progress, as FCFS intends, and its clock starts again. Queued while no step completes (the
  engine idle), it is stalled: with nothing else running it should have been admitted.
A request the scheduler does not hold at all (none of its sequences queued or running, yet its
stream not ended) is stalled once the time passes, whatever else runs.

The engine calls `check` between turns of its loop; a step in flight is covered by
--executor-timeout, not by this. Checks run at most once a second and cost one pass over the
scheduler's requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from scheduler_svc.engine.registry import ClientRequest, Registry
from scheduler_svc.errors import FolioError
from scheduler_svc.sched.request import Request, RequestStatus
from scheduler_svc.sched.scheduler import Scheduler

log = structlog.get_logger("folio.scheduler.watchdog")

CHECK_INTERVAL_S = 1.0
QUEUED = (RequestStatus.WAITING, RequestStatus.SWAPPED)


class RequestStalled(FolioError):
    """The watchdog ended a request that made no progress (a server bug)."""


@dataclass
class _Progress:
    mark: tuple[int, int]  # (tokens computed by the scheduler, tokens streamed)
    since: float  # monotonic time `mark` was first seen


class StallWatchdog:
    """Tracks each registered request's progress mark; `check` returns the stalled ones.

    Invariant: `_progress` holds an entry exactly for the requests seen at the last check
    (entries of requests that left the registry are dropped at the next one)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s  # 0: off
        self.num_stalled = 0
        self._progress: dict[str, _Progress] = {}
        self._next_check = 0.0
        self._num_steps = -1  # the scheduler's step count at the last check

    def check(self, now: float, registry: Registry, sched: Scheduler | None
              ) -> list[tuple[ClientRequest, FolioError]]:
        """The requests to end now, each with its status; logs an ERROR line for each."""
        if not self.timeout_s or now < self._next_check:
            return []
        self._next_check = now + CHECK_INTERVAL_S
        if sched is None:  # no executor: --resume-timeout governs; progress restarts after
            self._progress.clear()
            return []
        steps_completing = sched.counters.num_steps != self._num_steps  # since the last check
        self._num_steps = sched.counters.num_steps
        by_client: dict[str, list[Request]] = {}
        for req in sched.queues.requests.values():
            by_client.setdefault(req.req_id.split("/", 1)[0], []).append(req)
        stalled, progress = [], {}
        for client in registry:
            reqs = by_client.get(client.req_id, [])
            mark = (sum(r.num_computed_tokens for r in reqs),
                    sum(len(s.token_ids) for s in client.sequences))
            seen = self._progress.get(client.req_id)
            entry = seen if seen is not None and seen.mark == mark else _Progress(mark, now)
            queued = bool(reqs) and all(r.status in QUEUED for r in reqs)
            if queued and steps_completing:
                entry.since = now  # waiting its turn behind requests that progress
            if now - entry.since >= self.timeout_s:
                stalled.append((client, self._report(client, reqs, sched, now - entry.since)))
            else:
                progress[client.req_id] = entry
        self._progress = progress
        self.num_stalled += len(stalled)
        return stalled

    def _report(self, client: ClientRequest, reqs: list[Request], sched: Scheduler,
                idle_s: float) -> FolioError:
        bm, queues = sched.block_manager, sched.queues
        waiting_ids = [r.req_id for r in queues.waiting]
        sequences = [dict(seq_id=r.req_id, status=r.status.value,
                          num_computed_tokens=r.num_computed_tokens, num_tokens=r.num_tokens,
                          num_blocks=bm.num_blocks_held(r.req_id),
                          queue_position=(waiting_ids.index(r.req_id)
                                          if r.status is RequestStatus.WAITING else None))
                     for r in reqs]
        state = ("not held by the scheduler" if not reqs
                 else "/".join(sorted({r.status.value for r in reqs})))
        log.error("request stalled: ended by the watchdog", req_id=client.req_id,
                  seconds_without_progress=round(idle_s, 1), state=state, sequences=sequences,
                  num_streamed=[len(s.token_ids) for s in client.sequences],
                  num_running=len(queues.running), num_waiting=len(queues.waiting),
                  num_swapped=len(queues.swapped), kv_blocks_free=bm.num_free_blocks,
                  num_in_flight=sched.num_in_flight)
        return RequestStalled(
            f"the request made no progress for {idle_s:.0f}s ({state}) while the server could "
            "serve it, and was ended by the stall watchdog (--stall-timeout); this is a server "
            "bug: retry, and report it with the server log")

"""Server statistics: the GetServerStats fields, cumulative across executors, and the periodic
INFO stats line (queue sizes, free KV and swap blocks, preemptions, the prefix cache's hit rate,
speculative decoding's acceptance rate and throughput since the last line)."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import structlog

from scheduler_svc.sched.counters import SchedulerCounters

if TYPE_CHECKING:
    from protos.plan import StepPlan, StepResult
    from scheduler_svc.engine.metrics import RequestMetrics
    from scheduler_svc.sched.scheduler import Scheduler

log = structlog.get_logger("folio.scheduler.stats")

# Cumulative ServerStats counters (Scheduler.counters fields), kept across executor changes.
COUNTERS = tuple(f.name for f in dataclasses.fields(SchedulerCounters))


def server_stats(s: Scheduler | None, past_totals: dict[str, int], executor_connected: bool
                 ) -> dict[str, int | bool]:
    """ServerStats fields: `past_totals` holds the counters of schedulers retired with their
    executor (`retire_counters`), so the counters cover every executor this server has had."""
    totals = {k: v + (getattr(s.counters, k) if s else 0) for k, v in past_totals.items()}
    bm = s.block_manager if s else None
    queries = totals["prefix_cache_queries"]
    queues = s.queues if s else None
    return dict(num_running=len(queues.running) if queues else 0,
                num_waiting=len(queues.waiting) if queues else 0,
                num_swapped=len(queues.swapped) if queues else 0,
                kv_blocks_total=bm.num_blocks if bm else 0,
                kv_blocks_free=bm.num_free_blocks if bm else 0,
                swap_blocks_total=bm.num_cpu_blocks if bm else 0,
                swap_blocks_free=bm.num_free_cpu_blocks if bm else 0,
                kv_groups=bm.num_groups if bm else 0,
                kv_blocks_windowed=bm.num_windowed_blocks if bm else 0,
                host_kv_blocks_total=bm.num_host_blocks if bm else 0,
                host_kv_blocks_cached=bm.num_cached_host_blocks if bm else 0,
                prefix_cache_hit_rate=totals["prefix_cache_hits"] / queries if queries else 0.0,
                executor_connected=executor_connected, **totals)


def spec_acceptance_rate(stats: dict[str, int | bool]) -> float | None:
    """Of the proposals verified so far, the fraction accepted; None before any (speculation
    off, or no request could speculate yet)."""
    drafts = stats["num_draft_tokens"]
    return stats["num_accepted_tokens"] / drafts if drafts else None


def retire_counters(past_totals: dict[str, int], scheduler: Scheduler) -> None:
    """Add a scheduler's counters to `past_totals` as it goes (with its executor, or rebuilt
    after an error); its unfinished requests live on in the registry and count when they end
    on a later scheduler."""
    for name in COUNTERS:
        past_totals[name] += getattr(scheduler.counters, name)


class StatsLogger:
    """The periodic INFO line, and the step time totals of ServerStats (`step_times`):
    executor busy (running steps), executor idle (waiting for the next plan while work was
    queued) and scheduler busy (planning steps and applying results), in seconds.

    A step's reported idle time counts only if the executor had work queued when it finished
    the step before: the plan went out while another was in flight (overlap), or requests
    were unfinished when the previous result was applied. A server with nothing to do is not
    an idle executor.

    It also feeds each applied step's token count to the Prometheus metrics (`metrics`)."""

    def __init__(self, interval_s: float, metrics: RequestMetrics | None = None):
        self.interval_s = interval_s
        self.metrics = metrics
        self._last_log = time.monotonic()
        self._num_tokens = 0  # scheduled (prefill + decode) since the last line
        self._num_sampled = 0
        self._num_steps = 0
        self._busy_s = self._idle_s = 0.0  # executor, since the last line
        self.executor_busy_s = self.executor_idle_s = self.scheduler_busy_s = 0.0  # totals
        self.num_overlapped_steps = 0  # plans sent while the previous one was still running
        self._work_queued = False  # unfinished requests when the last result was applied
        self._idle_counts: dict[int, bool] = {}  # step id in flight -> its idle time counts

    def plan_sent(self, step_id: int, overlapped: bool) -> None:
        self.num_overlapped_steps += overlapped
        self._idle_counts[step_id] = overlapped or self._work_queued

    def step_failed(self, step_id: int) -> None:
        self._idle_counts.pop(step_id, None)

    def went_idle(self) -> None:
        self._work_queued = False

    def record_step(self, plan: StepPlan, result: StepResult, scheduler_s: float,
                    work_queued: bool) -> None:
        """A step's result was applied (taking `scheduler_s`); `work_queued`: requests are
        still unfinished after it."""
        idle_s = result.idle_time_s if self._idle_counts.pop(plan.step_id, False) else 0.0
        self._work_queued = work_queued
        self._num_tokens += plan.num_scheduled_tokens
        if self.metrics is not None:
            self.metrics.step(plan.num_scheduled_tokens)
        self._num_sampled += len(result.sampled)
        self._num_steps += 1
        self._busy_s += result.execute_time_s
        self._idle_s += idle_s
        self.executor_busy_s += result.execute_time_s
        self.executor_idle_s += idle_s
        self.scheduler_busy_s += scheduler_s

    def step_times(self) -> dict[str, float]:
        return dict(executor_busy_s=self.executor_busy_s, executor_idle_s=self.executor_idle_s,
                    scheduler_busy_s=self.scheduler_busy_s)

    def maybe_log_server(self, stats: dict[str, int | bool]) -> None:
        """`maybe_log` from the ServerStats fields (`server_stats`)."""
        self.maybe_log(num_running=stats["num_running"], num_waiting=stats["num_waiting"],
                       num_swapped=stats["num_swapped"], num_free_blocks=stats["kv_blocks_free"],
                       num_free_swap_blocks=stats["swap_blocks_free"],
                       num_preemptions=stats["num_preemptions"],
                       prefix_cache_hit_rate=stats["prefix_cache_hit_rate"],
                       spec_acceptance_rate=spec_acceptance_rate(stats))

    def maybe_log(self, num_running: int, num_waiting: int, num_free_blocks: int,
                  num_swapped: int = 0, num_free_swap_blocks: int = 0, num_preemptions: int = 0,
                  prefix_cache_hit_rate: float = 0.0,
                  spec_acceptance_rate: float | None = None) -> None:
        """The INFO line, at most once per interval; `spec_acceptance_rate` appears in it
        only when given (a server that has verified proposals)."""
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.interval_s:
            return
        # An idle server stays quiet: a line only when something happened or is queued.
        if self._num_steps or num_running or num_waiting or num_swapped:
            spec = ({} if spec_acceptance_rate is None
                    else {"spec_acceptance_rate": round(spec_acceptance_rate, 3)})
            log.info("stats", num_running=num_running, num_waiting=num_waiting,
                     num_swapped=num_swapped, num_free_blocks=num_free_blocks,
                     num_free_swap_blocks=num_free_swap_blocks, num_preemptions=num_preemptions,
                     prefix_cache_hit_rate=round(prefix_cache_hit_rate, 3), **spec,
                     num_steps=self._num_steps,
                     tokens_per_s=round(self._num_tokens / elapsed, 1),
                     generated_tokens_per_s=round(self._num_sampled / elapsed, 1),
                     executor_idle_fraction=round(
                         self._idle_s / (self._idle_s + self._busy_s or 1.0), 3))
        self._last_log = now
        self._num_tokens = self._num_sampled = self._num_steps = 0
        self._busy_s = self._idle_s = 0.0

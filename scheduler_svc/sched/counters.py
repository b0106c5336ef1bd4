"""What a Scheduler has done, counted for ServerStats, the periodic INFO line and the
Prometheus counters; every field is a ServerStats counter (`scheduler_svc.engine.stats.COUNTERS`
lists them from here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerCounters:
    """Cumulative counts of one Scheduler (one executor connection); they only grow. The
    Scheduler owns them and hands them to the parts that count: the planner (preemptions,
    prompt tokens, prefix cache), the queues (finished requests) and the result applier (steps,
    generated tokens, speculation). The engine adds a retired scheduler's counts to its totals
    (`engine.stats.retire_counters`)."""

    num_preemptions: int = 0
    num_swap_outs: int = 0  # preemptions by swap (the rest recomputed)
    num_finished_requests: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (cache hits are not)
    num_generated_tokens: int = 0
    num_steps: int = 0
    prefix_cache_queries: int = 0  # tokens of admitted requests looked up in the cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    prefix_cache_host_hits: int = 0  # of those, tokens copied back from the host tier
    num_draft_tokens: int = 0  # proposals verified (speculative decoding)
    num_accepted_tokens: int = 0  # of those, accepted
    num_window_released_blocks: int = 0  # KV blocks released as sliding windows moved on

"""The periodic INFO stats line: queue sizes, free KV and swap blocks, preemptions, the prefix
cache's hit rate (cumulative) and throughput since the last line."""

from __future__ import annotations

import time

import structlog

log = structlog.get_logger("folio.scheduler.stats")


class StatsLogger:
    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._last_log = time.monotonic()
        self._num_tokens = 0  # scheduled (prefill + decode) since the last line
        self._num_sampled = 0
        self._num_steps = 0

    def record_step(self, num_scheduled_tokens: int, num_sampled: int) -> None:
        self._num_tokens += num_scheduled_tokens
        self._num_sampled += num_sampled
        self._num_steps += 1

    def maybe_log(self, num_running: int, num_waiting: int, num_free_blocks: int,
                  num_swapped: int = 0, num_free_swap_blocks: int = 0, num_preemptions: int = 0,
                  prefix_cache_hit_rate: float = 0.0) -> None:
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.interval_s:
            return
        # An idle server stays quiet: a line only when something happened or is queued.
        if self._num_steps or num_running or num_waiting or num_swapped:
            log.info("stats", num_running=num_running, num_waiting=num_waiting,
                     num_swapped=num_swapped, num_free_blocks=num_free_blocks,
                     num_free_swap_blocks=num_free_swap_blocks, num_preemptions=num_preemptions,
                     prefix_cache_hit_rate=round(prefix_cache_hit_rate, 3),
                     num_steps=self._num_steps,
                     tokens_per_s=round(self._num_tokens / elapsed, 1),
                     generated_tokens_per_s=round(self._num_sampled / elapsed, 1))
        self._last_log = now
        self._num_tokens = self._num_sampled = self._num_steps = 0

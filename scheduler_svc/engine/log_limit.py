"""Warnings about what peers send, at most one line per kind per interval.

A peer that floods the channel with garbage (or a stream of failed handshakes) must not flood
the log or stall the event loop writing it: the first occurrence is logged, the rest of the
interval only counted, and the next line says how many were suppressed.
"""

from __future__ import annotations

import time

import structlog


class LogLimiter:
    def __init__(self, logger: structlog.typing.FilteringBoundLogger, interval_s: float = 10.0):
        self._log = logger
        self.interval_s = interval_s
        self._last: dict[str, float] = {}  # kind -> time of its last line
        self._suppressed: dict[str, int] = {}
        self.counts: dict[str, int] = {}  # every occurrence, logged or not (for tests, stats)

    def warning(self, kind: str, **fields) -> bool:
        """Log `kind` (the event text) unless it was logged less than `interval_s` ago;
        True if a line was written."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return False
        if len(self._last) > 256:  # kinds are few fixed strings; never let them pile up
            self._last.clear()
        self._last[kind] = now
        num_suppressed = self._suppressed.pop(kind, 0)
        if num_suppressed:
            fields["num_suppressed"] = num_suppressed
        self._log.warning(kind, **fields)
        return True

"""The speculative-decoding counters from the Scheduler to every place that reports them:
GetServerStats (cumulative across executors), the periodic INFO line's acceptance rate and the
Prometheus counters. The real executor's proposals and acceptances reach the same counters in
tests/e2e/engine/test_e2e_speculative.py."""

from __future__ import annotations

import asyncio

import structlog
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from protos.folio.v1 import generator_pb2 as pb
from scheduler_svc.engine.metrics import RequestMetrics
from scheduler_svc.engine.stats import COUNTERS, StatsLogger, retire_counters, server_stats
from scheduler_svc.sched.block_manager import BlockManager
from scheduler_svc.sched.scheduler import Scheduler


def make_scheduler() -> Scheduler:
    return Scheduler(BlockManager(8, 4, 0), max_num_seqs=4, max_num_batched_tokens=32,
                     max_model_len=32)


def test_counters_cover_every_executor_and_fit_server_stats():
    past_totals = dict.fromkeys(COUNTERS, 0)
    first = make_scheduler()
    assert server_stats(first, past_totals, True)["num_draft_tokens"] == 0
    first.counters.num_draft_tokens, first.counters.num_accepted_tokens = 12, 7
    retire_counters(past_totals, first)  # its executor went away; a new scheduler follows
    second = make_scheduler()
    second.counters.num_draft_tokens, second.counters.num_accepted_tokens = 5, 5
    stats = server_stats(second, past_totals, True)
    assert (stats["num_draft_tokens"], stats["num_accepted_tokens"]) == (12 + 5, 7 + 5)
    assert server_stats(None, past_totals, False)["num_draft_tokens"] == 12
    message = pb.ServerStats(**stats)  # what GetServerStats answers
    assert (message.num_draft_tokens, message.num_accepted_tokens) == (17, 12)


def _stats_line(stats: dict) -> dict:
    logger = StatsLogger(interval_s=0.0)
    with structlog.testing.capture_logs() as logs:
        logger.maybe_log_server(stats)
    (line,) = [e for e in logs if e["event"] == "stats"]
    return line


def test_the_info_line_has_the_acceptance_rate_once_proposals_were_verified():
    s = make_scheduler()
    base = dict.fromkeys(COUNTERS, 0)
    stats = server_stats(s, base, True) | {"num_running": 1}
    assert "spec_acceptance_rate" not in _stats_line(stats)  # speculation off, or no draft yet
    s.counters.num_draft_tokens, s.counters.num_accepted_tokens = 8, 3
    stats = server_stats(s, base, True) | {"num_running": 1}
    assert _stats_line(stats)["spec_acceptance_rate"] == round(3 / 8, 3)


def test_prometheus_counters_equal_the_server_stats():
    s = make_scheduler()
    s.counters.num_draft_tokens, s.counters.num_accepted_tokens = 9, 4
    metrics = RequestMetrics("tiny", export=True)

    async def scrape() -> str:
        loop = asyncio.get_running_loop()
        # The engine adds the watchdog's count (Engine.server_stats).
        metrics.serve_stats_from(loop, lambda: server_stats(s, dict.fromkeys(COUNTERS, 0), True)
                                 | {"num_stalled_requests": 2})
        return generate_latest(metrics.registry).decode()

    families = {f.name: f for f in text_string_to_metric_families(asyncio.run(scrape()))}
    counters = s.counters
    for name, value in (("vllm:spec_decode_num_draft_tokens", counters.num_draft_tokens),
                        ("vllm:spec_decode_num_accepted_tokens", counters.num_accepted_tokens),
                        ("folio:num_stalled_requests", 2)):
        family = families[name]
        assert family.type == "counter"
        (sample,) = family.samples
        assert sample.name == f"{name}_total"
        assert sample.labels == {"model_name": "tiny", "engine": "0"}
        assert sample.value == value

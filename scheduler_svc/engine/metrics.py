"""Request latencies (the INFO line of every finished sequence) and the Prometheus metrics of
`/metrics`, under vLLM's names, types, labels and bucket edges so that dashboards and
autoscalers built for vLLM read Folio unchanged (docs/architecture.md, "Metrics").

Latencies are per sequence a client sees (n > 1: each output; beam search: each result), on
the monotonic clock, from the request's arrival (its Generate call, before tokenization):

    arrival --queue--> first scheduled --prefill--> first token --...--> last token  finished
    |<------ time to first token (TTFT) ---------------->|  |<- one gap per later message ->|
    |<--------------------------- e2e latency ------------------------------------------->|

Where the figures come from, so that the engine loop pays almost nothing for them:
- counters and gauges ARE the GetServerStats figures (stats.py), never a second copy of a
  count that could drift: at scrape time `_ServerStatsCollector`, in the HTTP server's thread,
  has the event loop build them (`Engine.server_stats`, as the RPC does) between two of its
  callbacks, so they are consistent and current, and cost nothing between scrapes;
- histograms and `vllm:request_success` are observed on the event loop where the figure
  arises: a step's result applied (`step`), a message streamed (`tokens`), a sequence ended
  (`finished`). prometheus_client's metrics take their own locks, so a scrape is safe.
Without --metrics-port nothing is observed; the timestamps and the INFO line remain.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Iterator

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protos.plan import StepPlan
from scheduler_svc.engine.registry import ClientRequest, Registry, SequenceOutput
from scheduler_svc.sched.request import RequestStatus

log = structlog.get_logger("folio.scheduler.requests")

# vLLM's labels: the served model name, and the engine index (Folio has one engine: "0").
LABEL_NAMES = ("model_name", "engine")
ENGINE_INDEX = "0"
# Bucket edges of vLLM v1's PrometheusStatLogger, in seconds or tokens.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's finished_reason values for the endings Folio has (RequestStatus values are the same).
FINISH_REASONS = {s: s.value for s in (RequestStatus.FINISHED_STOPPED,
                                       RequestStatus.FINISHED_LENGTH,
                                       RequestStatus.FINISHED_ABORTED,
                                       RequestStatus.FINISHED_ERROR)}

# (name, help, GetServerStats field(s)): counters, exported with the _total suffix.
COUNTERS = (
    ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission.",
     "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Of the looked-up prompt tokens, those found in the prefix "
     "cache.", "prefix_cache_hits"),
    ("folio:prefix_cache_host_hits", "Of the prefix-cache hits, the tokens found in the host "
     "tier (--kv-offloading-size) and copied back instead of recomputed.",
     "prefix_cache_host_hits"),
    ("vllm:num_preemptions", "Requests preempted (by recompute or by swap) to free KV blocks.",
     "num_preemptions"),
    ("vllm:prompt_tokens", "Prompt tokens computed (prefix-cache hits are not; a recompute "
     "counts again).", "num_prompt_tokens"),
    ("vllm:generation_tokens", "Tokens generated.", "num_generated_tokens"),
    ("vllm:spec_decode_num_draft_tokens", "Speculative decoding: proposed tokens verified.",
     "num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Speculative decoding: of the verified proposed "
     "tokens, those accepted.", "num_accepted_tokens"),
    ("folio:num_window_released_blocks", "KV blocks released while their request ran because "
     "they fell out of every sliding window of their layers.", "num_window_released_blocks"),
    ("folio:num_stalled_requests", "Requests ended by the stall watchdog (--stall-timeout): "
     "each one is a server bug, logged at ERROR.", "num_stalled_requests"),
)


def kv_cache_usage(stats: dict) -> float:
    """The fraction of KV blocks in use; cached blocks nobody holds count as free."""
    total = stats["kv_blocks_total"]
    return 1.0 - stats["kv_blocks_free"] / total if total else 0.0


# A scrape waits this long for the event loop; a loop stuck longer answers HTTP 500.
STATS_TIMEOUT_S = 5.0


class _ServerStatsCollector(Collector):
    """The counters and gauges: GetServerStats' figures, built on the event loop."""

    def __init__(self, label_values: list[str]):
        self.label_values = label_values
        # (the loop, its function returning the ServerStats fields); None until serving.
        self.source: tuple[asyncio.AbstractEventLoop, Callable[[], dict]] | None = None

    def _server_stats(self) -> dict | None:
        if self.source is None:
            return None
        loop, server_stats = self.source
        try:
            if asyncio.get_running_loop() is loop:
                return server_stats()  # scraped from the loop itself (generate_latest)
        except RuntimeError:
            pass  # no loop in this thread: the HTTP server's
        done: concurrent.futures.Future[dict] = concurrent.futures.Future()

        def build() -> None:
            try:
                done.set_result(server_stats())
            except Exception as e:  # the scrape gets it as an HTTP 500, the loop goes on
                done.set_exception(e)

        loop.call_soon_threadsafe(build)
        return done.result(timeout=STATS_TIMEOUT_S)

    def collect(self) -> Iterator[Metric]:
        stats = self._server_stats()
        if stats is None:
            return
        gauges = (
            ("vllm:num_requests_running", "Requests in the running batch.",
             stats["num_running"]),
            ("vllm:num_requests_waiting", "Requests waiting to run (queued, preempted, or "
             "swapped out to the CPU pool).", stats["num_waiting"] + stats["num_swapped"]),
            ("vllm:kv_cache_usage_perc", "KV cache usage: the fraction of KV blocks in use "
             "(1 = all).", kv_cache_usage(stats)),
            ("folio:kv_blocks_windowed", "KV blocks held by layers with a sliding window "
             "(bounded by the windows, not the context).", stats["kv_blocks_windowed"]),
            ("folio:host_kv_blocks_cached", "Blocks of the prefix cache's host tier holding a "
             "cached block.", stats["host_kv_blocks_cached"]),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=LABEL_NAMES)
            family.add_metric(self.label_values, value)
            yield family
        for name, doc, field in COUNTERS:
            family = CounterMetricFamily(name, doc, labels=LABEL_NAMES)
            family.add_metric(self.label_values, stats[field])
            yield family


class RequestMetrics:
    """Timestamps requests as they go, logs each finished sequence, and (with `export`) keeps
    the Prometheus metrics in `registry`, a registry of this server's own, never the process
    global one (two servers in one process must not mix their figures)."""

    def __init__(self, model_name: str, export: bool):
        self.export = export
        self.registry = CollectorRegistry()
        labels = [model_name, ENGINE_INDEX]
        self._collector = _ServerStatsCollector(labels)
        self.registry.register(self._collector)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABEL_NAMES, registry=self.registry,
                             buckets=buckets).labels(*labels)

        self._ttft = histogram("vllm:time_to_first_token_seconds", "Seconds from a request's "
                               "arrival to its first token.", TTFT_BUCKETS)
        self._tpot = histogram("vllm:time_per_output_token_seconds", "Seconds between a "
                               "sequence's successive streamed tokens (one per message after "
                               "the first).", TPOT_BUCKETS)
        self._e2e = histogram("vllm:e2e_request_latency_seconds", "Seconds from a request's "
                              "arrival to its end.", REQUEST_LATENCY_BUCKETS)
        self._queue = histogram("vllm:request_queue_time_seconds", "Seconds from a request's "
                                "arrival to its first scheduling (its whole life if it never "
                                "ran).", REQUEST_LATENCY_BUCKETS)
        self._iteration = histogram("vllm:iteration_tokens_total", "Tokens computed by one "
                                    "step (prompt chunks and decodes).", ITERATION_TOKEN_BUCKETS)
        success = Counter("vllm:request_success", "Sequences ended, by finish reason.",
                          [*LABEL_NAMES, "finished_reason"], registry=self.registry)
        # Every reason is exported from the start, at 0 (vLLM does the same).
        self._success = {status: success.labels(*labels, reason)
                         for status, reason in FINISH_REASONS.items()}

    def serve_stats_from(self, loop: asyncio.AbstractEventLoop,
                         server_stats: Callable[[], dict]) -> None:
        """The counters and gauges come from `server_stats()` (the ServerStats fields), called
        on `loop`, which must be the loop that runs the engine."""
        self._collector.source = (loop, server_stats)

    def scheduled(self, plan: StepPlan, registry: Registry) -> None:
        """`plan` is going out: the requests it starts (new, or re-sent after a preemption,
        a swap-in or a fork) that had never been scheduled end their queue time now."""
        now = None
        for new in plan.new_reqs:
            # A group's sequences are "<id>/<suffix>" (sequence_group.py); a client id never
            # contains '/'.
            client = registry.get(new.req_id.partition("/")[0])
            if client is not None and client.scheduled_at is None:
                client.scheduled_at = now = now or time.monotonic()

    def step(self, num_scheduled_tokens: int) -> None:
        if self.export:
            self._iteration.observe(num_scheduled_tokens)

    def tokens(self, client: ClientRequest, seq: SequenceOutput, now: float) -> None:
        """`seq` streamed a message with token ids at `now`."""
        if seq.first_token_at is None:
            seq.first_token_at = now
            if self.export:
                self._ttft.observe(now - client.arrival_time)
        elif self.export:
            self._tpot.observe(now - seq.last_token_at)
        seq.last_token_at = now

    def finished(self, client: ClientRequest, seq: SequenceOutput, status: RequestStatus,
                 now: float | None = None) -> None:
        """`seq` ended with `status` (its last message, or the stream's error)."""
        now = time.monotonic() if now is None else now
        e2e_s = now - client.arrival_time
        scheduled_at = client.scheduled_at if client.scheduled_at is not None else now
        queue_s = scheduled_at - client.arrival_time
        if self.export:
            self._success[status].inc()
            self._e2e.observe(e2e_s)
            self._queue.observe(queue_s)
        num_output_tokens = len(seq.token_ids)
        first = seq.first_token_at
        ttft_s = first - client.arrival_time if first is not None else None
        # vLLM's mean time per output token: the decode time over the tokens after the first.
        tpot_s = ((seq.last_token_at - first) / (num_output_tokens - 1)
                  if first is not None and num_output_tokens > 1 else None)
        log.info("request finished", req_id=client.req_id, index=seq.index,
                 finish_reason=FINISH_REASONS[status],
                 num_prompt_tokens=len(client.params.prompt_token_ids),
                 num_cached_tokens=seq.num_cached_tokens, num_output_tokens=num_output_tokens,
                 queue_s=round(queue_s, 4), ttft_s=_round(ttft_s), tpot_s=_round(tpot_s),
                 e2e_s=round(e2e_s, 4))


def _round(seconds: float | None) -> float | None:
    return round(seconds, 4) if seconds is not None else None

"""/metrics on the real SchedulerServer (null-model executor, real ZeroMQ and gRPC): vLLM's
names and types, counters equal to GetServerStats, histogram counts equal to what finished,
the per-request INFO line, and HTTP input that cannot stop the server. The same checks against
a real `folio serve` are in tests/e2e/api/test_e2e_metrics.py."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import subprocess
import sys
import urllib.request

import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.channel import SchedulerEnd
from protos.folio.v1 import generator_pb2 as pb
from scheduler_svc.api.metrics_http import MAX_CONNECTIONS
from scheduler_svc.api.server import SchedulerServer
from scheduler_svc.config import SchedulerConfig, config_from_argv
from tests.conftest import ROOT, free_port
from tests.fixtures.metrics_scrape import (
    check_against_server_stats,
    check_labels,
    finished_by_reason,
    histogram_count,
    scrape,
)
from tests.scheduler.grpc_harness import collect, gen_request, running_server
from tests.scheduler.null_executor import make_hello

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def metrics_harness(tiny_tokenizer):
    async with running_server(tiny_tokenizer, metrics_port=0) as h:
        yield h


def stats_dict(stats: pb.ServerStats) -> dict:
    return {f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields}


async def wait_idle(harness) -> dict:
    for _ in range(500):
        stats = await harness.stats()
        if stats.num_running == stats.num_waiting == stats.num_swapped == 0 \
                and stats.kv_blocks_free == stats.kv_blocks_total:
            return stats_dict(stats)
        await asyncio.sleep(0.02)
    raise AssertionError(f"never idle: {stats}")


async def fetch(harness) -> dict:
    """Scrape from a thread: the server's event loop runs in this one."""
    return await asyncio.to_thread(scrape, harness.server.metrics_server.url)


async def test_metrics_match_server_stats_after_a_cache_hit_and_preemptions(metrics_harness):
    h = metrics_harness
    # 10 blocks of 4: two 16-token prompts growing to 32 tokens cannot both finish without a
    # preemption, and the third waits.
    await h.serve(hello=make_hello(num_kv_blocks=10))
    before = await fetch(h)
    assert histogram_count(before, "vllm:e2e_request_latency_seconds") == 0
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks the second call finds cached
    await collect(h.stub.Generate(gen_request(prompt, max_tokens=3, ignore_eos=True)))
    again = await collect(h.stub.Generate(gen_request(prompt + [40], max_tokens=3,
                                                      ignore_eos=True)))
    assert again[-1].usage.cached_tokens == 20
    pressure = [list(range(50 + 20 * i, 66 + 20 * i)) for i in range(3)]
    streams = await asyncio.gather(*(collect(h.stub.Generate(gen_request(
        p, max_tokens=16, ignore_eos=True))) for p in pressure))
    assert all(s[-1].finish_reason == pb.FINISH_REASON_LENGTH for s in streams)
    stats = await wait_idle(h)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] >= 20, stats

    samples = await fetch(h)
    check_labels(samples, h.server.served_model_name)
    check_against_server_stats(samples, stats)
    assert finished_by_reason(samples) == {"stop": 0, "length": 5, "abort": 0, "error": 0}
    num_finished = stats["num_finished_requests"]
    assert num_finished == 5
    for family in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                   "vllm:time_to_first_token_seconds"):
        assert histogram_count(samples, family) == num_finished, family
    # One gap per streamed message after each sequence's first (one token per message here).
    assert histogram_count(samples, "vllm:time_per_output_token_seconds") == \
        stats["num_generated_tokens"] - num_finished


async def test_aborts_and_cancels_count_as_abort(metrics_harness):
    h = metrics_harness
    await h.serve(step_delay_s=0.05)
    call = h.stub.Generate(pb.GenerateRequest(request_id="victim",
                                              token_ids=pb.TokenIds(ids=[5, 6]),
                                              sampling=pb.SamplingParams(max_tokens=50)))
    await call.read()
    assert (await h.stub.Abort(pb.AbortRequest(request_id="victim"))).found
    await collect(call)
    cancelled = h.stub.Generate(gen_request(list(range(10, 30)), max_tokens=50))
    await cancelled.read()
    cancelled.cancel()
    stats = await wait_idle(h)
    samples = await fetch(h)
    assert finished_by_reason(samples) == {"stop": 0, "length": 0, "abort": 2, "error": 0}
    check_against_server_stats(samples, stats)
    assert histogram_count(samples, "vllm:e2e_request_latency_seconds") == 2


async def test_every_sequence_of_n_is_counted(metrics_harness):
    # (Beam search needs logprobs the null executor does not compute: tests/e2e has it.)
    h = metrics_harness
    await h.serve()
    num_sequences = 3
    responses = await collect(h.stub.Generate(gen_request(
        list(range(10, 20)), max_tokens=5, ignore_eos=True, n=num_sequences, temperature=1.0,
        seed=1)))
    assert len({r.index for r in responses}) == num_sequences
    stats = await wait_idle(h)
    samples = await fetch(h)
    check_against_server_stats(samples, stats)
    assert finished_by_reason(samples)["length"] == num_sequences
    for family in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                   "vllm:time_to_first_token_seconds"):
        assert histogram_count(samples, family) == num_sequences, family


async def test_a_finished_request_logs_its_latencies_without_its_prompt(metrics_harness):
    h = metrics_harness
    await h.serve()
    secret = "the prompt text must never reach an INFO line"
    with structlog.testing.capture_logs() as logs:
        responses = await collect(h.stub.Generate(pb.GenerateRequest(
            text=secret, sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True))))
    finished = [e for e in logs if e["event"] == "request finished"]
    assert len(finished) == 1, logs
    line = finished[0]
    assert line["log_level"] == "info"
    assert line["req_id"] == responses[0].request_id and line["finish_reason"] == "length"
    assert (line["num_prompt_tokens"], line["num_output_tokens"]) == \
        (responses[-1].usage.prompt_tokens, 4)
    assert 0 <= line["queue_s"] <= line["ttft_s"] <= line["e2e_s"] and line["tpot_s"] >= 0
    assert not any(secret in str(v) for e in logs for v in e.values()), logs


def raw_exchange(port: int, payload: bytes) -> bytes:
    """Send `payload`, close our side, read whatever the server answers (b"" if it closed
    or reset the connection unanswered)."""
    chunks = []
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, BrokenPipeError):
            pass
        except OSError as e:  # closed before our shutdown reached it: nothing to read
            if e.errno != errno.ENOTCONN:
                raise
    return b"".join(chunks)


BAD_REQUESTS = [
    b"\x00\xff garbage \r\n\r\n",
    b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",  # request line over the 64 KiB limit
    b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 200 + b"\r\n",  # 100+ headers
    b"POST /metrics HTTP/1.1\r\nContent-Length: 99999999\r\n\r\nshort",
    b"GET /metrics?name[]=%ff%fe HTTP/1.0\r\n\r\n",
    b"GET /metrics HTTP/1.0\r\nAccept-Encoding: gzip\r\n\r\n",
    b"GET /metrics HTTP/1.0\r\nAccept: application/openmetrics-text; version=99\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\n",  # ends mid-request
    b"",
]


async def test_bad_http_requests_do_not_stop_the_server(metrics_harness):
    h = metrics_harness
    await h.serve()
    server = h.server.metrics_server
    for payload in BAD_REQUESTS:
        await asyncio.to_thread(raw_exchange, server.port, payload)
    # Connections held open past the limit are closed, and served again once they go.
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        refused = await asyncio.to_thread(raw_exchange, server.port,
                                          b"GET /metrics HTTP/1.0\r\n\r\n")
        assert refused == b""
    finally:
        for s in idle:
            s.close()
    ok = False
    for _ in range(100):  # the held connections' threads notice their clients went away
        answer = await asyncio.to_thread(raw_exchange, server.port,
                                         b"GET /metrics HTTP/1.0\r\n\r\n")
        if ok := answer.startswith(b"HTTP/1.0 200"):
            break
        await asyncio.sleep(0.05)
    assert ok
    responses = await collect(h.stub.Generate(gen_request(max_tokens=2)))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    samples = await fetch(h)
    assert finished_by_reason(samples)["length"] == 1


@pytest.fixture(scope="module")
def metrics_port(tiny_tokenizer):
    """A server in a thread of its own (hypothesis drives the test from this one)."""
    import threading

    ready, stop, result = threading.Event(), None, {}

    async def serve():
        nonlocal stop
        stop = asyncio.Event()
        async with running_server(tiny_tokenizer, metrics_port=0) as h:
            await h.serve()
            result["port"] = h.server.metrics_server.port
            ready.set()
            await stop.wait()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the metrics server did not start"
    yield result["port"]
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.one_of(
    st.binary(max_size=2000),
    st.builds(lambda method, path, rest: method + b" " + path + b" HTTP/1.1\r\n" + rest,
              st.sampled_from([b"GET", b"POST", b"HEAD", b"DELETE", b"\x00"]),
              st.binary(min_size=1, max_size=300), st.binary(max_size=500))))
def test_http_fuzz_never_stops_the_server(metrics_port, payload):
    raw_exchange(metrics_port, payload)
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        assert r.status == 200 and b"vllm:num_requests_running" in r.read()


async def test_metrics_are_off_by_default(harness):
    assert harness.server.metrics_server is None
    await harness.serve()
    await collect(harness.stub.Generate(gen_request(max_tokens=2)))
    count = harness.server.metrics.registry.get_sample_value(
        "vllm:e2e_request_latency_seconds_count",
        {"model_name": harness.server.served_model_name, "engine": "0"})
    assert count == 0  # timed for the INFO line, not observed


def test_metrics_port_flag():
    assert config_from_argv(["--metrics-port", "9100"]).metrics_port == 9100
    assert config_from_argv([]).metrics_port is None
    with pytest.raises(ValueError, match="--metrics-port must be between 0 and 65535"):
        SchedulerConfig(metrics_port=70000)


def test_a_busy_metrics_port_ends_start_up_with_a_message(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = subprocess.run(
            [sys.executable, "-m", "scheduler_svc", "--model", str(tiny_model_dir), "--port",
             "0", "--executor-address", f"tcp://127.0.0.1:{free_port()}",
             "--metrics-port", str(taken.getsockname()[1])],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1, done.stderr
    assert "cannot bind the metrics port" in done.stderr


async def test_a_busy_metrics_port_fails_at_start(tiny_tokenizer):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = SchedulerConfig(model=str(tiny_tokenizer.model_dir), port=0,
                                 metrics_port=taken.getsockname()[1])
        channel = SchedulerEnd("tcp://127.0.0.1:*", None)
        try:
            with pytest.raises(OSError):
                SchedulerServer(config, tiny_tokenizer, channel)
        finally:
            channel.close()


async def test_unknown_paths_get_the_metrics_and_grpc_is_untouched(metrics_harness):
    h = metrics_harness
    await h.serve()
    url = h.server.metrics_server.url.replace("/metrics", "/anything")
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
    assert b"vllm:num_requests_waiting" in body
    assert (await h.stub.GetServerStats(pb.GetServerStatsRequest())).executor_connected

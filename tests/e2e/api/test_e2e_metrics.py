"""/metrics from a real `folio serve` (scheduler process + executor child, the tiny random
model): after a prefix-cache hit and forced preemptions, prometheus_client's parser finds every
vLLM family with its type, the counters equal GetServerStats, the latency histograms counted
every finished request, each of which logged its latencies (no prompt) at INFO; and bad HTTP
on the metrics port stops nothing."""

from __future__ import annotations

import asyncio
import json
import random
import socket

from client import AsyncFolioClient, FolioClient
from tests.conftest import TINY_RANDOM, free_port
from tests.e2e.e2e_util import wait_idle
from tests.fixtures.metrics_scrape import (
    check_against_server_stats,
    check_labels,
    finished_by_reason,
    histogram_count,
    scrape,
)

BLOCK_SIZE = 16
MAX_TOKENS = 24
# Long prompts in a 16-block pool, admitted in 32-token chunks: any two of them running
# together run it dry (tests/e2e/engine/test_e2e_memory.py), so preemption happens whatever order
# they arrive in.
PRESSURE_LENGTHS = (1, 17, 40, 113, 120, 128)
FIRST_TOKEN_ID = 5  # ids below are the tiny tokenizer's special tokens


def prompts(vocab_size: int, lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)] for n in lengths]


async def generate_all(address: str, token_prompts: list[list[int]]) -> None:
    async with AsyncFolioClient(address, timeout=120) as client:
        done = await asyncio.gather(*(client.generate_text(
            token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            for p in token_prompts))
    assert all(c.finish_reason == "length" for c in done), done


def finished_lines(log_text: str) -> list[dict]:
    return [json.loads(line) for line in log_text.splitlines()
            if '"request finished"' in line]


async def test_metrics_of_a_real_server_match_its_stats(folio_server):
    metrics_port = free_port()
    args = ["--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "16",
            "--max-num-batched-tokens", "32", "--log-format", "json",
            "--metrics-port", str(metrics_port)]
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with folio_server(model=TINY_RANDOM, args=args) as server:
        with FolioClient(server.address, timeout=60) as client:
            info = client.model_info()
        vocab_size = info["vocab_size"]
        system, = prompts(vocab_size, (40,), seed=1)  # two full blocks the second call reuses
        tails = prompts(vocab_size, (5, 7), seed=2)
        for tail in tails:
            await generate_all(server.address, [system + tail])
        await generate_all(server.address, prompts(vocab_size, PRESSURE_LENGTHS, seed=3))
        async with AsyncFolioClient(server.address, timeout=120) as client:
            beams = await client.generate_choices(token_ids=system, beam_width=3, n=2,
                                                  max_tokens=4, ignore_eos=True)
        assert len(beams) == 2
        # Garbage on the metrics port changes nothing.
        with socket.create_connection(("127.0.0.1", metrics_port), timeout=5) as s:
            s.sendall(b"\x16\x03\x01 not http\r\n\r\n")
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        stats = wait_idle(server.address)
        samples = await asyncio.to_thread(scrape, url)
        log_text = server.log_tail(10**7)

    num_streamed = len(tails) + len(PRESSURE_LENGTHS)
    num_sequences = num_streamed + len(beams)  # a beam search's results count one each
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] >= 2 * BLOCK_SIZE, stats
    assert stats["num_finished_requests"] == num_sequences
    check_labels(samples, info["model_name"])
    check_against_server_stats(samples, stats)
    assert finished_by_reason(samples) == {"stop": 0, "length": num_sequences, "abort": 0,
                                           "error": 0}
    for family in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                   "vllm:time_to_first_token_seconds"):
        assert histogram_count(samples, family) == num_sequences, family
    # One gap per token after each streamed request's first (the executor streams one per
    # step); a beam search sends its results whole, in one message each.
    assert histogram_count(samples, "vllm:time_per_output_token_seconds") == \
        num_streamed * (MAX_TOKENS - 1)

    lines = finished_lines(log_text)
    assert len(lines) == num_sequences, lines
    for line in lines:
        assert line["level"] == "info" and line["finish_reason"] == "length"
        assert line["num_output_tokens"] in (MAX_TOKENS, 4)
        assert 0 <= line["queue_s"] <= line["ttft_s"] <= line["e2e_s"], line
        assert not {"prompt", "text", "prompt_token_ids"} & line.keys(), line

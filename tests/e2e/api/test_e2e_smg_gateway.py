"""The Shepherd Model Gateway (`smg launch`, offline) in front of two `folio serve` replicas of
the real default model (SmolLM2-135M-Instruct), called with the official `openai` client.

The gateway gets no --model-path: it reads the model facts with GetModelInfo and rebuilds the
tokenizer (chat template included) from the files GetTokenizer streams. Oracle: Folio's own
API on a replica (greedy chat and text completions, server stats) and each replica's own
Prometheus /metrics (where the cache-aware policy sent each prompt family). The
replica-killing test runs last: it leaves one replica.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from client import FolioClient
from tests.conftest import ROOT, free_port, stop_process_tree
from tests.e2e.e2e_util import wait_idle
from tests.fixtures.metrics_scrape import finished_by_reason, scrape, value

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(900)
MODEL = "smollm2"  # --served-model-name of both replicas: what clients ask for
GATEWAY_READY_S = 120.0
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


def smg_binary() -> str:
    return str(Path(sys.executable).parent / "smg")  # the smg package's console script


@dataclasses.dataclass
class Gateway:
    url: str
    log_path: Path
    metrics_url: str


@contextlib.contextmanager
def run_gateway(log_dir: Path, worker_addresses: list[str]):
    port, metrics_port = free_port(), free_port()
    log_path = log_dir / f"smg-{port}.log"
    argv = [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--policy", "cache_aware",
            "--worker-urls", *[f"grpc://{a}" for a in worker_addresses]]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_gateway(proc, base_url, log_path)
        yield Gateway(base_url, log_path, f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        stop_process_tree(proc)


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def wait_gateway(proc: subprocess.Popen, base_url: str, log_path: Path) -> None:
    """Until both workers are healthy and the served model's tokenizer is loaded (the
    gateway lists workers as healthy before that)."""
    deadline = time.monotonic() + GATEWAY_READY_S
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited with {proc.returncode}:\n{log_path.read_text()}")
        with contextlib.suppress(OSError, ValueError):  # not listening yet, or not ready
            last = http_get(f"{base_url}/v1/tokenizers")
            models = json.loads(http_get(f"{base_url}/v1/models"))
            if MODEL in last and any(m["id"] == MODEL for m in models.get("data", [])):
                return
        time.sleep(0.5)
    raise TimeoutError(f"gateway not ready ({last[:300]}):\n{log_path.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def metrics_urls() -> list[str]:
    """Each replica's Prometheus /metrics (the `replicas` fixture's --metrics-port)."""
    return [f"http://127.0.0.1:{free_port()}/metrics" for _ in range(2)]


@pytest.fixture(scope="module")
def replicas(folio_server, metrics_urls):
    def args(metrics_url: str) -> list[str]:
        port = metrics_url.split(":")[-1].removesuffix("/metrics")
        return ["--served-model-name", MODEL, "--metrics-port", port]

    with folio_server(model=None, args=args(metrics_urls[0])) as a:  # converts the model
        with folio_server(model=None, args=args(metrics_urls[1])) as b:
            yield [a, b]


@pytest.fixture(scope="module")
def gateway(replicas, tmp_path_factory):
    with run_gateway(tmp_path_factory.mktemp("smg"), [r.address for r in replicas]) as gw:
        yield openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", timeout=120,
                            max_retries=0)


def folio_chat(server, **sampling):
    with FolioClient(server.address, timeout=120) as client:
        return client.generate_text(messages=CHAT, temperature=0.0, **sampling)


def test_chat_matches_folio(gateway, replicas):
    expected = folio_chat(replicas[0], max_tokens=16)
    response = gateway.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                               max_tokens=16)
    (choice,) = response.choices
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == expected.usage["prompt_tokens"]
    assert response.usage.completion_tokens == len(expected.token_ids)


def test_chat_stream_with_usage(gateway, replicas):
    expected = folio_chat(replicas[0], max_tokens=16)
    chunks = list(gateway.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=16, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == len(expected.token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_match_folio(gateway, replicas, stream):
    with FolioClient(replicas[0].address, timeout=120) as client:
        expected = client.generate_text(PROMPT, temperature=0.0, max_tokens=12)
    response = gateway.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                          max_tokens=12, stream=stream)
    if stream:
        text = "".join(c.choices[0].text for c in response if c.choices)
    else:
        text = response.choices[0].text
        assert response.usage.completion_tokens == len(expected.token_ids)
    assert text == expected.text


def test_stop_string_ends_the_request_in_folio(gateway, replicas):
    with FolioClient(replicas[0].address, timeout=120) as client:
        free = client.generate_text(PROMPT, temperature=0.0, max_tokens=24, ignore_eos=True)
    words = free.text.split()
    stop = words[len(words) // 2]
    response = gateway.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                          max_tokens=400, stop=[stop],
                                          extra_body={"ignore_eos": True})
    (choice,) = response.choices
    assert choice.finish_reason == "stop"
    assert choice.text == free.text[:free.text.index(stop)]
    assert response.usage.completion_tokens < 24  # Folio stopped, not ran to max_tokens


def test_chat_logprobs(gateway):
    response = gateway.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                               max_tokens=8, logprobs=True, top_logprobs=2)
    (choice,) = response.choices
    content = choice.logprobs.content
    # an answer that ends on EOS counts it as a completion token but shows no entry for it
    num_eos = 1 if choice.finish_reason == "stop" else 0
    assert len(content) == response.usage.completion_tokens - num_eos
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        # greedy: the token drawn is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_n_choices(gateway):
    response = gateway.chat.completions.create(model=MODEL, messages=CHAT, temperature=0.9,
                                               max_tokens=8, n=3, seed=7, logprobs=True)
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    # usage sums the choices (an EOS counts, without a logprobs entry)
    assert response.usage.completion_tokens == sum(
        len(c.logprobs.content) + (c.finish_reason == "stop") for c in response.choices)


def test_json_schema_output(gateway):
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    response = gateway.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=60,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": schema}})
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)


def test_usage_reports_cached_tokens(gateway):
    messages = [{"role": "system", "content": "You answer in one word. " * 20}, *CHAT]
    first = gateway.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            max_tokens=2)
    second = gateway.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                             max_tokens=2)
    # cache-aware routing sends the repeated prompt to the replica that holds its prefix
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens == second.usage.prompt_tokens
    assert 0 < cached < second.usage.prompt_tokens


# Cache-aware routing, read from each replica's own /metrics. Folio publishes its prefix
# cache on SubscribeKvEvents, so smg's cache_aware policy routes from the replicas' real
# contents (its event-driven index: the worker whose cached blocks overlap a prompt's most,
# while loads are balanced; no overlap: a least-loaded replica). A family of prompts sent one
# after another (an idle pool: balanced) thus stays where its first request went and its
# blocks are cached. Where a new family starts is not promised, so the spread over the
# replicas is not asserted.
NUM_FAMILIES = 4
PER_FAMILY = 3
PREFIX_WORDS = 260  # about 370 tokens in the chat template: the suffixes are a few
MIN_PREFIX_HITS = 320  # prefix-cache hits, in tokens, each later request of a family makes
WORDS = ("amber basin candle delta ember fabric garnet harbor island jasper kettle lantern "
         "meadow nickel orchard pepper quarry ribbon saddle timber umber velvet walnut yarrow "
         "zephyr anchor bramble copper dune falcon glacier heron indigo juniper kelp lichen "
         "marble nectar otter pebble quartz raven sorrel thistle valley willow").split()
QUESTIONS = ("Which word comes first?", "Name one colour above.", "Summarize in two words.")


def family_messages(family: int, question: int) -> list[dict]:
    rng = random.Random(family)  # one distinct text per family
    prefix = f"Notes {family}: " + " ".join(rng.choice(WORDS) for _ in range(PREFIX_WORDS))
    return [{"role": "system", "content": prefix},
            {"role": "user", "content": QUESTIONS[question]}]


def routing_counts(replicas, metrics_urls) -> list[dict[str, float]]:
    """Per replica, once idle (every finished sequence counted): sequences ended (for any
    reason), of those aborted, and the prefix cache's queried and hit tokens."""
    counts = []
    for replica, url in zip(replicas, metrics_urls, strict=True):
        wait_idle(replica.address, timeout=30)
        samples = scrape(url)
        finished = finished_by_reason(samples)
        counts.append({
            "requests": sum(finished.values()), "aborts": finished["abort"],
            "queries": value(samples, "vllm:prefix_cache_queries",
                             "vllm:prefix_cache_queries_total"),
            "hits": value(samples, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")})
    return counts


def deltas(before: list[dict], after: list[dict]) -> list[dict[str, float]]:
    return [{k: a[k] - b[k] for k in a} for b, a in zip(before, after, strict=True)]


def test_cache_aware_routing_keeps_each_family_on_one_replica(replicas, metrics_urls,
                                                              tmp_path):
    # A gateway of its own: the families would otherwise weigh on where the shared gateway
    # sends the later tests' requests (its prefix trees, processed counts).
    with run_gateway(tmp_path, [r.address for r in replicas]) as gw:
        gateway = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", timeout=120,
                                max_retries=0)
        send_families(gateway, replicas, metrics_urls)
        # The gateway subscribed to both replicas' KV events and applied what they sent.
        log = gw.log_path.read_text()
        assert "does not implement" not in log, log[-3000:]
        assert log.count("KV event stream connected") >= 2, log[-3000:]
        with urllib.request.urlopen(gw.metrics_url, timeout=5) as response:
            metrics = response.read().decode()
        applied = [line for line in metrics.splitlines()
                   if line.startswith("smg_kv_event_batches_total")
                   and 'disposition="applied"' in line and float(line.split()[-1]) > 0]
        assert applied, [ln for ln in metrics.splitlines() if "kv_event" in ln]


def send_families(gateway, replicas, metrics_urls) -> None:
    for family in range(NUM_FAMILIES):
        before = routing_counts(replicas, metrics_urls)
        for question in range(PER_FAMILY):
            response = gateway.chat.completions.create(
                model=MODEL, messages=family_messages(family, question), max_tokens=2)
            assert response.usage.prompt_tokens >= MIN_PREFIX_HITS + 16
        counts = deltas(before, routing_counts(replicas, metrics_urls))
        landed = [i for i, d in enumerate(counts) if d["requests"]]
        assert len(landed) == 1, (family, counts)  # the whole family on one replica
        home = landed[0]
        assert counts[home]["requests"] == PER_FAMILY and counts[home]["aborts"] == 0, counts
        # Every request after the family's first found the shared prefix cached there; the
        # other replica saw none of the family's tokens.
        assert counts[home]["hits"] >= (PER_FAMILY - 1) * MIN_PREFIX_HITS, (family, counts)
        assert counts[1 - home]["queries"] == 0, (family, counts)


def running(replicas) -> int:
    total = 0
    for r in replicas:
        with FolioClient(r.address, timeout=10) as client:
            total += client.stats()["num_running"]
    return total


def test_aborted_client_stream_aborts_in_folio(gateway, replicas):
    stream = gateway.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500,
                                        stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert running(replicas) == 1
    stream.close()  # the client goes away mid-stream
    for r in replicas:
        wait_idle(r.address, timeout=30)  # the request ended and every KV block came back


def test_killed_replica_requests_complete_on_the_other(gateway, replicas):
    def complete(i: int) -> str:
        response = gateway.completions.create(model=MODEL, prompt=f"{i}: {PROMPT}",
                                              temperature=0, max_tokens=24,
                                              extra_body={"ignore_eos": True})
        return response.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, i) for i in range(8)]
        # The victim is a replica caught with requests running (smg promises no spread, so
        # either one may hold all eight).
        victim, deadline = None, time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            victim = next((r for r in replicas if running([r]) > 0), None)
            time.sleep(0.05)
        assert victim is not None, "the gateway sent neither replica anything"
        os.killpg(victim.proc.pid, signal.SIGKILL)  # no goodbye: the worker just vanishes
        victim.proc.wait(timeout=30)
        results = [f.result(timeout=300) for f in futures]
    assert results == ["length"] * 8

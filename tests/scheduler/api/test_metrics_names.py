"""/metrics keeps vLLM's colon names whatever the scraper negotiates: Prometheus 2.x asks for
OpenMetrics without naming an escaping, which prometheus_client would answer with the colons
turned into underscores. The scraper's own Accept headers are the oracle (the real Prometheus
2.42 run is tests/deploy/test_monitoring.py)."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from scheduler_svc.api.metrics_http import MetricsServer

# Prometheus 2.42's scrape Accept header, a classic-text scraper's, and Prometheus 3's.
PROMETHEUS_2 = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
TEXT = "text/plain;version=0.0.4"
PROMETHEUS_3 = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
                "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,*/*;q=0.1")


@pytest.fixture
def server():
    registry = CollectorRegistry()
    Counter("vllm:generation_tokens", "Tokens generated.", ["model_name"],
            registry=registry).labels("m").inc(3)
    metrics = MetricsServer(registry, "127.0.0.1", 0)
    metrics.start()
    try:
        yield metrics
    finally:
        metrics.stop()


def scrape(url: str, accept: str) -> tuple[str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


@pytest.mark.parametrize("accept", [PROMETHEUS_2, TEXT, PROMETHEUS_3],
                         ids=["prometheus-2", "text", "prometheus-3"])
def test_colon_names_survive_negotiation(server, accept):
    content_type, body = scrape(server.url, accept)
    samples = [line for line in body.splitlines() if line and not line.startswith("#")]
    assert 'vllm:generation_tokens_total{model_name="m"} 3.0' in samples, (content_type, body)
    assert all(line.startswith("vllm:") for line in samples), body  # _created too
    names = {sample.name for family in text_string_to_metric_families(
        body.replace("# EOF\n", "")) for sample in family.samples}
    assert "vllm:generation_tokens_total" in names and all(n.startswith("vllm:") for n in names)


def test_an_explicit_escaping_request_is_honoured(server):
    _, body = scrape(server.url, "application/openmetrics-text;version=1.0.0;"
                                 "escaping=underscores")
    assert 'vllm_generation_tokens_total{model_name="m"} 3.0' in body

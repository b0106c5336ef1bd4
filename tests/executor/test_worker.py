"""The executor process over the real channel, with the test playing the scheduler."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from protos.channel import SchedulerEnd
from protos.kv_tier_file import TierFile, read_identity
from protos.plan import (
    PROTOCOL_VERSION,
    CachedRequest,
    ExecutorError,
    Hello,
    Reject,
    SamplingSpec,
    Shutdown,
    StepResult,
    Welcome,
)
from tests.executor.harness import PlanDriver, hf_greedy, hf_top_logprobs

# Each test runs the real executor process; the test plays the scheduler.
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
RECV_TIMEOUT_S = 90.0  # the first message waits for torch import and model load


def _start(model_dir: Path, address: str, log_path: Path,
           extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "executor_svc", "--model", str(model_dir),
           "--scheduler-address", address, "--block-size", "4", "--num-kv-blocks", "64",
           "--log-format", "json", "--log-level", "debug", *extra_args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=log_path.open("w"))


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


async def _recv(sched: SchedulerEnd, timeout: float = RECV_TIMEOUT_S):
    return await asyncio.wait_for(sched.recv(), timeout)


async def test_handshake_and_generation_match_hf(checkpoint_cache, tmp_path):
    hf_model, model_dir = checkpoint_cache("qwen2")
    sched = SchedulerEnd("tcp://127.0.0.1:0")
    proc = _start(model_dir, sched.address, tmp_path / "executor.log", ("--swap-space", "0.001"))
    try:
        peer, hello = await _recv(sched)
        assert isinstance(hello, Hello)
        assert (hello.protocol_version, hello.architecture, hello.block_size,
                hello.num_kv_blocks, hello.max_model_len, hello.vocab_size) == (
            PROTOCOL_VERSION, "Qwen2ForCausalLM", 4, 64, 256, 300)
        # 0.001 GiB of fp32 blocks: k and v, per layer, 4 tokens x kv heads x head_dim.
        cfg = hf_model.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        bytes_per_block = 2 * cfg.num_hidden_layers * 4 * cfg.num_key_value_heads * head_dim * 4
        assert hello.num_swap_blocks == int(0.001 * (1 << 30)) // bytes_per_block
        assert (hello.dtype, hello.device, hello.random_weights) == ("float32", "cpu", False)
        # Unanswered, the executor says Hello again.
        t0 = time.monotonic()
        _, again = await _recv(sched, timeout=10)
        assert isinstance(again, Hello) and time.monotonic() - t0 < 5
        await sched.send(peer, Welcome(protocol_version=PROTOCOL_VERSION))

        driver = PlanDriver(num_blocks=64, seed=5)
        prompts = {"a": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], "b": [27, 18, 28, 18, 28, 45, 90]}
        num_new = 12
        generated = {r: [] for r in prompts}
        for step in range(num_new + 1):
            if step == 0:
                plan = driver.plan(new_reqs=[driver.new("a", prompts["a"], 6),  # chunked prefill
                                             driver.new("b", prompts["b"], 7)])
            elif step == 1:
                plan = driver.plan(cached_reqs=[driver.cached("a", 4)] + driver.decode_all(["b"]))
            else:
                plan = driver.plan(cached_reqs=driver.decode_all(list(prompts)))
            await sched.send(peer, plan)
            _, result = await _recv(sched, timeout=30)
            assert isinstance(result, StepResult) and result.step_id == plan.step_id
            assert result.execute_time_s > 0
            driver.record(result.sampled)
            for req_id, ids in result.sampled:
                generated[req_id].extend(ids)
            if all(len(g) >= num_new for g in generated.values()):
                break
        for req_id, prompt in prompts.items():
            assert generated[req_id][:num_new] == hf_greedy(hf_model, prompt, num_new)

        # A plan naming a request the executor never saw fails that step only.
        bad = driver.plan(cached_reqs=[CachedRequest(req_id="ghost", new_block_ids=[],
                                                     num_computed_tokens=0,
                                                     num_scheduled_tokens=1)])
        await sched.send(peer, bad)
        _, err = await _recv(sched, timeout=30)
        assert isinstance(err, ExecutorError) and err.step_id == bad.step_id
        assert "ghost" in err.message
        # ... and the executor goes on serving, with a sampled request this time.
        plan = driver.plan(new_reqs=[driver.new(
            "c", [7, 7, 7], 3,
            SamplingSpec(temperature=0.8, top_p=0.9, seed=42, num_logprobs=3))],
            finished_req_ids=list(prompts))
        await sched.send(peer, plan)
        _, result = await _recv(sched, timeout=30)
        assert isinstance(result, StepResult) and [r for r, _ in result.sampled] == ["c"]
        assert 0 <= result.sampled[0][1][0] < 300
        # Top logprobs ride the same StepResult, equal to HF's on the same tokens.
        [(req_id, top_ids, top_lps)] = result.logprobs
        hf_ids, hf_lps = hf_top_logprobs(hf_model, [7, 7, 7], 3)
        assert req_id == "c" and top_ids == hf_ids
        assert top_lps == pytest.approx(hf_lps.tolist(), abs=1e-4)

        await sched.send(peer, Shutdown())
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        _stop(proc)
        sched.close()
    log = (tmp_path / "executor.log").read_text()
    assert '"service": "executor"' in log and '"step failed"' in log


async def test_auto_dtype_of_a_bf16_checkpoint_follows_this_cpu(checkpoint_cache, tmp_path):
    """A checkpoint saved in bf16, --dtype left at auto: the executor runs bf16 where this CPU
    multiplies bf16 natively, float32 elsewhere, says which in the Hello and why in its log."""
    from kernels.cpu.runtime import has_native_bf16

    _, source_dir = checkpoint_cache("llama3")
    model_dir = Path(shutil.copytree(source_dir, tmp_path / "model"))
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "dtype": "bfloat16"}))
    sched = SchedulerEnd("tcp://127.0.0.1:0")
    proc = _start(model_dir, sched.address, tmp_path / "executor.log")
    try:
        _, hello = await _recv(sched)
        assert isinstance(hello, Hello)
        expected = "bfloat16" if has_native_bf16() else "float32"
        assert hello.dtype == expected
    finally:
        _stop(proc)
        sched.close()
    lines = [json.loads(line) for line in (tmp_path / "executor.log").read_text().splitlines()
             if '"model dtype"' in line]
    assert [(e["dtype"], "bfloat16" in e["reason"]) for e in lines] == [(expected, True)]


async def test_reject_exits_with_code_2_and_the_reason(checkpoint_cache, tmp_path):
    _, source_dir = checkpoint_cache("llama3")
    model_dir = Path(shutil.copytree(source_dir, tmp_path / "model"))
    (model_dir / "FOLIO_RANDOM_WEIGHTS").touch()
    sched = SchedulerEnd("tcp://127.0.0.1:0")
    proc = _start(model_dir, sched.address, tmp_path / "executor.log")
    try:
        peer, hello = await _recv(sched)
        assert isinstance(hello, Hello) and hello.random_weights is True
        reason = "model mismatch: this scheduler serves another-model"
        await sched.send(peer, Reject(reason=reason))
        assert await asyncio.to_thread(proc.wait, 30) == 2
    finally:
        _stop(proc)
        sched.close()
    assert reason in (tmp_path / "executor.log").read_text()


def test_bad_flags_fail_before_loading(tmp_path):
    cmd = [sys.executable, "-m", "executor_svc", "--model", str(tmp_path),
           "--kv-cache-memory", "lots"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "cannot read memory size 'lots'" in out.stderr
    # A directory that is no checkpoint: a clear start-up failure, exit code 1.
    cmd = [sys.executable, "-m", "executor_svc", "--model", str(tmp_path), "--device", "cpu"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "has no config.json" in out.stderr


@pytest.mark.parametrize("argv, message", [
    (["--model", "m", "--block-size", "12"], "power of two"),
    (["--model", "m", "--num-kv-blocks", "0"], "at least 1"),
    (["--model", "m", "--scheduler-address", "localhost:5557"], "not a ZeroMQ endpoint"),
    (["--model", "m", "--swap-space", "-1"], "must be >= 0 GiB"),
    (["--model", "m", "--swap-space", "nan"], "must be >= 0 GiB"),
    (["--model", "m", "--max-model-len", "0"], "at least 1"),
])
def test_config_errors_are_sentences(argv, message, capsys):
    from executor_svc.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


async def test_pipelined_plans_and_the_plan_behind_a_failed_step(checkpoint_cache, tmp_path):
    """Overlapped scheduling: the next plan arrives before the previous result is read. It
    counts the token the previous step appended; after a failed step, the plan queued behind
    it skips the failed request and serves the others."""
    hf_model, model_dir = checkpoint_cache("qwen2")
    sched = SchedulerEnd("tcp://127.0.0.1:0")
    proc = _start(model_dir, sched.address, tmp_path / "executor.log")
    try:
        peer, hello = await _recv(sched)
        assert isinstance(hello, Hello)
        await sched.send(peer, Welcome(protocol_version=PROTOCOL_VERSION))
        driver = PlanDriver(num_blocks=64, seed=11)
        prompt_a, prompt_b = [3, 1, 4, 1, 5, 9, 2, 6], [27, 18, 28, 18]
        plans = [driver.plan(new_reqs=[driver.new("a", prompt_a, len(prompt_a))])]
        for _ in range(2):  # decode the token the step before samples, sent before its result
            driver.num_tokens["a"] += 1
            plans.append(driver.plan(cached_reqs=[driver.cached("a", 1)]))
        for plan in plans:
            await sched.send(peer, plan)
        tokens = []
        for plan in plans:
            _, result = await _recv(sched, timeout=30)
            assert isinstance(result, StepResult) and result.step_id == plan.step_id
            assert result.idle_time_s >= 0
            tokens += [t for _, ids in result.sampled for t in ids]
        assert tokens == hf_greedy(hf_model, prompt_a, 3)

        # A step that fails (a logprobs count beyond the vocabulary), with a plan behind it
        # that names the failed request next to a healthy one.
        bad = driver.plan(new_reqs=[driver.new("d", [5, 5, 5], 3,
                                               SamplingSpec(temperature=0.0,
                                                            num_logprobs=10**6))])
        driver.num_tokens["d"] += 1
        behind = driver.plan(cached_reqs=[driver.cached("d", 1)],
                             new_reqs=[driver.new("b", prompt_b, len(prompt_b))])
        await sched.send(peer, bad)
        await sched.send(peer, behind)
        _, err = await _recv(sched, timeout=30)
        assert isinstance(err, ExecutorError) and err.step_id == bad.step_id
        _, result = await _recv(sched, timeout=30)
        assert isinstance(result, StepResult) and result.step_id == behind.step_id
        assert result.sampled == [("b", hf_greedy(hf_model, prompt_b, 1))]
        await sched.send(peer, Shutdown())
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        _stop(proc)
        sched.close()


async def test_host_tier_file_survives_a_killed_executor(checkpoint_cache, tmp_path):
    """--kv-offloading-path: the executor maps its host tier from a file; a block copied out
    is committed there; after kill -9 the next executor reopens the same file, whose record
    still vouches for the block, and reports the same number of host blocks."""
    _, model_dir = checkpoint_cache("qwen2")
    path = tmp_path / "tier"
    args = ("--kv-offloading-size", "0.001", "--kv-offloading-path", str(path))
    sched = SchedulerEnd("tcp://127.0.0.1:0")
    proc = _start(model_dir, sched.address, tmp_path / "executor.log", args)
    key = bytes(range(32))
    try:
        peer, hello = await _recv(sched)
        assert hello.num_host_blocks > 0
        await sched.send(peer, Welcome(protocol_version=PROTOCOL_VERSION))
        driver = PlanDriver(num_blocks=64, seed=5)
        plan = driver.plan(new_reqs=[driver.new("a", [3, 1, 4, 1, 5, 9, 2, 6, 5], 9)])
        await sched.send(peer, plan)
        _, result = await _recv(sched)
        table = driver.block_ids["a"]
        await sched.send(peer, driver.plan(offload_out=[(table[0], 2)],
                                           offload_keys=[key.hex()]))
        _, result = await _recv(sched)
        assert result.step_id == 1
    finally:
        _stop(proc)  # SIGKILL
    identity = read_identity(path.read_bytes()[:4096])
    assert identity.num_slots == hello.num_host_blocks and identity.model_name == model_dir.name
    tier = TierFile.open(path, identity)
    assert tier.committed_slots() == {2: key}
    assert any(tier.data(0)[identity.block_bytes * 2:identity.block_bytes * 3])  # real KV
    tier.close()
    proc = _start(model_dir, sched.address, tmp_path / "executor2.log", args)
    try:
        hello2 = None
        while not isinstance(hello2, Hello):  # the killed one's PeerLost comes first
            got = await _recv(sched)
            hello2 = got[1] if isinstance(got, tuple) else got
        assert hello2.num_host_blocks == hello.num_host_blocks
        assert TierFile.open(path, identity).committed_slots() == {2: key}  # reopened, kept
    finally:
        _stop(proc)
        sched.close()

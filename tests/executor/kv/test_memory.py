"""KV cache sizing: the profiling step's plan, its accounting, and a run on the CPU (the same
code that runs on CUDA, with host statistics standing in for the allocator's)."""

from __future__ import annotations

import pytest
import torch

from executor_svc.config import ExecutorConfig
from executor_svc.kv.kv_cache import KVCache
from executor_svc.kv.memory import (
    MIB,
    MemoryProfile,
    host_memory,
    profile_plan,
    profiled_kv_budget,
)
from executor_svc.loading.loader import effective_max_model_len, load_model
from executor_svc.loading.model_config import ModelConfig
from executor_svc.step.runner import ModelRunner
from tests.executor.harness import PlanDriver, make_runner


@pytest.mark.parametrize("tokens,seqs,max_len", [(2048, 256, 4096), (100, 7, 64), (5, 256, 8),
                                                  (4096, 1, 1000), (1000, 3, 100)])
def test_profile_plan_is_the_largest_step_within_the_limits(tokens, seqs, max_len):
    plan = profile_plan(tokens, seqs, max_len, block_size=16, vocab_size=300)
    lens = [r.num_scheduled_tokens for r in plan.new_reqs]
    assert len(lens) == min(seqs, tokens)
    assert sum(lens) == min(tokens, len(lens) * max_len) and max(lens) <= max_len
    for r in plan.new_reqs:
        assert len(r.token_ids) == r.num_scheduled_tokens and set(r.block_ids) == {0}
        assert len(r.block_ids) * 16 >= len(r.token_ids) and r.sampling.num_logprobs > 0


def test_budget_subtracts_usage_peak_and_graph_reserve():
    profile = MemoryProfile(total=80_000 * MIB, used_before=17_000 * MIB,
                            activation_peak=3_000 * MIB)
    assert profile.kv_cache_budget(0.9, 512 * MIB) == int(80_000 * MIB * 0.9) - 20_512 * MIB
    assert profile.kv_cache_budget(1.0, 0) == 60_000 * MIB
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        profile.kv_cache_budget(0.25, 512 * MIB)


def test_profiling_step_runs_on_the_cpu_and_leaves_the_model_serving(checkpoint_cache):
    _, model_dir = checkpoint_cache("llama2")
    cfg = ModelConfig.from_dir(model_dir)
    max_len = effective_max_model_len(cfg, None)
    cpu = torch.device("cpu")
    model = load_model(model_dir, dtype=torch.float32, device=cpu, max_model_len=max_len,
                       cfg=cfg)
    # Everything this process uses counts as "used before"; a whole machine leaves room.
    budget = profiled_kv_budget(model, cfg, block_size=4, max_model_len=max_len,
                                dtype=torch.float32, device=cpu, max_num_batched_tokens=64,
                                max_num_seqs=8, gpu_memory_utilization=1.0,
                                graph_reserve_bytes=0)
    snap = host_memory()
    assert 0 < budget <= snap.total - snap.allocated
    # The real cache binds over the scratch block and the model serves as before.
    ref = make_runner(model_dir)
    kv = KVCache.allocate(cfg, ref.kv_cache.num_blocks, 4, torch.float32, cpu)
    model.bind_kv_cache(kv.per_layer())
    runner = ModelRunner(model, kv, 4, max_len, cfg.vocab_size, cpu)
    outs = []
    for r in (runner, ref):
        d = PlanDriver()
        outs.append(r.execute(d.plan(new_reqs=[d.new("a", list(range(1, 12)), 11)])).sampled)
    assert outs[0] == outs[1]


def test_oversized_utilization_is_refused():
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        ExecutorConfig(model=None, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="max-num-seqs"):
        ExecutorConfig(model=None, max_num_seqs=0)

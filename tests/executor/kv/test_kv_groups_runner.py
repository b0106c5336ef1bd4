"""KV groups through the real scheduler and runner: a model whose layers read different block
tables (one group per layer) generates exactly what HF transformers does, with chunked
prefill, prefix-cache hits and preemption by swap and by recompute moving every group's
blocks."""

from __future__ import annotations

import random

import pytest
import torch

from executor_svc.kv.groups import KVLayout
from executor_svc.kv.kv_cache import KVCache
from executor_svc.kv.swap import SwapPool
from executor_svc.loading.loader import effective_max_model_len, load_model
from executor_svc.loading.model_config import ModelConfig
from executor_svc.step.graph_runner import DecodeGraphRunner
from executor_svc.step.runner import ModelRunner
from scheduler_svc.sched.block_manager import BlockManager
from tests.executor.harness import BLOCK_SIZE, hf_greedy, make_hf_model, save_checkpoint
from tests.fixtures.scheduled_runner import run_scheduled

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf = make_hf_model("llama2")  # two layers
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("llama2"))


def grouped_runner(model_dir, num_blocks: int, num_swap_blocks: int = 0,
                   graphs: bool = False) -> ModelRunner:
    """Each of the two layers in a group of its own: both slots are one tensor pair, so the
    groups' block ids must never collide. `graphs`: decode steps go through the decode graph
    runner's static buffers (replayed eagerly on the CPU)."""
    cfg = ModelConfig.from_dir(model_dir)
    max_len = effective_max_model_len(cfg, None)
    model = load_model(model_dir, dtype=torch.float32, device="cpu", max_model_len=max_len,
                       cfg=cfg)
    layout = KVLayout(windows=(0, 0), layer_group=(0, 1), layer_slot=(0, 0), group_size=1)
    shape = (num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    kv = KVCache([torch.zeros(shape)], [torch.zeros(shape)], layout)
    kv.bind(model)
    swap = SwapPool.allocate(kv, num_swap_blocks) if num_swap_blocks else None
    graph_runner = None
    if graphs:
        graph_runner = DecodeGraphRunner(model, 8, -(-max_len // BLOCK_SIZE), max_len,
                                         cfg.hidden_size, torch.float32, torch.device("cpu"),
                                         use_cuda_graphs=False, num_kv_groups=2)
        graph_runner.capture()
    return ModelRunner(model, kv, BLOCK_SIZE, max_len, cfg.vocab_size, torch.device("cpu"), swap,
                       graph_runner=graph_runner)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 300) for _ in range(10)]  # a common prefix: cache hits
    return [shared + [rng.randrange(1, 300) for _ in range(rng.randrange(1, 40))]
            for _ in range(n)]


@pytest.mark.parametrize("mode, num_blocks, num_swap, graphs", [
    ("auto", 200, 0, True),  # room for everyone; decodes through the graph buffers
    ("recompute", 40, 0, False),  # two groups share a pool far too small: preemption
    ("swap", 40, 80, False),
])
def test_two_groups_generate_exactly(llama, mode, num_blocks, num_swap, graphs):
    hf, model_dir = llama
    ps = prompts(5)
    runner = grouped_runner(model_dir, num_blocks, num_swap, graphs)
    bm = BlockManager(num_blocks, BLOCK_SIZE, num_swap, windows=(0, 0))
    outputs, sched = run_scheduled(runner, bm, ps, MAX_TOKENS, max_num_batched_tokens=24,
                                   preemption_mode=mode)
    for p, got in zip(ps, outputs, strict=True):
        assert got == hf_greedy(hf, p, MAX_TOKENS)
    assert sched.counters.prefix_cache_hits > 0
    if num_blocks < 100:
        assert sched.counters.num_preemptions > 0
    if mode == "swap":
        assert sched.counters.num_swap_outs > 0
    if graphs:
        assert sum(runner.graph_runner.num_replays.values()) > 0

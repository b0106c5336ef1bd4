"""Real CUDA graph capture and replay of decode steps: token-exact with the eager CUDA runner
over the same request mix as the CPU bookkeeping tests (test_graph_runner.py), over the model's
cache and over fp8 and int8 caches (--kv-cache-dtype: the graphs bind the scales with the
cache, and the warm-up compiles the quantized kernels)."""

from __future__ import annotations

import pytest
import torch

from executor_svc.kv.kv_cache import KVCache
from executor_svc.kv.kv_scales import default_scales
from executor_svc.loading.loader import effective_max_model_len, load_model
from executor_svc.loading.model_config import ModelConfig
from executor_svc.step.graph_runner import DecodeGraphRunner
from executor_svc.step.runner import ModelRunner
from tests.executor.harness import BLOCK_SIZE
from tests.executor.step.test_graph_runner import NUM_BLOCKS, drive

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
KV = {"auto": None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}  # --kv-cache-dtype


def cuda_runner(model_dir, graphs: bool, dtype: torch.dtype = torch.float32,
                kv_name: str = "auto") -> ModelRunner:
    cfg = ModelConfig.from_dir(model_dir)
    max_len = effective_max_model_len(cfg, None)
    model = load_model(model_dir, dtype=dtype, device=CUDA, max_model_len=max_len, cfg=cfg)
    kv_dtype = KV[kv_name] or dtype
    # fp8 at the scales a checkpoint without k_scale/v_scale gets, as the worker does.
    scales = default_scales(cfg, 1) if kv_dtype == torch.float8_e4m3fn else None
    kv_cache = KVCache.allocate(cfg, NUM_BLOCKS, BLOCK_SIZE, kv_dtype, CUDA, scales)
    kv_cache.bind(model)
    graph_runner = None
    if graphs:
        graph_runner = DecodeGraphRunner(model, 32, -(-max_len // BLOCK_SIZE), max_len,
                                         cfg.hidden_size, dtype, CUDA,
                                         use_cuda_graphs=True)
        graph_runner.capture()
    return ModelRunner(model, kv_cache, BLOCK_SIZE, max_len, cfg.vocab_size, CUDA,
                       graph_runner=graph_runner)


@pytest.mark.parametrize("kv_name", KV)
@pytest.mark.parametrize("arch", ["llama2", "qwen3"])
def test_cuda_graph_replay_is_token_exact_with_eager(checkpoint_cache, arch, kv_name):
    _, model_dir = checkpoint_cache(arch)
    eager, eager_sizes = drive(cuda_runner(model_dir, graphs=False, kv_name=kv_name))
    runner = cuda_runner(model_dir, graphs=True, kv_name=kv_name)
    assert runner.kv_cache.dtype == (KV[kv_name] or torch.float32)
    graphs = runner.graph_runner
    assert graphs is not None and sorted(graphs.graphs) == graphs.sizes
    replayed, sizes = drive(runner)
    assert replayed == eager and sizes == eager_sizes
    assert set(graphs.num_replays) == {graphs.padded_size(n) for n in sizes}
    assert sum(graphs.num_replays.values()) == len(sizes)


@pytest.mark.parametrize("kv_name", KV)
def test_bf16_replay_equals_an_eager_run_of_the_same_static_batch(checkpoint_cache, kv_name):
    """bf16: a padded graph batch runs other GEMM shapes than the unpadded eager step, so the
    invariant is per step: every replay's hidden states of the real rows equal, bitwise, an
    eager forward over the same static buffers (the KV write it repeats stores the same
    values, and over an int8 cache the same scales; padding rows hold whatever the attention
    output buffer held)."""
    _, model_dir = checkpoint_cache("qwen3")
    runner = cuda_runner(model_dir, graphs=True, dtype=torch.bfloat16, kv_name=kv_name)
    graphs = runner.graph_runner
    checked = []

    def check(_runner, running):
        def after():
            n, size = len(running), graphs.padded_size(len(running))
            replayed = graphs.hidden[:n].clone()
            graphs._forward(size, graphs._static_batch(size))
            assert torch.equal(graphs.hidden[:n], replayed), f"batch {n} (graph {size})"
            checked.append(size)
        return after

    _, sizes = drive(runner, on_decode=check)
    assert len(checked) == len(sizes) and len(set(checked)) > 2
    assert graphs.pool_bytes > 0


@pytest.mark.parametrize("kv_name", KV)
def test_capture_writes_nothing_to_the_kv_cache(checkpoint_cache, kv_name):
    _, model_dir = checkpoint_cache("llama2")
    cfg = ModelConfig.from_dir(model_dir)
    max_len = effective_max_model_len(cfg, None)
    model = load_model(model_dir, dtype=torch.float32, device=CUDA, max_model_len=max_len,
                       cfg=cfg)
    kv_dtype = KV[kv_name] or torch.float32
    scales = default_scales(cfg, 1) if kv_dtype == torch.float8_e4m3fn else None
    kv_cache = KVCache.allocate(cfg, 16, BLOCK_SIZE, kv_dtype, CUDA, scales)
    kv_cache.bind(model)
    # Poison every block tensor (codes, and int8's scales); int8 has no NaN: a code of 77.
    for t in kv_cache.block_tensors():  # by a copy, which every dtype has
        t.copy_(torch.full(t.shape, 77.0 if t.dtype == torch.int8 else float("nan"),
                           device=t.device))
    before = [t.clone() for t in kv_cache.block_tensors()]
    graphs = DecodeGraphRunner(model, 8, -(-max_len // BLOCK_SIZE), max_len, cfg.hidden_size,
                               torch.float32, CUDA, use_cuda_graphs=True)
    graphs.capture()
    for size in graphs.sizes:
        graphs.graphs[size].replay()
    torch.cuda.synchronize()
    for t, b in zip(kv_cache.block_tensors(), before, strict=True):
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8))

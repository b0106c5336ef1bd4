"""The CUDA-only code paths of the executor's host<->device traffic: pinned staging with async
copies in the swap pool, and step inputs sent in one pinned, non-blocking copy. The CPU runs of
the same code are the oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_svc.kv.kv_cache import KVCache
from executor_svc.kv.swap import SwapPool
from executor_svc.sample.sampler import seeded_bits
from executor_svc.step.input_batch import InputBatch
from executor_svc.step.inputs import build_step_inputs
from protos.plan import SamplingSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


def test_swap_round_trip_through_the_pinned_pool_on_a_side_stream():
    gen = torch.Generator().manual_seed(0)
    shape = (64, 16, 8, 128)  # [num_blocks, block_size, num_kv_heads, head_dim]
    host_k = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(4)]
    host_v = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(4)]
    kv = KVCache([t.to(CUDA, copy=True) for t in host_k], [t.to(CUDA, copy=True) for t in host_v])
    pool = SwapPool.allocate(kv, num_blocks=40)
    assert pool.blocks.is_pinned() and pool.stream is not None
    out_pairs = [(d, c) for c, d in enumerate(range(3, 63, 2))]  # 30 blocks
    pool.swap_out(kv, out_pairs)
    # Overwrite the device blocks at once (stream-ordered after the copies), then bring the
    # blocks back shifted by one, several rounds, reusing the staging memory each time.
    for t in (*kv.k_caches, *kv.v_caches):
        t.zero_()
    in_pairs = [(c, d + 1) for d, c in out_pairs]
    for _ in range(3):
        pool.swap_in(kv, in_pairs)
    torch.cuda.synchronize()
    for dev, swapped, host in zip((*kv.k_caches, *kv.v_caches),
                                  (*pool.k_caches, *pool.v_caches), (*host_k, *host_v),
                                  strict=True):
        for d, c in out_pairs:
            assert torch.equal(swapped[c], host[d]) and torch.equal(dev[d + 1].cpu(), host[d])
        moved = {d + 1 for d, _ in out_pairs}
        assert (dev[[b for b in range(64) if b not in moved]] == 0).all()


def test_step_inputs_on_cuda_equal_the_cpu_build():
    batch = InputBatch(max_model_len=64, block_size=4)
    specs = [SamplingSpec(temperature=0.7, top_p=0.9, seed=5, num_logprobs=2),
             SamplingSpec(temperature=0.0), SamplingSpec(top_k=3)]
    seqs = [([5, 6, 7, 8, 9], [3, 1]), (list(range(30, 41)), [7, 8, 9]),
            (list(range(100, 144)), list(range(20, 31)))]
    for i, ((token_ids, block_ids), spec) in enumerate(zip(seqs, specs, strict=True)):
        batch.add(f"r{i}", token_ids, block_ids, [2, 10, 0][i], spec)
    rows, query_lens = np.array([2, 0, 1]), np.array([40, 3, 1])  # the first does not sample
    cpu = build_step_inputs(batch, rows, query_lens, torch.device("cpu"))
    gpu = build_step_inputs(batch, rows, query_lens, CUDA)
    for name in ("input_ids", "positions", "logprob_rows"):
        a, b = getattr(cpu, name), getattr(gpu, name)
        assert b.is_cuda and a.dtype == b.dtype and torch.equal(a, b.cpu()), name
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc", "logits_indices"):
        a, b = getattr(cpu.batch, name), getattr(gpu.batch, name)
        assert b.is_cuda and a.dtype == b.dtype and torch.equal(a, b.cpu()), name
    for name in ("temperature", "top_p", "top_k", "seeded_rows", "seeds", "token_indices"):
        a, b = getattr(cpu.sampling, name), getattr(gpu.sampling, name)
        assert b.is_cuda and a.dtype == b.dtype and torch.equal(a, b.cpu()), name
    assert (cpu.sample_rows == gpu.sample_rows).all() and cpu.sample_rows.tolist() == [0, 1]


def test_seeded_noise_on_cuda_equals_the_cpu_stream():
    seeds = torch.tensor([0, 7, -3, 2**63 - 1])
    token_indices = torch.tensor([0, 1, 500, 40_000])
    cpu = seeded_bits(seeds, token_indices, 50_000)
    assert torch.equal(cpu, seeded_bits(seeds.to(CUDA), token_indices.to(CUDA), 50_000).cpu())



def test_logits_processors_on_cuda_equal_the_cpu_path():
    """The processors' staging segments and batched ops on the device give the CPU build's
    processed logits (elementwise ops: exact) and the same greedy tokens."""
    import random

    from executor_svc.sample.logits_processors import apply_processors
    from executor_svc.sample.sampler import sample
    from tests.executor.sample.test_logits_processors import VOCAB, _batch

    cpu, specs, *_ = _batch(random.Random(3), 12)
    gpu, *_ = _batch(random.Random(3), 12, CUDA)
    assert cpu.sampling.processing is not None and gpu.sampling.processing is not None
    logits = torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    want = apply_processors(logits, cpu.sampling.processing)
    got = apply_processors(logits.to(CUDA), gpu.sampling.processing)
    assert got.is_cuda and torch.equal(got.cpu(), want)
    # Greedy rows must agree exactly; sampled ones go through softmax, which may round
    # differently on the device.
    greedy = torch.tensor([s.temperature == 0.0 for s in specs])
    assert greedy.any()
    assert torch.equal(sample(logits.to(CUDA), gpu.sampling).cpu()[greedy],
                       sample(logits, cpu.sampling)[greedy])


def test_a_step_syncs_the_host_once(tmp_path):
    """torch's sync debug mode warns at every synchronizing call: a decode step makes one."""
    import warnings

    from tests.executor.harness import PlanDriver, make_hf_model, make_runner, save_checkpoint

    model_dir = save_checkpoint(make_hf_model("llama2"), tmp_path / "m")
    runner = make_runner(model_dir, device=CUDA)
    d = PlanDriver()
    out = runner.execute(d.plan(new_reqs=[d.new("a", list(range(1, 20)), 19)]))
    d.record(out.sampled)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner.execute(d.plan(cached_reqs=d.decode_all(["a"])))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


def test_warm_up_compiles_every_attention_variant():
    from executor_svc.kv.kv_cache import LayerKV
    from executor_svc.step.warmup import warm_attention

    k = torch.zeros((4, 16, 8, 128), dtype=torch.bfloat16, device=CUDA)
    num = warm_attention(LayerKV(k, k.clone()), num_heads=32, max_num_batched_tokens=2048,
                         show_progress=False, dtype=torch.bfloat16)
    assert num >= 2
    torch.cuda.synchronize()

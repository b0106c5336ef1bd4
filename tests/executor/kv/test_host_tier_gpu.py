"""The prefix cache's host tier on CUDA, over the model's cache and over fp8 and int8 caches:
the pool is page-locked, its copies run on a side stream ordered with the compute stream by
events, and nothing on the host waits for them but the step's one transfer of sampled ids.

The real scheduler drives the real runner (tests/fixtures/scheduled_runner.py) through the
families of test_host_tier.py: family a's prefix is evicted from a small device pool by
families b and c, then six requests of family a find it in the tier only and copy it back
while others decode (preemption by swap, a second side stream beside the tier's). The oracle
is the same run over a device pool large enough that nothing is evicted and nothing
preempted (the prefix then hits on the device), and for the model's own dtype also HF.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from scheduler_svc.sched.block_manager import BlockManager
from tests.e2e.hf_oracle import hf_greedy
from tests.executor.harness import BLOCK_SIZE, PlanDriver, make_runner
from tests.executor.kv.test_host_tier import (
    KEY,
    MAX_TOKENS,
    NUM_BLOCKS,
    NUM_HOST_BLOCKS,
    PREFIX,
    families,
    qwen2,  # noqa: F401 (the fixture)
)
from tests.fixtures.scheduled_runner import run_scheduled

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
KV = {"auto": torch.float32, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
NUM_BIG_BLOCKS = 400  # every block of every run: no eviction, no preemption


def run_families(model_dir, vocab_size: int, kv_dtype: torch.dtype, num_blocks: int,
                 num_host_blocks: int, device: torch.device = CUDA, tier_file=None):
    """Family a, then b and c, then six of a at once decoding longer: the three runs' outputs,
    the runner and the block manager, and the last run's scheduler."""
    swap = num_blocks if num_host_blocks else 0  # the small pool preempts by swap
    runner = make_runner(model_dir, num_blocks=num_blocks, num_swap_blocks=swap,
                         num_host_blocks=num_host_blocks, device=device,
                         kv_dtype=kv_dtype, tier_file=tier_file)
    bm = BlockManager(num_blocks, BLOCK_SIZE, swap, num_host_blocks=num_host_blocks)
    a, b, c = families(vocab_size)
    mode = "swap" if swap else "recompute"
    first, _ = run_scheduled(runner, bm, a[:2], MAX_TOKENS, preemption_mode=mode)
    second, _ = run_scheduled(runner, bm, b[:2] + c[:2], MAX_TOKENS, preemption_mode=mode)
    again, sched = run_scheduled(runner, bm, a[2:6] + c[2:4], 4 * MAX_TOKENS,
                                 preemption_mode=mode)
    return (first, second, again), runner, bm, sched


def _pinned(runner) -> list[torch.Tensor]:
    pools = (runner.host_tier, runner.swap_pool)
    return [t for p in pools for t in (p.blocks, p.scales) if t is not None]


@pytest.fixture
def shm_dir(tmp_path):
    """A directory in /dev/shm where there is one (folio serve's tier files live there: the
    file's pages are what the executor page-locks), else tmp_path."""
    if not Path("/dev/shm").is_dir():
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="folio-test-tier-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("in_file", [False, True], ids=["pool", "tier_file"])
@pytest.mark.parametrize("kv_name", KV)
def test_evicted_prefix_comes_back_from_the_pinned_tier(qwen2, kv_name, in_file,  # noqa: F811
                                                        shm_dir):
    if in_file and kv_name == "int8":
        pytest.skip("a tier file holds no int8 scales: the worker keeps such a tier private")
    model_dir, hf = qwen2
    kv_dtype = KV[kv_name]
    outputs, runner, bm, sched = run_families(
        model_dir, hf.config.vocab_size, kv_dtype, NUM_BLOCKS, NUM_HOST_BLOCKS,
        tier_file=shm_dir / "tier" if in_file else None)
    assert runner.kv_cache.dtype == kv_dtype and runner.kv_cache.k_caches[0].is_cuda
    assert all(t.is_pinned() for t in _pinned(runner))
    assert len(_pinned(runner)) == (4 if kv_name == "int8" else 2)
    assert runner.host_tier.stream is not None and runner.swap_pool.stream is not None
    assert bm._cached.get(bm._host_key_of[0]) is None, "family a's prefix stayed on the device"
    assert sched.counters.prefix_cache_host_hits >= PREFIX
    assert sched.counters.num_preemptions > 0
    if in_file:  # every copy-out run has landed and its record vouches for the slot's bytes
        torch.cuda.synchronize()
        runner.settle_host_tier()
        promised = bm.host_index()
        unsent = {slot for _, slot in bm._offload_out}  # for a plan after the last one
        valid = runner.host_tier_records.tier.valid_slots(promised)
        assert set(valid) == set(promised) - unsent and len(valid) >= PREFIX // BLOCK_SIZE
    expected, _, _, ref_sched = run_families(model_dir, hf.config.vocab_size, kv_dtype,
                                             NUM_BIG_BLOCKS, 0)
    assert ref_sched.counters.num_preemptions == 0
    assert outputs == expected
    if kv_name == "auto":
        a, _, c = families(hf.config.vocab_size)
        assert outputs[2] == hf_greedy(hf, a[2:6] + c[2:4], 4 * MAX_TOKENS)


def _set(t: torch.Tensor, value: float) -> None:
    """Every element of `t` := value, converted by a copy (which every dtype has)."""
    t.copy_(torch.full(t.shape, float(value), device=t.device))


def _fill(runner) -> None:
    """Device block b holds b, host slot s holds 16 (s + 1) (exact in e4m3 and int8); int8's
    scales likewise (block b + 1, slot 100 + s)."""
    kv, host = runner.kv_cache, runner.host_tier
    for b in range(kv.num_blocks):
        for t in (*kv.k_caches, *kv.v_caches):
            _set(t[b], b)
        for t in (*(kv.k_scales or ()), *(kv.v_scales or ())):
            _set(t[b], b + 1)
    for s in range(host.num_blocks):
        _set(host.blocks[s], 16 * (s + 1))
        if host.scales is not None:
            _set(host.scales[s], 100 + s)


def _holds(runner, block: int, value: float, scale: float | None = None) -> bool:
    kv = runner.kv_cache
    codes = all((t[block].float() == value).all() for t in (*kv.k_caches, *kv.v_caches))
    scales = (*(kv.k_scales or ()), *(kv.v_scales or ()))
    return codes and all((t[block] == scale).all() for t in scales)


@pytest.mark.parametrize("kv_name", KV)
def test_copies_are_ordered_across_plans_without_a_host_sync(qwen2, kv_name):  # noqa: F811
    """Plan 1 copies device block 1 out to slot 0 and block 2 to slot 2; the compute stream then
    overwrites blocks 1 and 2 at once; plan 2 copies slot 0 into block 5 and slot 2 into block
    1; plan 3 copies block 1 out to slot 3. Only the end synchronizes: block 5 holds the old
    block 1 (the overwrite waited for the gather), block 1 the old block 2 (the copy-in read
    the slot after the copy-out wrote it), slot 3 the old block 2 (after that copy-in)."""
    model_dir, _ = qwen2
    runner = make_runner(model_dir, num_blocks=8, num_host_blocks=4, device=CUDA,
                         kv_dtype=KV[kv_name])
    _fill(runner)
    int8 = kv_name == "int8"
    torch.cuda.synchronize()
    driver = PlanDriver(num_blocks=8)
    runner.execute(driver.plan(offload_out=[(1, 0), (2, 2)], offload_keys=[KEY, KEY]))
    kv = runner.kv_cache
    for b in (1, 2):
        for t in (*kv.k_caches, *kv.v_caches):
            _set(t[b], 7 - b)  # 6 and 5: values no block or slot held
        for t in (*(kv.k_scales or ()), *(kv.v_scales or ())):
            _set(t[b], 50.0)
    runner.execute(driver.plan(offload_in=[(0, 5), (2, 1)]))
    runner.execute(driver.plan(offload_out=[(1, 3)], offload_keys=[KEY]))
    torch.cuda.synchronize()
    assert _holds(runner, 5, 1, 2.0 if int8 else None)
    assert _holds(runner, 1, 2, 3.0 if int8 else None)
    assert _holds(runner, 2, 5, 50.0 if int8 else None)
    host = runner.host_tier
    assert (host.blocks[0].float() == 1).all() and (host.blocks[3].float() == 2).all()
    assert (host.blocks[1].float() == 32).all()  # untouched
    if int8:
        assert (host.scales[0] == 2.0).all() and (host.scales[3] == 3.0).all()

"""Swapping KV blocks to the CPU pool and back: exact continuations, exact block moves."""

from __future__ import annotations

import pytest
import torch

from executor_svc.kv.kv_cache import KVCache
from executor_svc.kv.swap import SwapPool, num_swap_blocks_for
from executor_svc.step.runner import PlanError
from tests.executor.harness import PlanDriver, hf_greedy, make_runner

PROMPTS = {"x": [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], "w": [40, 41, 42, 43, 44, 45, 46, 47, 48],
           "y": [100, 3, 200, 5, 250, 7]}
NUM_NEW = 12


class _Run:
    """Drives one runner, keeping each request's generated ids."""

    def __init__(self, runner, driver):
        self.runner, self.driver = runner, driver
        self.generated: dict[str, list[int]] = {r: [] for r in PROMPTS}

    def step(self, **plan_fields) -> None:
        out = self.runner.execute(self.driver.plan(**plan_fields))
        self.driver.record(out.sampled)
        for req_id, ids in out.sampled:
            self.generated[req_id].extend(ids)

    def tokens(self, req_id: str) -> list[int]:
        return PROMPTS[req_id] + self.generated[req_id]


def test_swap_out_and_in_continues_exactly_like_hf(checkpoint_cache):
    hf_model, model_dir = checkpoint_cache("llama2")
    run = _Run(make_runner(model_dir, num_swap_blocks=32), PlanDriver(seed=21))
    d = run.driver
    run.step(new_reqs=[d.new(r, PROMPTS[r], len(PROMPTS[r])) for r in ("x", "w")])
    for _ in range(3):
        run.step(cached_reqs=d.decode_all(["x", "w"]))
    # x leaves for the CPU; w's decode in the same step may land in x's freed blocks, which
    # must already have been copied out.
    x_blocks = list(d.block_ids["x"])
    x_cpu = list(range(len(x_blocks)))
    run.step(preempted_req_ids=["x"], swap_out=d.swap_out("x", x_cpu),
             cached_reqs=d.decode_all(["w"]))
    assert "x" not in run.runner.requests
    # y prefills into x's old device blocks, overwriting them.
    run.step(new_reqs=[d.new("y", PROMPTS["y"], len(PROMPTS["y"]))],
             cached_reqs=d.decode_all(["w"]))
    assert set(x_blocks) & set(d.block_ids["y"])
    run.step(cached_reqs=d.decode_all(["w", "y"]))
    # One plan swaps w out and x back in, onto the device blocks w just gave up: swap_out must
    # run before swap_in.
    w_cpu = list(range(20, 20 + len(d.block_ids["w"])))
    w_out = d.swap_out("w", w_cpu)
    x_in, x_new = d.swap_in("x", x_cpu, run.tokens("x"))
    assert all(dev != x_blocks[cpu] for cpu, dev in x_in)  # each block lands somewhere new
    run.step(preempted_req_ids=["w"], swap_out=w_out, swap_in=x_in, new_reqs=[x_new],
             cached_reqs=d.decode_all(["y"]))
    for _ in range(3):
        run.step(cached_reqs=d.decode_all(["x", "y"]))
    w_in, w_new = d.swap_in("w", w_cpu, run.tokens("w"))
    run.step(swap_in=w_in, new_reqs=[w_new], cached_reqs=d.decode_all(["x", "y"]))
    while min(len(g) for g in run.generated.values()) < NUM_NEW:
        run.step(cached_reqs=d.decode_all(list(PROMPTS)))
    for req_id, prompt in PROMPTS.items():
        assert run.generated[req_id][:NUM_NEW] == hf_greedy(hf_model, prompt, NUM_NEW), req_id


def _filled_cache(num_layers: int, num_blocks: int, shape: tuple[int, ...]) -> KVCache:
    gen = torch.Generator().manual_seed(0)
    def rand():
        return torch.randn((num_blocks, *shape), generator=gen)
    return KVCache([rand() for _ in range(num_layers)], [rand() for _ in range(num_layers)])


def test_batched_swaps_move_exactly_the_listed_blocks():
    kv = _filled_cache(num_layers=3, num_blocks=10, shape=(4, 2, 8))
    pool = SwapPool.allocate(kv, num_blocks=7)
    for t in (*pool.k_caches, *pool.v_caches):
        t.fill_(float("nan"))  # poison: any block not written stays NaN
    device_before = [t.clone() for t in (*kv.k_caches, *kv.v_caches)]

    out_pairs = [(7, 2), (1, 5), (4, 0)]
    pool.swap_out(kv, out_pairs)
    for dev, host, before in zip((*kv.k_caches, *kv.v_caches), (*pool.k_caches, *pool.v_caches),
                                 device_before, strict=True):
        assert torch.equal(dev, before)  # the source is only read
        for d, c in out_pairs:
            assert torch.equal(host[c], dev[d])
        untouched = [c for c in range(7) if c not in {c for _, c in out_pairs}]
        assert host[untouched].isnan().all()

    for t in (*kv.k_caches, *kv.v_caches):
        t.fill_(-7.0)  # poison the device side, then bring two blocks back elsewhere
    in_pairs = [(5, 9), (0, 3)]
    pool.swap_in(kv, in_pairs)
    for dev, before in zip((*kv.k_caches, *kv.v_caches), device_before, strict=True):
        assert torch.equal(dev[9], before[1]) and torch.equal(dev[3], before[4])
        assert (dev[[b for b in range(10) if b not in (9, 3)]] == -7.0).all()


def test_swap_pool_sizing():
    assert num_swap_blocks_for(0, 2048) == 0
    assert num_swap_blocks_for(0.001, 2048) == int(0.001 * (1 << 30)) // 2048
    with pytest.raises(ValueError, match="holds no KV block"):
        num_swap_blocks_for(1e-9, 2048)


@pytest.mark.parametrize("fields, message", [
    (dict(swap_out=[(0, 8)]), r"swap out \(0, 8\) names cpu block 8, outside 0..7"),
    (dict(swap_out=[(96, 0)]), r"names device block 96, outside 0..95"),
    (dict(swap_in=[(-1, 3)]), r"swap in \(-1, 3\) names cpu block -1"),
    (dict(swap_in=[(0, 3), (1, 3)]), r"swap in writes device block 3 more than once"),
    (dict(swap_out=[(0, 2), (1, 2)]), r"swap out writes cpu block 2 more than once"),
    (dict(block_copies=[(5, 6), (7, 6)]), r"block copy writes device block 6 more than once"),
])
def test_bad_swap_pairs_fail_clearly_and_move_nothing(checkpoint_cache, fields, message):
    _, model_dir = checkpoint_cache("llama2")
    runner = make_runner(model_dir, num_swap_blocks=8)
    for t in (*runner.swap_pool.k_caches, *runner.swap_pool.v_caches):
        t.fill_(3.0)
    with pytest.raises(PlanError, match=message):
        runner.execute(PlanDriver().plan(**fields))
    assert all((t == 3.0).all() for t in (*runner.swap_pool.k_caches, *runner.swap_pool.v_caches))
    assert all((t == 0).all() for t in (*runner.kv_cache.k_caches, *runner.kv_cache.v_caches))


def test_swapping_without_a_pool_is_refused(checkpoint_cache):
    _, model_dir = checkpoint_cache("llama2")
    runner = make_runner(model_dir)
    assert runner.num_swap_blocks == 0
    with pytest.raises(PlanError, match="no CPU swap pool .*--swap-space 0"):
        runner.execute(PlanDriver().plan(swap_in=[(0, 1)]))

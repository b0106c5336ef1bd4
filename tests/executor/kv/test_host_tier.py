"""The prefix cache's host tier, with the real scheduler driving the real runner: blocks
evicted from a small device pool stay hits in the host tier, are copied back instead of
recomputed, and the continuations are HF transformers' token for token, also when the
requests that hit the tier are preempted (by recompute and by swap). A tier whose contents are
wiped between the runs changes the tokens, so the copies are what the model reads. The runner
runs a plan's tier copies in the protocol's order and refuses pairs outside its pools."""

from __future__ import annotations

import pytest
import torch

from executor_svc.step.plan_validation import PlanError
from scheduler_svc.sched.block_manager import BlockManager
from scheduler_svc.sched.prefix_cache import extend_block_keys
from tests.e2e.hf_oracle import hf_greedy, load_hf_model, random_prompts
from tests.executor.harness import BLOCK_SIZE, PlanDriver, make_runner
from tests.fixtures.checkpoints import make_checkpoint
from tests.fixtures.scheduled_runner import run_scheduled

NUM_BLOCKS = 40  # 160 tokens: one family's requests fit, two families evict the first
NUM_HOST_BLOCKS = 200
PREFIX = 48  # 12 blocks shared by a family
MAX_TOKENS = 8
KEY = "ab" * 32  # a prefix-cache key in hex, as plans carry it


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = make_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))
    return path, load_hf_model(path)


def families(vocab_size: int) -> list[list[list[int]]]:
    """Three families of prompts: a shared 48-token prefix, then 4..10 tokens of their own."""
    prefixes = random_prompts(vocab_size, (PREFIX,) * 3, seed=11)
    tails = random_prompts(vocab_size, (4, 7, 10, 5, 9, 6) * 3, seed=12)
    return [[prefix + tail for tail in tails[6 * f:6 * f + 6]]
            for f, prefix in enumerate(prefixes)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_evicted_prefix_hits_the_host_tier_and_decodes_as_hf(qwen2, mode):
    model_dir, hf = qwen2
    swap = NUM_BLOCKS if mode == "swap" else 0
    runner = make_runner(model_dir, num_blocks=NUM_BLOCKS, num_swap_blocks=swap,
                         num_host_blocks=NUM_HOST_BLOCKS)
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, swap, num_host_blocks=NUM_HOST_BLOCKS)
    a, b, c = families(hf.config.vocab_size)
    run_scheduled(runner, bm, a[:2], MAX_TOKENS, preemption_mode=mode)
    run_scheduled(runner, bm, b[:2] + c[:2], MAX_TOKENS, preemption_mode=mode)
    first_key = bm._cached.get(bm._host_key_of[0])  # slot 0: family a's first block
    assert first_key is None, "family a's prefix should have left the device pool"
    # Six requests at once, decoding longer, need more blocks than the pool has: preemption.
    again = a[2:6] + c[2:4]
    outputs, sched = run_scheduled(runner, bm, again, 4 * MAX_TOKENS, preemption_mode=mode)
    assert outputs == hf_greedy(hf, again, 4 * MAX_TOKENS)
    assert sched.counters.num_preemptions > 0
    # The first admission found the whole prefix in the host tier, not on the device.
    assert sched.counters.prefix_cache_host_hits >= PREFIX
    assert bm.num_cached_host_blocks > 0


def test_the_copies_are_what_the_model_reads(qwen2):
    """Wiping the tier between the runs (the scheduler still believes it) changes the tokens:
    the oracle above could fail."""
    model_dir, hf = qwen2
    runner = make_runner(model_dir, num_blocks=NUM_BLOCKS, num_host_blocks=NUM_HOST_BLOCKS)
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, num_host_blocks=NUM_HOST_BLOCKS)
    a, b, c = families(hf.config.vocab_size)
    run_scheduled(runner, bm, a[:2], MAX_TOKENS)
    run_scheduled(runner, bm, b[:2] + c[:2], MAX_TOKENS)
    runner.host_tier.blocks.normal_()
    outputs, sched = run_scheduled(runner, bm, a[2:3], MAX_TOKENS)
    assert sched.counters.prefix_cache_host_hits >= PREFIX
    assert outputs != hf_greedy(hf, a[2:3], MAX_TOKENS)


def _fill(runner) -> None:
    """Device block b holds b everywhere, host slot s holds 100 + s."""
    for t in (*runner.kv_cache.k_caches, *runner.kv_cache.v_caches):
        for b in range(t.shape[0]):
            t[b] = b
    for s in range(runner.host_tier.num_blocks):
        runner.host_tier.blocks[s] = 100 + s


def test_copies_run_in_the_protocols_order(qwen2):
    """offload_out reads the device before offload_in writes it; a slot written by a copy-out
    is read by a copy-in of the same plan after it."""
    model_dir, _ = qwen2
    runner = make_runner(model_dir, num_blocks=8, num_host_blocks=4)
    _fill(runner)
    runner.execute(PlanDriver().plan(offload_out=[(1, 0), (2, 2)], offload_keys=[KEY, KEY],
                                     offload_in=[(1, 1), (2, 3)]))
    host, kv = runner.host_tier, runner.kv_cache
    assert (host.blocks[0] == 1).all() and (host.blocks[2] == 2).all()
    for t in (*kv.k_caches, *kv.v_caches):
        assert (t[1] == 101).all()  # block 1 went out first, then slot 1 came in
        assert (t[3] == 2).all()  # slot 2, just written from block 2
        assert all((t[b] == b).all() for b in (0, 2, 4, 5, 6, 7))


@pytest.mark.parametrize("fields, message", [
    (dict(offload_out=[(0, 4)], offload_keys=[KEY]),
     r"offload out \(0, 4\) names host block 4, outside 0..3"),
    (dict(offload_in=[(0, 8)]), r"offload in \(0, 8\) names device block 8, outside 0..7"),
    (dict(offload_out=[(0, 1), (2, 1)], offload_keys=[KEY, KEY]),
     r"offload out writes host block 1 more than once"),
    (dict(offload_in=[(0, 5), (1, 5)]), r"offload in writes device block 5 more than once"),
])
def test_bad_tier_pairs_fail_clearly_and_move_nothing(qwen2, fields, message):
    model_dir, _ = qwen2
    runner = make_runner(model_dir, num_blocks=8, num_host_blocks=4)
    _fill(runner)
    with pytest.raises(PlanError, match=message):
        runner.execute(PlanDriver().plan(**fields))
    assert all((runner.host_tier.blocks[s] == 100 + s).all() for s in range(4))


def test_a_plan_for_a_tier_the_executor_lacks_is_refused(qwen2):
    model_dir, _ = qwen2
    runner = make_runner(model_dir, num_blocks=8)
    with pytest.raises(PlanError, match="a host tier, but this executor has none"):
        runner.execute(PlanDriver().plan(offload_in=[(0, 1)]))


def test_a_restarted_executor_starts_warm_from_the_tier_file(qwen2, tmp_path):
    """The tier in a file: every block the scheduler promised is vouched for by its record;
    a new runner (a restarted executor: empty device cache) mapping the same file and a new
    block manager adopting the promises the file keeps copy the family's prefix back, HF-exact;
    a slot damaged in between is dropped, not read."""
    model_dir, hf = qwen2
    path = tmp_path / "tier"
    runner = make_runner(model_dir, num_blocks=NUM_BLOCKS, num_host_blocks=NUM_HOST_BLOCKS,
                         tier_file=path)
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, num_host_blocks=NUM_HOST_BLOCKS)
    a, b, _ = families(hf.config.vocab_size)
    run_scheduled(runner, bm, a[:2] + b[:2], MAX_TOKENS)
    promised = bm.host_index()
    tier = runner.host_tier_records.tier
    assert tier.valid_slots(promised) == promised and len(promised) >= 2 * PREFIX // BLOCK_SIZE
    # A value in one of family b's slots changes while no executor runs.
    a_keys = set(extend_block_keys([], a[2], BLOCK_SIZE))
    b_slot = next(slot for slot, key in promised.items() if key not in a_keys)
    del runner
    restarted = make_runner(model_dir, num_blocks=NUM_BLOCKS, num_host_blocks=NUM_HOST_BLOCKS,
                            tier_file=path)
    assert all((t == 0).all() for t in restarted.kv_cache.k_caches)  # nothing on the device
    restarted.host_tier.blocks[b_slot].view(-1)[0] += 1.0
    kept = restarted.host_tier_records.tier.valid_slots(promised)
    assert b_slot not in kept and len(kept) == len(promised) - 1
    fresh = BlockManager(NUM_BLOCKS, BLOCK_SIZE, num_host_blocks=NUM_HOST_BLOCKS)
    fresh.adopt_host_blocks(kept)
    outputs, sched = run_scheduled(restarted, fresh, a[2:4], MAX_TOKENS)
    assert outputs == hf_greedy(hf, a[2:4], MAX_TOKENS)
    assert sched.counters.prefix_cache_host_hits >= PREFIX


def test_an_int8_cache_carries_its_scales_through_the_tier_file(qwen2, tmp_path):
    """An int8 KV cache's tier file holds each slot's scales with its codes: a restarted
    runner mapping the file reads the family's prefix back and continues exactly as the
    uninterrupted runner does; a slot whose scales (alone) changed fails its crc32 and is
    dropped; and the scales are what the model reads (zeroed, the tokens change)."""
    model_dir, hf = qwen2
    path = tmp_path / "tier"
    kw = dict(num_blocks=NUM_BLOCKS, num_host_blocks=NUM_HOST_BLOCKS, tier_file=path,
              kv_dtype=torch.int8)
    runner = make_runner(model_dir, **kw)
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, num_host_blocks=NUM_HOST_BLOCKS)
    a, b, _ = families(hf.config.vocab_size)
    run_scheduled(runner, bm, a[:2] + b[:2], MAX_TOKENS)
    promised = bm.host_index()
    tier = runner.host_tier_records.tier
    assert tier.identity.scale_bytes > 0 and tier.valid_slots(promised) == promised
    assert runner.host_tier.scales.abs().sum() > 0  # the scales were written through
    restarted = make_runner(model_dir, **kw)
    assert restarted.host_tier.scales.data_ptr() != runner.host_tier.scales.data_ptr()
    a_keys = set(extend_block_keys([], a[2], BLOCK_SIZE))
    b_slot = next(slot for slot, key in promised.items() if key not in a_keys)
    restarted.host_tier.scales[b_slot].view(-1)[0] += 1.0
    kept = restarted.host_tier_records.tier.valid_slots(promised)
    assert b_slot not in kept and len(kept) == len(promised) - 1
    fresh = BlockManager(NUM_BLOCKS, BLOCK_SIZE, num_host_blocks=NUM_HOST_BLOCKS)
    fresh.adopt_host_blocks(kept)
    outputs, sched = run_scheduled(restarted, fresh, a[2:4], MAX_TOKENS)
    assert sched.counters.prefix_cache_host_hits >= PREFIX
    reference, _ = run_scheduled(runner, bm, a[2:4], MAX_TOKENS)  # the uninterrupted runner
    assert outputs == reference
    # Without the scales the codes mean nothing: the same restart with them zeroed differs.
    promised = bm.host_index()
    again = make_runner(model_dir, **kw)
    again.host_tier.scales.zero_()
    wiped = BlockManager(NUM_BLOCKS, BLOCK_SIZE, num_host_blocks=NUM_HOST_BLOCKS)
    wiped.adopt_host_blocks(promised)  # trusted blindly, the crc32 check skipped
    outputs, sched = run_scheduled(again, wiped, a[2:4], MAX_TOKENS)
    assert sched.counters.prefix_cache_host_hits >= PREFIX and outputs != reference


class RecordingRunner:
    """The runner, keeping every plan it executes."""

    def __init__(self, runner):
        self.runner, self.plans = runner, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, plan):
        self.plans.append(plan)
        return self.runner.execute(plan)


def test_a_family_admitted_together_shares_one_copy_of_each_slot(qwen2):
    """Three requests of a family whose prefix is only in the host tier, admitted in one step:
    the plan copies each of the prefix's slots in once, the three share those blocks, and
    every continuation is HF's."""
    model_dir, hf = qwen2
    runner = RecordingRunner(make_runner(model_dir, num_blocks=NUM_BLOCKS,
                                         num_host_blocks=NUM_HOST_BLOCKS))
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, num_host_blocks=NUM_HOST_BLOCKS)
    a, b, c = families(hf.config.vocab_size)
    run_scheduled(runner, bm, a[:2], MAX_TOKENS)
    run_scheduled(runner, bm, b[:2] + c[:2], MAX_TOKENS)
    runner.plans.clear()
    outputs, sched = run_scheduled(runner, bm, a[2:5], MAX_TOKENS)
    assert outputs == hf_greedy(hf, a[2:5], MAX_TOKENS)
    (plan,) = [p for p in runner.plans if p.offload_in]
    slots = [slot for slot, _ in plan.offload_in]
    assert len(slots) == len(set(slots)) == PREFIX // BLOCK_SIZE
    assert len(plan.new_reqs) == 3
    assert all(r.block_ids[:len(slots)] == plan.new_reqs[0].block_ids[:len(slots)]
               for r in plan.new_reqs)
    assert sched.counters.prefix_cache_host_hits == 3 * PREFIX

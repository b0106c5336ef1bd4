"""Preemption by swap and by recompute: the policy, exact swap pairs, swapped requests resuming
before new ones, and outputs identical to an uninterrupted run. Plans run through `PlanMirror`,
which moves simulated KV slots like the executor (swap_out, swap_in, copies, then writes)."""

from __future__ import annotations

import pytest

from scheduler_svc.sched.request import RequestStatus
from tests.scheduler.null_executor import PlanMirror
from tests.scheduler.sched.test_scheduler import (
    make_request,
    make_scheduler,
    run_to_end,
    step,
    uninterrupted_outputs,
)


def two_growing_requests(mode: str, num_cpu_blocks: int, prompt_len: int = 7,
                         num_blocks: int = 4):
    """Two prompts that fill a 4-block pool once each has 8 tokens (see test_scheduler)."""
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=2,
                           max_model_len=16, num_cpu_blocks=num_cpu_blocks,
                           preemption_mode=mode, enable_prefix_caching=False)
    old, new = make_request("old", prompt_len, 0, max_tokens=6), make_request("new", 7, 1, 6)
    sched.add_request(old)
    sched.add_request(new)
    return sched, PlanMirror(block_size=4), old, new


def test_swap_out_then_swap_in_with_exact_pairs():
    sched, mirror, old, new = two_growing_requests("swap", num_cpu_blocks=4)
    late = make_request("late", 3, 2, max_tokens=2)
    sched.add_request(late)
    step(sched, mirror)  # both prompts (blocks 0 1 | 2 3)
    step(sched, mirror)  # both decode into the last slot of their second block
    plan = step(sched, mirror)  # "old" needs a third block: "new" is swapped out
    assert plan.preempted_req_ids == ["new"]
    assert plan.swap_out == [(2, 0), (3, 1)]  # new's table [2, 3] -> CPU blocks [0, 1]
    assert [(c.req_id, c.new_block_ids) for c in plan.cached_reqs] == [("old", [3])]
    assert new.status is RequestStatus.SWAPPED and new.num_computed_tokens == 8
    assert sched.queues.swapped == [new] and [r.req_id for r in sched.queues.waiting] == ["late"]
    assert sched.block_manager.cpu_block_table("new") == [0, 1]
    assert sched.counters.num_swap_outs == 1 and sched.counters.num_preemptions == 1
    # "old" runs alone to its end; "new" comes back before "late" (swapped before waiting).
    plans = run_to_end(sched, mirror)
    back = next(i for i, p in enumerate(plans) if p.swap_in)
    resumed = next(n for n in plans[back].new_reqs if n.req_id == "new")
    assert plans[back].swap_in == [(0, b) for b in resumed.block_ids[:1]] + \
        [(1, b) for b in resumed.block_ids[1:2]]
    assert resumed.num_computed_tokens == 8 and resumed.num_scheduled_tokens == 1
    assert resumed.token_ids == new.all_token_ids[:9]
    assert all(n.req_id != "late" for p in plans[:back] for n in p.new_reqs)
    assert [n.req_id for n in plans[back].new_reqs][0] == "new"  # "late" only after it
    assert mirror.num_swapped_out == 2
    assert sched.block_manager.num_free_cpu_blocks == 4
    expected = uninterrupted_outputs({"old": 7, "new": 7, "late": 3}, max_tokens=6)
    assert (old.output_token_ids, new.output_token_ids) == (expected["old"], expected["new"])
    assert late.output_token_ids == expected["late"][:2]


@pytest.mark.parametrize("mode, num_cpu_blocks, prompt_len, expected", [
    ("auto", 4, 7, "swap"),  # 8 computed tokens: two full blocks' worth
    ("auto", 0, 7, "recompute"),  # no CPU pool
    ("auto", 1, 7, "recompute"),  # the CPU pool is too small for its 2 blocks
    ("recompute", 4, 7, "recompute"),
    ("swap", 1, 7, "recompute"),  # forced swap falls back without CPU room
])
def test_preemption_mode_policy(mode, num_cpu_blocks, prompt_len, expected):
    sched, mirror, old, new = two_growing_requests(mode, num_cpu_blocks, prompt_len)
    run_to_end(sched, mirror)
    assert sched.counters.num_preemptions >= 1
    assert (sched.counters.num_swap_outs > 0) == (expected == "swap")
    want = uninterrupted_outputs({"old": prompt_len, "new": 7}, max_tokens=6)
    assert (old.output_token_ids, new.output_token_ids) == (want["old"], want["new"])


def test_auto_recomputes_a_context_shorter_than_a_block():
    # Block size 8: the victim has 5 computed tokens when "old" needs a new block.
    from scheduler_svc.sched.block_manager import BlockManager
    from scheduler_svc.sched.scheduler import Scheduler

    sched = Scheduler(BlockManager(2, 8, num_cpu_blocks=4), 2, 64, 16, preemption_mode="auto")
    mirror = PlanMirror(block_size=8)
    old, new = make_request("old", 7, 0, max_tokens=4), make_request("new", 4, 1, max_tokens=4)
    sched.add_request(old)
    sched.add_request(new)
    step(sched, mirror)  # old: 7 tokens in block 0; new: 4 tokens in block 1
    plan = step(sched, mirror)  # old writes position 7 (block 0), new position 4
    plan = step(sched, mirror)  # old needs block 2 of 2: new (5 computed < 8) is recomputed
    assert plan.preempted_req_ids == ["new"] and plan.swap_out == []
    assert new.status is RequestStatus.WAITING and sched.counters.num_swap_outs == 0
    run_to_end(sched, mirror)


def test_abort_of_a_swapped_request_frees_its_cpu_blocks():
    sched, mirror, old, new = two_growing_requests("swap", num_cpu_blocks=4)
    for _ in range(3):
        step(sched, mirror)
    assert new.status is RequestStatus.SWAPPED
    assert sched.abort_request("new") is new
    assert sched.block_manager.num_free_cpu_blocks == 4 and sched.queues.swapped == []
    plan = step(sched, mirror)
    assert "new" not in plan.finished_req_ids  # the executor dropped it at swap-out
    run_to_end(sched, mirror)
    assert sched.block_manager.num_free_cpu_blocks == 4


def test_many_requests_under_pressure_match_an_uninterrupted_run():
    prompts = {f"r{i}": 3 + (i * 5) % 11 for i in range(8)}
    for mode in ("recompute", "swap", "auto"):
        sched = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=4, budget=12,
                               max_model_len=40, num_cpu_blocks=6, preemption_mode=mode)
        mirror = PlanMirror(block_size=4)
        reqs = [make_request(r, n, i, max_tokens=14) for i, (r, n) in enumerate(prompts.items())]
        for r in reqs:
            sched.add_request(r)
        run_to_end(sched, mirror, max_steps=400)
        assert sched.counters.num_preemptions > 0
        assert (sched.counters.num_swap_outs > 0) == (mode != "recompute")
        expected = uninterrupted_outputs(prompts, max_tokens=14)
        assert {r.req_id: r.output_token_ids for r in reqs} == expected, mode


def test_a_failed_step_that_swapped_out_requeues_the_victim_for_recompute():
    sched, mirror, old, new = two_growing_requests("swap", num_cpu_blocks=4)
    step(sched, mirror)
    step(sched, mirror)
    plan = sched.schedule()
    assert plan.swap_out and new.status is RequestStatus.SWAPPED
    mirror.fail(plan)  # the CPU copy of new's blocks may never have been made
    assert sched.fail_requests(sched.abandon_in_flight()) == [old]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert sched.block_manager.num_free_cpu_blocks == 4 and sched.queues.swapped == []
    run_to_end(sched, mirror)
    assert new.output_token_ids == uninterrupted_outputs({"old": 7, "new": 7}, 6)["new"]

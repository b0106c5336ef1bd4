"""Chunked prefill under a small token budget: decodes first, long prompts in chunks, nobody
starved. Driven by the plan-checking null executor (synthetic step results)."""

from __future__ import annotations

from scheduler_svc.sched.request import RequestStatus
from tests.scheduler.null_executor import PlanMirror
from tests.scheduler.sched.test_scheduler import make_request, make_scheduler, run_to_end, step

LONG = 32 * 1024


def scheduled(plan) -> dict[str, int]:
    return {r.req_id: r.num_scheduled_tokens for r in plan.new_reqs + plan.cached_reqs}


def test_a_32k_prompt_neither_starves_decodes_nor_is_starved():
    budget, bs = 64, 16
    sched = make_scheduler(num_blocks=LONG // bs + 256, block_size=bs, budget=budget,
                           max_model_len=LONG + 64)
    mirror = PlanMirror(block_size=bs)
    shorts = [make_request(f"s{i}", 5, i, max_tokens=10_000) for i in range(3)]
    for req in shorts:
        sched.add_request(req)
    step(sched, mirror)  # the short prompts
    long = make_request("long", LONG, 3, max_tokens=2)
    sched.add_request(long)
    num_steps = 0
    while long.num_output_tokens == 0:
        before = {r.req_id: r.num_output_tokens for r in shorts}
        computed_before = long.num_computed_tokens
        plan = step(sched, mirror)
        num_steps += 1
        counts = scheduled(plan)
        assert sum(counts.values()) <= budget
        # Every decode gets its token, every step, and streams one more output token.
        assert all(counts[r.req_id] == 1 for r in shorts)
        assert all(r.num_output_tokens == before[r.req_id] + 1 for r in shorts)
        # The long prompt takes the whole rest of the budget (or what it still lacks).
        assert counts["long"] == min(budget - len(shorts), LONG - computed_before)
    assert num_steps == -(-LONG // (budget - len(shorts)))
    assert long.num_computed_tokens == LONG
    for req in shorts:
        sched.abort_request(req.req_id)
    run_to_end(sched, mirror)
    assert long.status is RequestStatus.FINISHED_LENGTH and long.num_output_tokens == 2


def test_decodes_go_first_even_when_prompts_are_older():
    sched, mirror = make_scheduler(budget=8, block_size=4), PlanMirror(block_size=4)
    # old-long arrived first (e.g. it was preempted and requeued) but young already decodes.
    old_long = make_request("old-long", 40, 0, max_tokens=3)
    young = make_request("young", 3, 1, max_tokens=20)
    sched.add_request(young)
    step(sched, mirror)
    sched.add_request(old_long)
    for _ in range(4):
        plan = step(sched, mirror)
        assert scheduled(plan) == {"young": 1, "old-long": 7}
        assert sched.queues.running[0] is old_long  # older, yet the decode went first
        assert (plan.cached_reqs + plan.new_reqs)[0].req_id == "young"
    run_to_end(sched, mirror)


def test_a_long_prompt_finishes_while_short_requests_keep_arriving():
    budget = 32
    sched = make_scheduler(num_blocks=256, block_size=4, budget=budget, max_num_seqs=16,
                           max_model_len=4096)
    mirror = PlanMirror(block_size=4)
    arrival = 0

    def add_short():
        nonlocal arrival
        sched.add_request(make_request(f"short-{arrival}", 5, arrival, max_tokens=3))
        arrival += 1

    for _ in range(5):
        add_short()
        step(sched, mirror)
    long = make_request("long", 600, arrival, max_tokens=2)
    arrival += 1
    sched.add_request(long)
    num_steps = 0
    while not long.is_finished:
        add_short()  # a steady stream: one new request per step
        computed_before = long.num_computed_tokens
        plan = step(sched, mirror)
        num_steps += 1
        assert num_steps < 100, "the long prompt is starved"
        if computed_before < long.num_prompt_tokens:
            # It progresses every step: only decodes (at most the running ones) go before it.
            assert scheduled(plan).get("long", 0) >= budget - sched.max_num_seqs
    # 600 tokens at >= 16 a step (in practice the decodes before it have finished quickly).
    assert num_steps <= 600 // 16 + 2
    run_to_end(sched, mirror)  # and every short request finishes too

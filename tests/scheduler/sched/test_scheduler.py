"""Scheduler unit tests: schedule()/update() driven by a plan-checking null executor.

Every plan goes through `PlanMirror`, which rebuilds the executor's view from the diffs alone
and fails on anything a real executor could not run, so these tests also check the plan
protocol (new once, then cached; block tables covering the scheduled tokens; no shared blocks).
"""

from __future__ import annotations

import pytest

from protos.plan import SamplingSpec, StepPlan
from scheduler_svc.sched.block_manager import BlockManager
from scheduler_svc.sched.request import Request, RequestStatus
from scheduler_svc.sched.scheduler import Scheduler
from tests.scheduler.null_executor import PlanMirror

EOS = 1


def make_scheduler(num_blocks=32, block_size=4, max_num_seqs=8, budget=64, max_model_len=64,
                   num_cpu_blocks=0, **kw):
    return Scheduler(BlockManager(num_blocks, block_size, num_cpu_blocks), max_num_seqs, budget,
                     max_model_len, **kw)


def make_request(req_id: str, num_prompt: int, arrival: int, max_tokens: int = 100, **kw):
    prompt = [20 + (arrival * 13 + i) % 50 for i in range(num_prompt)]
    return Request(req_id=req_id, prompt_token_ids=prompt, sampling=SamplingSpec(temperature=0.0),
                   max_tokens=max_tokens, arrival=arrival, eos_token_ids=frozenset({EOS}), **kw)


def step(sched: Scheduler, mirror: PlanMirror) -> StepPlan:
    plan = sched.schedule()
    assert plan is not None
    assert 0 < plan.num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(plan.new_reqs) + len(plan.cached_reqs) <= sched.max_num_seqs
    sched.update(mirror.apply(plan))
    sched.block_manager.check_invariants()
    return plan


def run_to_end(sched: Scheduler, mirror: PlanMirror, max_steps: int = 500) -> list[StepPlan]:
    plans = []
    while sched.has_unfinished():
        assert len(plans) < max_steps, "requests never finished"
        plans.append(step(sched, mirror))
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return plans


def test_new_request_is_sent_once_then_only_as_cached():
    sched, mirror = make_scheduler(block_size=4), PlanMirror(block_size=4)
    req = make_request("a", 6, 0, max_tokens=4)
    sched.add_request(req)
    p0 = step(sched, mirror)
    assert [r.req_id for r in p0.new_reqs] == ["a"] and p0.cached_reqs == []
    new = p0.new_reqs[0]
    assert (new.token_ids, new.block_ids, new.num_computed_tokens, new.num_scheduled_tokens) \
        == (req.prompt_token_ids, [0, 1], 0, 6)
    p1 = step(sched, mirror)  # token 7 at position 6: still in block 1
    assert p1.new_reqs == []
    assert [(c.req_id, c.new_block_ids, c.num_computed_tokens, c.num_scheduled_tokens)
            for c in p1.cached_reqs] == [("a", [], 6, 1)]
    p2 = step(sched, mirror)  # position 7: last slot of block 1
    assert p2.cached_reqs[0].new_block_ids == []
    p3 = step(sched, mirror)  # position 8 opens block 2
    assert p3.cached_reqs[0].new_block_ids == [2]
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 4
    assert sched.block_manager.num_free_blocks == 32
    # The next plan tells the executor to drop it.
    sched.add_request(make_request("b", 3, 1, max_tokens=1))
    assert step(sched, mirror).finished_req_ids == ["a"]


def test_token_budget_and_sequence_cap():
    sched = make_scheduler(max_num_seqs=3, budget=16)
    mirror = PlanMirror(block_size=4)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 10, i, max_tokens=3))
    p0 = step(sched, mirror)
    # r0 takes 10 tokens, r1 the remaining 6 as a chunk; the budget is spent.
    assert [(r.req_id, r.num_scheduled_tokens) for r in p0.new_reqs] == [("r0", 10), ("r1", 6)]
    p1 = step(sched, mirror)
    # Running first: r0 decodes 1, r1 finishes its prompt (4); r2 gets 10; the cap of 3
    # sequences keeps r3 waiting although 1 token of budget is left.
    assert [(r.req_id, r.num_scheduled_tokens) for r in p1.cached_reqs] == [("r0", 1), ("r1", 4)]
    assert [(r.req_id, r.num_scheduled_tokens) for r in p1.new_reqs] == [("r2", 10)]
    assert [r.req_id for r in sched.queues.waiting] == ["r3", "r4"]
    run_to_end(sched, mirror)


def test_long_prompt_is_chunked_across_steps():
    sched, mirror = make_scheduler(block_size=4, budget=8), PlanMirror(block_size=4)
    req = make_request("long", 20, 0, max_tokens=2)
    sched.add_request(req)
    p0, p1, p2 = step(sched, mirror), step(sched, mirror), step(sched, mirror)
    assert (p0.new_reqs[0].num_scheduled_tokens, p0.new_reqs[0].block_ids) == (8, [0, 1])
    assert [(c.num_computed_tokens, c.num_scheduled_tokens, c.new_block_ids)
            for c in p1.cached_reqs + p2.cached_reqs] == [(8, 8, [2, 3]), (16, 4, [4])]
    assert req.num_output_tokens == 1  # sampled only when the last chunk was computed
    run_to_end(sched, mirror)
    assert req.num_output_tokens == 2


def test_prefill_and_decode_share_a_step():
    sched, mirror = make_scheduler(budget=32), PlanMirror(block_size=4)
    sched.add_request(make_request("first", 5, 0, max_tokens=5))
    step(sched, mirror)
    sched.add_request(make_request("second", 9, 1, max_tokens=5))
    plan = step(sched, mirror)
    assert [(c.req_id, c.num_scheduled_tokens) for c in plan.cached_reqs] == [("first", 1)]
    assert [(n.req_id, n.num_scheduled_tokens) for n in plan.new_reqs] == [("second", 9)]


def uninterrupted_outputs(prompts: dict[str, int], max_tokens: int) -> dict[str, list[int]]:
    sched, mirror = make_scheduler(num_blocks=64), PlanMirror(block_size=4)
    reqs = [make_request(r, n, i, max_tokens=max_tokens) for i, (r, n) in enumerate(prompts.items())]
    for req in reqs:
        sched.add_request(req)
    run_to_end(sched, mirror)
    return {req.req_id: req.output_token_ids for req in reqs}


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempts_newest_by_recompute_and_resumes_with_generated_tokens(prefix_caching):
    # 4 blocks of 4 tokens: two 7-token prompts fill the pool once each has 8 tokens.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, max_model_len=16,
                           enable_prefix_caching=prefix_caching)
    mirror = PlanMirror(block_size=4)
    old, new, late = (make_request("old", 7, 0, max_tokens=6), make_request("new", 7, 1, 6),
                      make_request("late", 3, 2, max_tokens=2))
    for req in (old, new, late):
        sched.add_request(req)
    step(sched, mirror)  # both prompts; "late" waits for a sequence slot
    step(sched, mirror)  # both decode into the last slot of their second block
    plan = step(sched, mirror)  # "old" needs a third block: the newest running one goes
    assert plan.preempted_req_ids == ["new"]
    # "new" held blocks 2 and 3; freed tail first, so block 3 is handed out first.
    assert [(c.req_id, c.new_block_ids) for c in plan.cached_reqs] == [("old", [3])]
    assert plan.new_reqs == []  # no admissions in a step that preempted
    assert [r.req_id for r in sched.queues.waiting] == ["new", "late"]  # requeued at the front
    assert new.num_computed_tokens == 0 and new.num_output_tokens == 2
    assert sched.block_manager.block_table("new") == []
    generated_before = list(new.output_token_ids)

    plans = run_to_end(sched, mirror)
    resumed = next(n for p in plans for n in p.new_reqs if n.req_id == "new")
    assert resumed.token_ids == new.prompt_token_ids + generated_before
    # With prefix caching, "new"'s first block (full, computed, freed last) survived in the
    # evictable pool: the resumed request skips it.
    assert resumed.num_computed_tokens == (4 if prefix_caching else 0)
    assert sched.counters.num_preemptions >= 1
    # Recompute is invisible in the output: same tokens as a run with a roomy pool.
    expected = uninterrupted_outputs({"old": 7, "new": 7, "late": 3}, max_tokens=6)
    assert old.output_token_ids == expected["old"]
    assert new.output_token_ids == expected["new"]


@pytest.mark.parametrize("case", ["eos", "ignore_eos", "stop_id", "max_tokens", "max_model_len"])
def test_stop_conditions(case):
    sched = make_scheduler(max_model_len=12)
    stop_after = 3  # the null model emits the special id as its 3rd token
    special = 7

    def sample(req_id, ids):
        return {"eos": EOS, "ignore_eos": EOS}.get(case, special) if len(ids) == 5 + stop_after - 1 \
            else 10 + len(ids)

    mirror = PlanMirror(block_size=4, sample=sample)
    kw = dict(max_tokens=100)
    if case == "ignore_eos":
        kw["ignore_eos"] = True
    if case == "stop_id":
        kw["stop_token_ids"] = frozenset({special})
    if case == "max_tokens":
        kw["max_tokens"] = 2
    req = make_request("r", 5, 0, **kw)
    sched.add_request(req)
    run_to_end(sched, mirror)
    expected_status, expected_len = {
        "eos": (RequestStatus.FINISHED_STOPPED, 3),
        "ignore_eos": (RequestStatus.FINISHED_LENGTH, 7),  # runs on to max_model_len 12
        "stop_id": (RequestStatus.FINISHED_STOPPED, 3),
        "max_tokens": (RequestStatus.FINISHED_LENGTH, 2),
        "max_model_len": (RequestStatus.FINISHED_LENGTH, 7),  # 7 is not a stop id here
    }[case]
    assert (req.status, req.num_output_tokens) == (expected_status, expected_len)
    assert req.num_tokens <= 12


def test_abort_frees_blocks_and_reports_only_what_the_executor_holds():
    sched, mirror = make_scheduler(max_num_seqs=1), PlanMirror(block_size=4)
    running, waiting = make_request("run", 9, 0), make_request("wait", 4, 1)
    sched.add_request(running)
    sched.add_request(waiting)
    step(sched, mirror)
    assert sched.block_manager.num_free_blocks == 32 - 3
    assert sched.abort_request("run") is running
    assert sched.abort_request("wait") is waiting
    assert sched.abort_request("nope") is None
    assert running.status is waiting.status is RequestStatus.FINISHED_ABORTED
    assert sched.block_manager.num_free_blocks == 32
    sched.add_request(make_request("next", 2, 2, max_tokens=1))
    plan = step(sched, mirror)
    assert plan.finished_req_ids == ["run"]  # "wait" was never sent to the executor


def test_result_for_an_aborted_request_is_ignored():
    sched, mirror = make_scheduler(), PlanMirror(block_size=4)
    a, b = make_request("a", 3, 0), make_request("b", 3, 1, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    plan = sched.schedule()
    sched.abort_request("a")  # while the step is in flight
    outputs = sched.update(mirror.apply(plan))
    assert [o.req.req_id for o in outputs] == ["b"]
    assert a.output_token_ids == []
    sched.block_manager.check_invariants()


def test_copy_on_write_resends_the_request_with_its_new_table():
    sched, mirror = make_scheduler(block_size=4), PlanMirror(block_size=4)
    req = make_request("a", 6, 0, max_tokens=4)
    sched.add_request(req)
    step(sched, mirror)  # blocks [0, 1]; block 1 holds positions 4 and 5
    # A sibling sequence (as n > 1 or beam search create) now shares both blocks.
    sched.block_manager.fork("a", "sibling")
    plan = step(sched, mirror)
    # Writing position 6 into the shared, partly filled block 1 copies it first; the executor
    # only appends blocks for cached requests, so "a" is re-sent whole with its new table.
    assert plan.block_copies == [(1, 2)]
    assert plan.cached_reqs == []
    assert [(n.req_id, n.block_ids, n.num_computed_tokens, n.num_scheduled_tokens)
            for n in plan.new_reqs] == [("a", [0, 2], 6, 1)]
    assert sched.block_manager.block_table("sibling") == [0, 1]
    assert mirror.num_copied == 1
    sched.block_manager.free("sibling")
    run_to_end(sched, mirror)
    assert req.output_token_ids == uninterrupted_outputs({"a": 6}, max_tokens=4)["a"]

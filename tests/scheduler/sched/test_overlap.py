"""Overlapped scheduling: a plan made while the previous one's result is still out.

The oracle is the same workload run in lockstep (plan, result, plan...): every request must end
with the same tokens and status, and every plan must pass the KV-simulating mirrors. The engine
half runs the real SchedulerServer against a null-model executor over ZeroMQ.
"""

from __future__ import annotations

import asyncio

import pytest

from protos.plan import SamplingSpec
from scheduler_svc.sched.request import Request, RequestStatus
from tests.scheduler.grpc_harness import collect, gen_request, null_continuation, running_server
from tests.scheduler.kv_mirror import KVMirror
from tests.scheduler.null_executor import PlanMirror
from tests.scheduler.sched.test_beam_search_scheduler import CASES, make_beam_group
from tests.scheduler.sched.test_parallel_sampling import (
    BLOCK_SIZE,
    EOS,
    make_group,
    make_scheduler,
    run,
)


def plain(req_id: str, arrival: int, num_prompt: int = 9, max_tokens: int = 7, **kwargs):
    prompt = [20 + (arrival * 11 + i) % 40 for i in range(num_prompt)]
    return Request(req_id=req_id, prompt_token_ids=prompt, sampling=SamplingSpec(temperature=0.0),
                   arrival=arrival, max_tokens=max_tokens, eos_token_ids=frozenset({EOS}),
                   **kwargs)


def workload(sched) -> None:
    sched.add_request(plain("a", 0, num_prompt=13, max_tokens=12, ignore_eos=True))
    sched.add_group(make_group("p", num_prompt=10, n=3, arrival=1, max_tokens=9))
    sched.add_request(plain("b", 2, num_prompt=30, max_tokens=3))  # chunked by the budget
    sched.add_request(plain("c", 3, num_prompt=5, max_tokens=1))


@pytest.mark.parametrize("pool", [
    dict(num_blocks=64),
    dict(num_blocks=14),  # preempts by recompute
    dict(num_blocks=14, num_cpu_blocks=32, preemption_mode="swap"),
], ids=["roomy", "recompute", "swap"])
def test_overlapped_runs_equal_lockstep_runs(pool):
    results = {}
    for overlap in (False, True):
        sched, mirror = make_scheduler(budget=16, **pool), KVMirror(BLOCK_SIZE)
        workload(sched)
        tokens, finished, plans = run(sched, mirror, overlap=overlap)
        results[overlap] = (tokens, finished)
        if overlap and sched.counters.num_preemptions == 0:
            # Nothing is computed past max_tokens: "a" ends with 13 + 12 tokens and its last
            # sampled token is never fed back, though its plans went out before its results.
            scheduled_a = sum(r.num_scheduled_tokens for p in plans
                              for r in (*p.new_reqs, *p.cached_reqs) if r.req_id == "a")
            assert scheduled_a == 13 + 12 - 1
    assert results[True] == results[False]
    assert len(results[True][0][("a", 0)]) == 12


def test_beam_search_falls_back_to_lockstep():
    sched, mirror = make_scheduler(budget=16), KVMirror(BLOCK_SIZE)
    sched.add_request(plain("a", 0, max_tokens=20, ignore_eos=True))
    first = sched.schedule()
    second = sched.schedule()
    assert second is not None  # a plain request: planned ahead
    sched.update(mirror.apply(first))
    sched.add_group(make_beam_group("b", CASES[2], arrival=1))
    assert sched.schedule() is None  # a beam search waits for each result
    sched.update(mirror.apply(second))
    third = sched.schedule()  # nothing in flight: admits the beams' root
    assert third is not None and any(r.req_id.startswith("b/") for r in third.new_reqs)
    assert sched.schedule() is None
    sched.update(mirror.apply(third))


def test_overlapped_beams_next_to_parallel_and_plain_equal_lockstep():
    from tests.scheduler.sched.test_beam_search_scheduler import PROMPT

    results = {}
    for overlap in (False, True):
        sched, mirror = make_scheduler(budget=8), KVMirror(BLOCK_SIZE)
        sched.add_request(plain("a", 0, max_tokens=10, ignore_eos=True))
        sched.add_group(make_beam_group("b1", CASES[0], arrival=1))
        sched.add_group(make_group("p", num_prompt=11, n=3, arrival=2))
        sched.add_group(make_beam_group("b2", CASES[3], prompt=PROMPT[::-1], arrival=3))
        tokens, finished, _ = run(sched, mirror, overlap=overlap)
        results[overlap] = (tokens, finished)
    assert results[True] == results[False]


def test_a_failed_step_fails_its_requests_and_the_plan_behind_it_serves_the_rest():
    sched = make_scheduler()
    mirror = PlanMirror(block_size=BLOCK_SIZE)
    sched.add_request(plain("a", 0, max_tokens=8))
    first = sched.schedule()  # a's prompt
    sched.add_request(plain("b", 1, max_tokens=4, ignore_eos=True))
    second = sched.schedule()  # a's first decode + b's prompt, planned while first runs
    assert [r.req_id for r in second.cached_reqs] == ["a"]
    assert [r.req_id for r in second.new_reqs] == ["b"]
    error = mirror.fail(first)
    failed = sched.fail_requests(sched.abandon_oldest())
    assert [r.req_id for r in failed] == ["a"] and error.step_id == first.step_id
    result = mirror.apply(second)  # skips a, whose state went with the failed step
    assert [r for r, _ in result.sampled] == ["b"]
    outputs = sched.update(result)
    tokens = [t for o in outputs for t in o.new_token_ids]
    while sched.has_unfinished():
        plan = sched.schedule()
        tokens += [t for o in sched.update(mirror.apply(plan)) for t in o.new_token_ids]
    b = [20 + (11 + i) % 40 for i in range(9)]
    assert tokens == null_continuation(b, 4)
    assert failed[0].status is RequestStatus.FINISHED_ERROR
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


@pytest.mark.parametrize("overlap", [True, False])
async def test_engine_plans_ahead_unless_told_not_to(tiny_tokenizer, overlap):
    async with running_server(tiny_tokenizer, overlap_scheduling=overlap) as harness:
        await harness.serve(step_delay_s=0.01)
        prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
        calls = [collect(harness.stub.Generate(gen_request(p, max_tokens=8, ignore_eos=True)))
                 for p in prompts]
        for prompt, responses in zip(prompts, await asyncio.gather(*calls), strict=True):
            assert [t for r in responses for t in r.token_ids] == null_continuation(prompt, 8)
        assert (harness.server.engine.stats.num_overlapped_steps > 0) is overlap
        stats = await harness.stats()
        assert stats.num_steps > 0 and stats.scheduler_busy_s > 0
        assert stats.kv_blocks_free == stats.kv_blocks_total

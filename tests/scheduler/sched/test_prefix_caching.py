"""Automatic prefix caching in the scheduler: shared prompt prefixes are computed once, full
blocks only, never before the step that computed them, and an evicted block is never read.

Plans run through `PlanMirror`, which simulates the KV pool slot by slot: a request that reads
a block whose contents are not its own tokens fails the step."""

from __future__ import annotations

from protos.plan import SamplingSpec
from scheduler_svc.sched.request import Request, RequestStatus
from scheduler_svc.sched.scheduler import _Step
from tests.scheduler.null_executor import PlanMirror
from tests.scheduler.sched.test_scheduler import make_scheduler, run_to_end, step

BS = 4
SYSTEM = [30 + i % 40 for i in range(40)]  # 10 full blocks


def req(req_id: str, prompt: list[int], arrival: int, max_tokens: int = 3, salt: str = ""):
    return Request(req_id=req_id, prompt_token_ids=list(prompt),
                   sampling=SamplingSpec(temperature=0.0),
                   max_tokens=max_tokens, arrival=arrival, cache_salt=salt)


def test_a_shared_system_prompt_is_computed_once():
    sched, mirror = make_scheduler(num_blocks=64, block_size=BS), PlanMirror(BS)
    first = req("first", SYSTEM + [5, 6], 0)
    sched.add_request(first)
    p0 = step(sched, mirror)
    assert p0.new_reqs[0].num_computed_tokens == 0 and sched.counters.num_prompt_tokens == 42
    first_blocks = p0.new_reqs[0].block_ids
    second = req("second", SYSTEM + [7, 8, 9], 1)
    sched.add_request(second)
    p1 = step(sched, mirror)
    new = p1.new_reqs[0]
    # The 10 system blocks are reused; only the 3 own tokens are computed.
    assert new.block_ids[:10] == first_blocks[:10]
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (40, 3)
    assert second.num_cached_tokens == 40 and first.num_cached_tokens == 0
    assert sched.counters.num_prompt_tokens == 42 + 3
    counters = sched.counters
    assert (counters.prefix_cache_queries, counters.prefix_cache_hits) == (42 + 43, 40)
    assert sched.block_manager.ref_counts[first_blocks[0]] == 2
    run_to_end(sched, mirror)
    assert first.output_token_ids and second.output_token_ids


def test_a_fully_cached_prompt_still_computes_its_last_block():
    sched, mirror = make_scheduler(block_size=BS), PlanMirror(BS)
    prompt = SYSTEM[:16]  # exactly 4 full blocks
    sched.add_request(req("a", prompt, 0))
    run_to_end(sched, mirror)
    twin = req("b", prompt, 1)
    sched.add_request(twin)
    plan = step(sched, mirror)
    # At most 15 tokens may be skipped; only full blocks are shared: 3 blocks = 12 tokens.
    assert (plan.new_reqs[0].num_computed_tokens, plan.new_reqs[0].num_scheduled_tokens) == (12, 4)
    assert twin.num_cached_tokens == 12
    run_to_end(sched, mirror)


def test_blocks_are_cached_only_after_the_step_that_computed_them():
    sched, mirror = make_scheduler(block_size=BS), PlanMirror(BS)
    sched.add_request(req("a", SYSTEM, 0))
    sched.add_request(req("b", SYSTEM, 1))
    plan = step(sched, mirror)  # both in one step: nothing is cached yet
    assert [n.num_computed_tokens for n in plan.new_reqs] == [0, 0]
    assert sched.counters.prefix_cache_hits == 0
    sched.add_request(req("c", SYSTEM, 2))
    assert step(sched, mirror).new_reqs[0].num_computed_tokens == 36
    run_to_end(sched, mirror)


def test_chunked_prompt_blocks_become_reusable_chunk_by_chunk():
    sched, mirror = make_scheduler(block_size=BS, budget=10, max_num_seqs=1), PlanMirror(BS)
    sched.add_request(req("a", SYSTEM, 0, max_tokens=1))
    step(sched, mirror)  # 10 tokens: blocks 0 and 1 full
    assert sched.block_manager.num_cached_blocks == 2
    run_to_end(sched, mirror)
    assert sched.block_manager.num_cached_blocks == 10


def test_salt_and_the_switch_isolate_the_cache():
    for kwargs, salt in (({}, "tenant-b"), ({"enable_prefix_caching": False}, "")):
        sched, mirror = make_scheduler(block_size=BS, **kwargs), PlanMirror(BS)
        sched.add_request(req("a", SYSTEM, 0))
        run_to_end(sched, mirror)
        sched.add_request(req("b", SYSTEM, 1, salt=salt))
        assert step(sched, mirror).new_reqs[0].num_computed_tokens == 0
        run_to_end(sched, mirror)
    counters = sched.counters
    assert (counters.prefix_cache_queries, counters.prefix_cache_hits) == (0, 0)  # switched off


def test_evicted_blocks_are_never_read_and_survivors_are_reused():
    # 16 blocks. "a" leaves 10 cached blocks; "filler" then needs 12 blocks, taking the
    # 6 never-cached free ones and evicting the 6 least recently used cached ones: a's tail
    # (freed first). The re-sent prompt finds only its first 4 blocks.
    sched, mirror = make_scheduler(num_blocks=16, block_size=BS), PlanMirror(BS)
    sched.add_request(req("a", SYSTEM, 0, max_tokens=1))
    run_to_end(sched, mirror)
    assert sched.block_manager.num_cached_blocks == 10
    filler = [200 + i for i in range(47)]
    sched.add_request(req("filler", filler, 1, max_tokens=1))
    run_to_end(sched, mirror)
    again = req("again", SYSTEM, 2, max_tokens=4)
    sched.add_request(again)
    plan = step(sched, mirror)
    assert plan.new_reqs[0].num_computed_tokens == 16 and again.num_cached_tokens == 16
    run_to_end(sched, mirror)  # the mirror checks every read against the written tokens
    fresh_sched, fresh_mirror = make_scheduler(num_blocks=64, block_size=BS), PlanMirror(BS)
    oracle = req("again", SYSTEM, 0, max_tokens=4)
    fresh_sched.add_request(oracle)
    run_to_end(fresh_sched, fresh_mirror)
    assert again.output_token_ids == oracle.output_token_ids


def test_recompute_resumes_from_surviving_blocks_and_counts_cached_tokens_once():
    sched = make_scheduler(num_blocks=6, block_size=BS, max_num_seqs=2, max_model_len=24)
    mirror = PlanMirror(BS)
    a, b = req("a", SYSTEM[:9], 0, max_tokens=12), req("b", SYSTEM[20:29], 1, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    plans = run_to_end(sched, mirror)
    assert sched.counters.num_preemptions >= 1 and b.num_preemptions >= 1
    resumed = [n for p in plans for n in p.new_reqs if n.req_id == "b"][1:]
    assert resumed and all(n.num_computed_tokens % BS == 0 for n in resumed)
    assert b.num_cached_tokens == 0  # usage counts the first admission only


def test_a_request_owed_prompt_logprobs_reads_no_cache_until_its_first_token():
    """Prompt logprobs need every prompt position computed: while they are owed the request
    reads no cached block; after its first token it stops asking, so a recompute preemption
    re-sends it without them and reads the cache again."""
    sched = make_scheduler(num_blocks=64, block_size=BS, preemption_mode="recompute")
    mirror = PlanMirror(block_size=BS)
    sched.add_request(req("first", SYSTEM + [1, 2], 0))
    run_to_end(sched, mirror)
    asking = Request(req_id="asking", prompt_token_ids=SYSTEM + [3, 4],
                     sampling=SamplingSpec(temperature=0.0, prompt_logprobs=2), max_tokens=5,
                     arrival=1)
    sched.add_request(asking)
    plan = step(sched, mirror)
    [new] = plan.new_reqs
    assert new.num_computed_tokens == 0 and new.sampling.prompt_logprobs == 2
    assert asking.num_cached_tokens == 0
    assert asking.output_token_ids and asking.sampling.prompt_logprobs == -1
    # Preempted by recompute now, it comes back without asking and with the cached prefix.
    sched._preempt(asking, _Step(budget=0))  # what running short of blocks does
    assert asking.status is RequestStatus.WAITING
    plan = step(sched, mirror)
    assert plan.preempted_req_ids == ["asking"]
    [again] = plan.new_reqs
    assert again.sampling.prompt_logprobs == -1 and again.num_computed_tokens >= len(SYSTEM)

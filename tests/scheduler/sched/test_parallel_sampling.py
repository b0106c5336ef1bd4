"""Parallel sampling (n > 1) in the scheduler: fork after the shared prompt, copy-on-write of
the partly filled block, sequences that finish on their own, abort and preemption.

Every plan runs through `KVMirror`, which checks that each sequence reads only its own KV
(a wrong share or a missing copy fails the step) and never writes a block another holds.
"""

from __future__ import annotations

from collections import deque

from protos.plan import SamplingSpec
from scheduler_svc.sched.block_manager import BlockManager
from scheduler_svc.sched.request import Request, RequestStatus
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.sequence_group import ParallelGroup
from scheduler_svc.sched.sequence_params import SequenceParams
from tests.scheduler.kv_mirror import KVMirror

EOS = 1
BLOCK_SIZE = 4


def make_scheduler(num_blocks=64, budget=64, max_model_len=128, max_num_seqs=32,
                   **kwargs) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK_SIZE, kwargs.pop("num_cpu_blocks", 0)),
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len, **kwargs)


def make_group(req_id: str, num_prompt: int, n: int, arrival: int = 0, max_tokens: int = 6,
               seed: int | None = 5, temperature: float = 1.0,
               stop_token_ids: frozenset[int] = frozenset()) -> ParallelGroup:
    def new_request(seq_id, prompt, sampling, index):
        return Request(req_id=seq_id, prompt_token_ids=prompt, sampling=sampling,
                       max_tokens=max_tokens, arrival=arrival, eos_token_ids=frozenset({EOS}),
                       stop_token_ids=stop_token_ids, index=index)

    prompt = [20 + (arrival * 13 + i) % 50 for i in range(num_prompt)]
    return ParallelGroup(req_id, SequenceParams(n=n), prompt,
                         SamplingSpec(temperature=temperature, seed=seed), new_request)


def run(sched: Scheduler, mirror: KVMirror, max_steps: int = 300, on_step=None,
        overlap: bool = False):
    """Step until nothing is unfinished; returns {(req_id, index): tokens} and the plans.
    With `overlap`, each plan is made while the previous one's result is still out (as the
    engine does), and the result is applied after."""
    tokens: dict[tuple[str, int], list[int]] = {}
    finished: dict[tuple[str, int], RequestStatus] = {}
    plans = []
    in_flight: deque = deque()  # results made by the executor, not applied yet
    depth = 2 if overlap else 1
    while sched.has_unfinished() or in_flight:
        assert len(plans) < max_steps, "requests never finished"
        plan = sched.schedule() if sched.has_unfinished() and len(in_flight) < depth else None
        if plan is None:
            assert in_flight, "unfinished requests but nothing schedulable"
        else:
            assert plan.num_scheduled_tokens <= sched.max_num_batched_tokens
            plans.append(plan)
            in_flight.append(mirror.apply(plan))
        if plan is not None and len(in_flight) < depth:
            continue
        for out in sched.update(in_flight.popleft()):
            key = (out.req.group.req_id if out.req.group else out.req.req_id, out.req.index)
            assert key not in finished, f"{key} got output after it finished"
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                finished[key] = out.req.status
        sched.block_manager.check_invariants()
        if on_step is not None:
            on_step(len(plans))
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return tokens, finished, plans


def test_children_share_the_prompt_and_copy_the_partial_block():
    sched, mirror = make_scheduler(), KVMirror(BLOCK_SIZE)
    group = make_group("g", num_prompt=10, n=4)
    sched.add_group(group)
    p0 = sched.schedule()  # the parent computes prompt[:-1]: 9 tokens in blocks 0, 1, 2
    assert [(r.req_id, r.num_scheduled_tokens) for r in p0.new_reqs] == [("g/prompt", 9)]
    parent_table = list(p0.new_reqs[0].block_ids)
    assert sched.update(mirror.apply(p0)) == []  # the parent's draw is nobody's token
    p1 = sched.schedule()
    assert p1.finished_req_ids == ["g/prompt"]  # forked, then dropped
    children = {r.req_id: r for r in p1.new_reqs}
    assert sorted(children) == [f"g/{i}" for i in range(4)]
    for child in children.values():
        assert (child.num_computed_tokens, child.num_scheduled_tokens) == (9, 1)
        assert child.block_ids[:2] == parent_table[:2]  # full prompt blocks: shared
        assert child.token_ids == group.outputs[0].prompt_token_ids
    last_blocks = {c.block_ids[2] for c in children.values()}
    assert len(last_blocks) == 4  # each child its own copy of the partly filled block ...
    assert sorted(src for src, _ in p1.block_copies) == [parent_table[2]] * 3  # ... 3 copied
    assert {dst for _, dst in p1.block_copies} | {parent_table[2]} == last_blocks
    seeds = [c.sampling.seed for c in children.values()]
    assert len(set(seeds)) == 4 and group.outputs[0].sampling.seed == 5
    sched.update(mirror.apply(p1))
    tokens, finished, _ = run(sched, mirror)
    assert all(len(t) == 5 for t in tokens.values())  # 1 token above + 5 here = max_tokens
    assert set(finished.values()) == {RequestStatus.FINISHED_LENGTH}


def test_blocks_used_are_prompt_once_plus_each_sequence_tail():
    sched, mirror = make_scheduler(num_blocks=64), KVMirror(BLOCK_SIZE)
    sched.add_group(make_group("g", num_prompt=33, n=8, max_tokens=8))
    peak = 0

    def watch(_):
        nonlocal peak
        peak = max(peak, sched.block_manager.num_blocks - sched.block_manager.num_free_blocks)

    tokens, _, _ = run(sched, mirror, on_step=watch)
    assert all(len(t) == 8 for t in tokens.values()) and len(tokens) == 8
    full_prompt_blocks = 33 // BLOCK_SIZE  # 8, shared
    tail_blocks = -(-(33 + 8) // BLOCK_SIZE) - full_prompt_blocks  # 3 per sequence
    assert peak <= full_prompt_blocks + 8 * tail_blocks  # 32, not 8 x 11 = 88


def test_sequences_finish_on_their_own():
    free_run, _, _ = run_group(stop_token_ids=frozenset())
    # A stop id that sequence 2 emits third: it stops there, the others go on unless they
    # emit it too (then they stop at their own first occurrence).
    stop_id = free_run[("g", 2)][2]
    tokens, finished, _ = run_group(stop_token_ids=frozenset({stop_id}))
    for key, full in free_run.items():
        cut = full.index(stop_id) + 1 if stop_id in full else len(full)
        assert tokens[key] == full[:cut], key
        assert finished[key] is (RequestStatus.FINISHED_STOPPED if stop_id in full
                                 else RequestStatus.FINISHED_LENGTH)
    assert len(tokens[("g", 2)]) == 3 and any(len(t) == 10 for t in tokens.values())


def run_group(stop_token_ids, **kwargs):
    sched, mirror = make_scheduler(**{k: v for k, v in kwargs.items() if k != "budget"},
                                   budget=kwargs.get("budget", 64)), KVMirror(BLOCK_SIZE)
    sched.add_group(make_group("g", num_prompt=13, n=4, max_tokens=10,
                               stop_token_ids=stop_token_ids))
    return run(sched, mirror)


def test_seeded_sequences_are_reproducible_and_preemption_keeps_them():
    roomy, _, _ = run_group(frozenset())
    again, _, _ = run_group(frozenset())
    assert roomy == again and len({tuple(t) for t in roomy.values()}) == 4
    # 9 blocks: the four sequences need 3 shared + 4 x 3 at the end, so some are preempted
    # (recomputed, or swapped with a CPU pool) and resume with the same tokens.
    for extra in ({}, {"num_cpu_blocks": 16, "preemption_mode": "swap"}):
        sched, mirror = make_scheduler(num_blocks=9, **extra), KVMirror(BLOCK_SIZE)
        sched.add_group(make_group("g", num_prompt=13, n=4, max_tokens=10))
        tight, _, _ = run(sched, mirror)
        assert tight == roomy, extra
        assert sched.counters.num_preemptions > 0


def test_small_token_budget_chunks_the_shared_prompt():
    roomy, _, _ = run_group(frozenset())
    chunked, _, plans = run_group(frozenset(), budget=3)
    assert chunked == roomy
    assert all(p.num_scheduled_tokens <= 3 for p in plans)


def test_greedy_copies_are_identical():
    sched, mirror = make_scheduler(), KVMirror(BLOCK_SIZE)
    sched.add_group(make_group("g", num_prompt=6, n=3, temperature=0.0, seed=None))
    tokens, _, _ = run(sched, mirror)
    assert len({tuple(t) for t in tokens.values()}) == 1 and len(tokens) == 3


def test_one_token_prompt_has_no_parent():
    sched, mirror = make_scheduler(), KVMirror(BLOCK_SIZE)
    sched.add_group(make_group("g", num_prompt=1, n=3))
    p0 = sched.schedule()
    assert sorted(r.req_id for r in p0.new_reqs) == ["g/0", "g/1", "g/2"]
    sched.update(mirror.apply(p0))
    tokens, _, _ = run(sched, mirror)
    assert sorted(tokens) == [("g", 0), ("g", 1), ("g", 2)]


def test_abort_before_and_after_the_fork_frees_everything():
    for num_steps in (0, 1, 3):
        sched, mirror = make_scheduler(), KVMirror(BLOCK_SIZE)
        group = make_group("g", num_prompt=10, n=3, max_tokens=50)
        sched.add_group(group)
        for _ in range(num_steps):
            sched.update(mirror.apply(sched.schedule()))
        aborted = sched.abort_group("g")
        assert sorted(r.index for r in aborted) == [0, 1, 2]
        assert all(r.status is RequestStatus.FINISHED_ABORTED for r in group.outputs)
        assert not sched.has_unfinished() and "g" not in sched.queues.groups
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
        assert sched.abort_group("g") == []
        sched.add_request(Request(req_id="next", prompt_token_ids=[30, 31], arrival=9,
                                  sampling=SamplingSpec(temperature=0.0), max_tokens=1))
        sched.update(mirror.apply(sched.schedule()))  # tells the executor to drop them all
        assert set(mirror.reqs) <= {"next"}


def test_forks_stay_within_max_num_seqs():
    # Admitted one by one, the two parents and the plain request would fork into 7 sequences.
    sched, mirror = make_scheduler(max_num_seqs=4), KVMirror(BLOCK_SIZE)
    sched.add_group(make_group("a", num_prompt=6, n=3, arrival=0))
    sched.add_group(make_group("b", num_prompt=7, n=3, arrival=1))
    sched.add_request(Request(req_id="c", prompt_token_ids=[30, 31, 32], sampling=SamplingSpec(),
                              max_tokens=4, arrival=2, eos_token_ids=frozenset({EOS})))
    peak = 0

    def watch(_):
        nonlocal peak
        peak = max(peak, len(sched.queues.running))

    tokens, _, _ = run(sched, mirror, on_step=watch)
    assert peak == 4  # "a"'s three and "c", never "b"'s three next to "a"'s
    assert sorted(tokens) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2),
                              ("c", 0)]


def test_a_group_wider_than_max_num_seqs_runs_alone():
    sched, mirror = make_scheduler(max_num_seqs=2), KVMirror(BLOCK_SIZE)
    sched.add_request(Request(req_id="c", prompt_token_ids=[30, 31, 32], sampling=SamplingSpec(),
                              max_tokens=4, arrival=0, eos_token_ids=frozenset({EOS})))
    sched.add_group(make_group("g", num_prompt=6, n=3, arrival=1))
    sched.add_request(Request(req_id="d", prompt_token_ids=[33, 34], sampling=SamplingSpec(),
                              max_tokens=4, arrival=2, eos_token_ids=frozenset({EOS})))
    alone = []

    def watch(_):
        if any(r.group is not None for r in sched.queues.running):
            alone.append(all(r.group is not None for r in sched.queues.running))

    tokens, _, _ = run(sched, mirror, on_step=watch)
    assert alone and all(alone)  # "g" waits for "c", and "d" waits for "g"
    assert len(tokens) == 5

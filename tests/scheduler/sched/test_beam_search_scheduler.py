"""Beam search run by the scheduler (forks on shared blocks, continues via new_token_ids, drops)
equals `BeamSearch` driven directly on the same deterministic null model.

`KVMirror` checks every step: a beam reads only its own KV, forks share blocks until one of
them writes (copy-on-write), and a dropped beam's blocks are never read again.
"""

from __future__ import annotations

import pytest

from protos.plan import SamplingSpec
from scheduler_svc.sched.beam_search import BeamSearch, EarlyStopping
from scheduler_svc.sched.request import Request, RequestStatus
from scheduler_svc.sched.sequence_group import BeamGroup
from scheduler_svc.sched.sequence_params import SequenceParams
from tests.scheduler.kv_mirror import VOCAB, KVMirror, null_logprobs
from tests.scheduler.sched.test_parallel_sampling import BLOCK_SIZE, EOS, make_scheduler, run

PROMPT = [20, 31, 42, 53, 64, 25, 36]  # 7 tokens: the first forks write a partly filled block
# (beam_width, n, length_penalty, early_stopping, max_tokens)
CASES = [
    (2, 1, 1.0, EarlyStopping.HEURISTIC, 9),
    (2, 2, 0.5, EarlyStopping.TRUE, 9),
    (4, 4, 2.0, EarlyStopping.NEVER, 7),
    (4, 2, -1.0, EarlyStopping.HEURISTIC, 10),
]


def stop_ids_for(prompt: list[int]) -> frozenset[int]:
    """Two likely tokens, so beams finish early and at different lengths."""
    first = null_logprobs(prompt)
    return frozenset({first[1][0], null_logprobs(prompt + [first[0][0]])[2][0]})


def make_beam_group(req_id: str, case, prompt=PROMPT, arrival: int = 0) -> BeamGroup:
    beam_width, n, length_penalty, early_stopping, max_tokens = case
    stops = stop_ids_for(prompt)

    def new_request(seq_id, tokens, sampling, index):
        return Request(req_id=seq_id, prompt_token_ids=tokens, sampling=sampling,
                       max_tokens=max_tokens, arrival=arrival, eos_token_ids=frozenset({EOS}),
                       stop_token_ids=stops, ignore_eos=True, index=index)

    params = SequenceParams(n=n, beam_width=beam_width, length_penalty=length_penalty,
                            early_stopping=early_stopping)
    return BeamGroup(req_id, params, prompt, max_tokens, stops, len(VOCAB) + 10, new_request)


def direct(case, prompt=PROMPT) -> dict[int, tuple[list[int], RequestStatus]]:
    beam_width, n, length_penalty, early_stopping, max_tokens = case
    search = BeamSearch(beam_width, max_tokens, stop_ids_for(prompt), length_penalty,
                        early_stopping)
    while not search.done:
        search.step([null_logprobs(prompt + b.token_ids)[:search.num_candidates]
                     for b in search.beams])
    return {i: (list(h.token_ids), RequestStatus.FINISHED_STOPPED if h.stopped
                else RequestStatus.FINISHED_LENGTH) for i, h in enumerate(search.best(n))}


def served(sched, mirror) -> tuple[dict, list]:
    tokens, finished, plans = run(sched, mirror)
    return {key: (tokens[key], finished[key]) for key in finished}, plans


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"k{c[0]}-n{c[1]}-{c[3].value}")
def test_scheduler_beams_equal_the_direct_search(case):
    sched, mirror = make_scheduler(), KVMirror(BLOCK_SIZE)
    sched.add_group(make_beam_group("b", case))
    got, plans = served(sched, mirror)
    assert got == {("b", i): v for i, v in direct(case).items()}
    # Beam outputs arrive once, complete, when the search ends.
    assert any(p.block_copies for p in plans), "forks at a partly filled block must copy it"
    assert any(c.new_token_ids for p in plans for c in p.cached_reqs)
    assert all(not r.sampling.append_sampled and r.sampling.num_logprobs >= 2 * case[0]
               for p in plans for r in p.new_reqs)


@pytest.mark.parametrize("budget", [1, 3])
def test_a_budget_smaller_than_the_beams_waits_for_all_of_them(budget):
    case = CASES[2]
    sched, mirror = make_scheduler(budget=budget), KVMirror(BLOCK_SIZE)
    sched.add_group(make_beam_group("b", case))
    got, plans = served(sched, mirror)
    assert got == {("b", i): v for i, v in direct(case).items()}
    assert all(p.num_scheduled_tokens <= budget for p in plans)


@pytest.mark.parametrize("extra", [{}, {"num_cpu_blocks": 32, "preemption_mode": "swap"}],
                         ids=["recompute", "swap"])
def test_preemption_restarts_the_search_with_the_same_answer(extra):
    case = CASES[2]
    # A plain request arrives first and holds blocks, so the beams run the pool dry.
    sched, mirror = make_scheduler(num_blocks=12, **extra), KVMirror(BLOCK_SIZE)
    sched.add_request(Request(req_id="old", prompt_token_ids=list(range(20, 34)), arrival=0,
                              sampling=SamplingSpec(temperature=0.0), max_tokens=12,
                              ignore_eos=True))
    group = make_beam_group("b", case, arrival=1)
    sched.add_group(group)
    got, _ = served(sched, mirror)
    assert {k: v for k, v in got.items() if k[0] == "b"} == \
        {("b", i): v for i, v in direct(case).items()}
    assert len(got[("old", 0)][0]) == 12
    assert group.num_restarts > 0 and sched.counters.num_preemptions > 0


def test_beams_next_to_parallel_and_plain_requests():
    from tests.scheduler.sched.test_parallel_sampling import make_group

    sched, mirror = make_scheduler(budget=8), KVMirror(BLOCK_SIZE)
    sched.add_group(make_beam_group("b1", CASES[0], arrival=0))
    sched.add_group(make_group("p", num_prompt=11, n=3, arrival=1))
    sched.add_group(make_beam_group("b2", CASES[3], prompt=PROMPT[::-1], arrival=2))
    got, _ = served(sched, mirror)
    assert {k: v for k, v in got.items() if k[0] == "b1"} == \
        {("b1", i): v for i, v in direct(CASES[0]).items()}
    assert {k: v for k, v in got.items() if k[0] == "b2"} == \
        {("b2", i): v for i, v in direct(CASES[3], PROMPT[::-1]).items()}
    assert sorted(k for k in got if k[0] == "p") == [("p", 0), ("p", 1), ("p", 2)]


def test_abort_mid_search_frees_every_beam():
    sched, mirror = make_scheduler(), KVMirror(BLOCK_SIZE)
    group = make_beam_group("b", CASES[2])
    sched.add_group(group)
    for _ in range(3):
        sched.update(mirror.apply(sched.schedule()))
    assert len(group.beams) == 4
    aborted = sched.abort_group("b")
    assert sorted(r.index for r in aborted) == [0, 1, 2, 3]
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in aborted)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_a_beam_search_holds_beam_width_sequence_slots():
    # Two searches of width 4 under max_num_seqs = 6: admitted together, their forks would
    # run 8 beams; the second waits for the first instead, and both answers are unchanged.
    sched, mirror = make_scheduler(max_num_seqs=6), KVMirror(BLOCK_SIZE)
    sched.add_group(make_beam_group("b1", CASES[2], arrival=0))
    sched.add_group(make_beam_group("b2", CASES[3], prompt=PROMPT[::-1], arrival=1))
    peak = 0

    def watch(_):
        nonlocal peak
        peak = max(peak, len(sched.queues.running))

    tokens, finished, _ = run(sched, mirror, on_step=watch)
    got = {key: (tokens[key], finished[key]) for key in finished}
    assert peak == 4
    assert {k: v for k, v in got.items() if k[0] == "b1"} == \
        {("b1", i): v for i, v in direct(CASES[2]).items()}
    assert {k: v for k, v in got.items() if k[0] == "b2"} == \
        {("b2", i): v for i, v in direct(CASES[3], PROMPT[::-1]).items()}


@pytest.mark.parametrize("num_prompt, max_tokens", [(7, 9), (8, 9), (8, 1), (13, 1), (5, 2)])
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"k{c[0]}-n{c[1]}")
def test_a_pool_of_the_admission_bound_runs_the_search_alone(case, num_prompt, max_tokens):
    """`check_beam_fits` admits a search into a pool of exactly its bound; there the search
    runs to its end without a preemption (which would restart it forever), with the answer
    of a roomy pool. One block fewer is refused. max_tokens 1: a prompt of max_model_len."""
    from scheduler_svc.api.inputs import check_beam_fits
    from scheduler_svc.errors import InvalidRequest
    from scheduler_svc.sched.request import SubmitParams

    case = (*case[:4], max_tokens)
    prompt = PROMPT[:1] + list(range(11, 11 + num_prompt - 1))
    params = SubmitParams(req_id="b", prompt_token_ids=prompt,
                          sampling=SamplingSpec(temperature=0.0),
                          sequence=SequenceParams(n=case[1], beam_width=case[0]))
    bound = next(n for n in range(1, 64)
                 if not _refused(check_beam_fits, params, max_tokens, make_scheduler(n)))
    with pytest.raises(InvalidRequest, match=f"may need {bound} KV blocks, but the pool has "
                                             f"{bound - 1}"):
        check_beam_fits(params, max_tokens, make_scheduler(bound - 1).block_manager)
    sched, mirror = make_scheduler(num_blocks=bound, max_model_len=num_prompt + max_tokens), \
        KVMirror(BLOCK_SIZE)
    sched.add_group(make_beam_group("b", case, prompt=prompt))
    got, _ = served(sched, mirror)
    assert got == {("b", i): v for i, v in direct(case, prompt).items()}
    assert sched.counters.num_preemptions == 0
    assert sched.block_manager.num_free_blocks == bound


def _refused(check, params, max_tokens, sched) -> bool:
    from scheduler_svc.errors import InvalidRequest

    try:
        check(params, max_tokens, sched.block_manager)
        return False
    except InvalidRequest:
        return True

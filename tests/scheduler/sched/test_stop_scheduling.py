"""A sequence stopped by its text (Scheduler.stop_request) while a step for it is in flight:
the step's token for it is discarded, its blocks are freed, its id rides the next plan's
finished list, and the executor's view (KVMirror, the null executor's PlanMirror) stays
consistent. Through the gRPC server with a null-model executor, overlap on and off, the
stream ends where the brute-force reference says.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from protos.folio.v1 import generator_pb2 as pb
from protos.plan import SamplingSpec
from scheduler_svc.sched.request import Request, RequestStatus
from tests.scheduler.api.test_server import wait_idle
from tests.scheduler.grpc_harness import collect, gen_request, running_server
from tests.scheduler.kv_mirror import KVMirror
from tests.scheduler.null_executor import make_hello
from tests.scheduler.sched.test_parallel_sampling import BLOCK_SIZE, make_group, make_scheduler
from tests.scheduler.text.test_stop_strings import reference

pytestmark = pytest.mark.timeout(60)


def plain(req_id: str, arrival: int = 0) -> Request:
    return Request(req_id=req_id, prompt_token_ids=[20 + i for i in range(6)],
                   sampling=SamplingSpec(temperature=0.0), max_tokens=50, arrival=arrival)


def test_a_token_in_flight_past_a_stop_is_discarded():
    sched, mirror = make_scheduler(), KVMirror(BLOCK_SIZE)
    sched.add_request(plain("a"))
    first = sched.schedule()
    second = sched.schedule()  # planned while the first runs: "a" decodes its next position
    assert second is not None and [r.req_id for r in second.cached_reqs] == ["a"]
    [out] = sched.update(mirror.apply(first))
    assert out.req.req_id == "a" and not out.finished
    sched.stop_request("a")  # the output processor found a stop string in its text
    assert out.req.status is RequestStatus.FINISHED_STOPPED and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert sched.update(mirror.apply(second)) == []  # its token past the stop: dropped
    sched.stop_request("a")  # already gone: nothing happens
    sched.add_request(plain("b", arrival=1))
    third = sched.schedule()
    assert third.finished_req_ids == ["a"]
    mirror.apply(third)  # the executor drops "a": it held it
    assert "a" not in mirror.reqs


def test_stopping_one_sequence_of_a_group_leaves_the_others_running():
    sched, mirror = make_scheduler(), KVMirror(BLOCK_SIZE)
    sched.add_group(make_group("g", num_prompt=9, n=2, max_tokens=8))
    outputs = []
    while not outputs:
        outputs = sched.update(mirror.apply(sched.schedule()))
    sched.stop_request("g/0")
    assert "g" in sched.queues.groups and [r.req_id for r in sched.queues.running] == ["g/1"]
    while sched.has_unfinished():
        for out in sched.update(mirror.apply(sched.schedule())):
            assert out.req.req_id == "g/1"
    assert "g" not in sched.queues.groups
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def per_token(responses) -> dict[int, dict]:
    seqs: dict[int, dict] = defaultdict(lambda: dict(deltas=[], tokens=[], text="", end=None))
    for r in responses:
        seq = seqs[r.index]
        seq["deltas"] += [""] * (len(r.token_ids) - 1) + [r.text] if r.token_ids else []
        seq["tokens"] += r.token_ids
        seq["text"] += r.text
        if r.finish_reason:
            seq["end"] = (r.finish_reason, r.WhichOneof("matched_stop"),
                          r.matched_stop_str or r.matched_token_id)
    return dict(seqs)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "lockstep"])
async def test_stop_strings_through_the_server(tiny_tokenizer, overlap):
    async with running_server(tiny_tokenizer, overlap_scheduling=overlap) as h:
        await h.serve()
        free = per_token(await collect(h.stub.Generate(gen_request(max_tokens=30))))[0]
        text = free["text"]
        stop = [text[len(text) // 2:][:2], "zz-never"]
        responses = await collect(h.stub.Generate(gen_request(max_tokens=30, stop=stop)))
        got = per_token(responses)[0]
        want_text, want_match, num_tokens = reference(free["deltas"], stop, include=False)
        assert got["text"] == want_text and got["tokens"] == free["tokens"][:num_tokens]
        assert got["end"] == (pb.FINISH_REASON_STOP, "matched_stop_str", want_match)
        # n = 2 (greedy: identical sequences), each stopped on its own.
        responses = await collect(h.stub.Generate(gen_request(max_tokens=30, stop=stop, n=2,
                                                              temperature=0.0)))
        for seq in per_token(responses).values():
            assert seq["text"] == want_text and seq["tokens"] == free["tokens"][:num_tokens]
        stats = await wait_idle(h)
        assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "lockstep"])
async def test_stop_strings_under_preemption(tiny_tokenizer, overlap):
    """Six streams on a pool that holds about two: requests are preempted and recomputed,
    and each still ends exactly where its own free run says."""
    prompts = [[5 + i, 6, 7 + 2 * i] for i in range(6)]
    async with running_server(tiny_tokenizer, overlap_scheduling=overlap) as h:
        await h.serve(hello=make_hello(num_kv_blocks=24), step_delay_s=0.002)
        frees = [per_token(await collect(h.stub.Generate(gen_request(p, max_tokens=40))))[0]
                 for p in prompts]
        stops = [[f["text"][-7:-2]] for f in frees]  # late: the streams grow and compete
        runs = await asyncio.gather(*(
            collect(h.stub.Generate(gen_request(p, max_tokens=40, stop=s)))
            for p, s in zip(prompts, stops, strict=True)))
        for free, stop, responses in zip(frees, stops, runs, strict=True):
            got = per_token(responses)[0]
            want_text, want_match, num_tokens = reference(free["deltas"], stop, include=False)
            assert got["text"] == want_text and got["tokens"] == free["tokens"][:num_tokens]
            assert got["end"] == (pb.FINISH_REASON_STOP, "matched_stop_str", want_match)
        stats = await wait_idle(h)
        assert stats.num_preemptions > 0
        assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_an_abort_releases_the_held_text(harness, tiny_tokenizer):
    await harness.serve(step_delay_s=0.01)
    free = per_token(await collect(harness.stub.Generate(gen_request(max_tokens=30))))[0]
    stop = [free["text"][:250] + "\x00"]  # the whole text is held: it could begin the stop
    call = harness.stub.Generate(gen_request(max_tokens=30, stop=stop))
    first = [await call.read() for _ in range(5)]
    assert all(r.token_ids and not r.text for r in first)
    await harness.stub.Abort(pb.AbortRequest(request_id=first[0].request_id))
    rest = await collect(call)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert not rest[-1].HasField("matched_token_id") and not rest[-1].HasField("matched_stop_str")
    tokens = [t for r in first + rest for t in r.token_ids]
    assert "".join(r.text for r in first + rest) == tiny_tokenizer.decode(tokens)
    assert tokens == free["tokens"][:len(tokens)]

"""Requests across executors, with null-model executors over real ZeroMQ: a lost executor's
requests wait and resume token-exact on the next one (or give up after --resume-timeout), are
re-checked against it, a second executor is refused while one serves, and an exception in the
engine loop ends only the requests of its step."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from protos.folio.v1 import generator_pb2 as pb
from protos.plan import Reject
from tests.scheduler.api.test_server import wait_idle
from tests.scheduler.grpc_harness import (
    NOT_SERVING,
    SERVING,
    collect,
    gen_request,
    null_continuation,
)
from tests.scheduler.null_executor import make_hello

pytestmark = pytest.mark.timeout(60)


async def test_a_silent_executor_is_lost_and_its_request_resumes_on_the_next(harness):
    await harness.serve(go_silent_after=2)
    call = harness.stub.Generate(gen_request(max_tokens=10))
    await harness.wait_health(NOT_SERVING)  # no result within executor_timeout_s
    stats = await harness.stats()
    assert not stats.executor_connected and stats.num_waiting == 1
    await harness.serve()  # a restarted executor says Hello again
    responses = await collect(call)
    # Nothing lost, nothing repeated: exactly the uninterrupted continuation.
    assert [t for r in responses for t in r.token_ids] == null_continuation([5, 6, 7], 10)
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == 10
    responses = await collect(harness.stub.Generate(gen_request(max_tokens=2)))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    stats = await harness.stats()
    assert stats.num_finished_requests == 2  # counters survive the executor change


async def test_a_request_gives_up_after_the_resume_timeout(harness):
    harness.server.engine.config = replace(harness.server.engine.config, resume_timeout_s=0.5)
    ex = await harness.serve(step_delay_s=0.05)
    call = harness.stub.Generate(gen_request(max_tokens=1000))
    await call.read()
    await asyncio.to_thread(ex.stop)  # its socket closes: lost at once, no timeout needed
    await harness.wait_health(NOT_SERVING)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(call)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "none came back within 0.5s" in err.value.details()


async def test_a_second_executor_is_refused_while_one_serves(harness):
    old = await harness.serve(step_delay_s=0.02)
    call = harness.stub.Generate(gen_request(max_tokens=30))
    await call.read()
    new = harness.connect(hello=make_hello(executor_id="null-1", num_kv_blocks=16))
    reply = await asyncio.to_thread(new.wait_reply)
    assert isinstance(reply, Reject) and reply.retry and "another executor" in reply.reason
    assert old.is_alive() and not old.got_shutdown and new.mirror.num_plans == 0
    rest = await collect(call)  # the stream never noticed
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert (await harness.stats()).kv_blocks_total == 32
    # Once the first is gone, the next one is welcomed with its own pool.
    await asyncio.to_thread(old.stop)
    await harness.wait_health(NOT_SERVING)
    await harness.serve(hello=make_hello(executor_id="null-2", num_kv_blocks=16))
    responses = await collect(harness.stub.Generate(gen_request(max_tokens=3)))
    assert [t for r in responses for t in r.token_ids] == null_continuation([5, 6, 7], 3)
    assert (await harness.stats()).kv_blocks_total == 16


async def test_streams_survive_executor_loss_token_exact(harness):
    """Several streams (plain, n = 3 seeded) mid-generation when the executor dies; the next
    executor finishes each with exactly the uninterrupted tokens. (Beam search needs real
    logprobs: tests/e2e/engine/test_e2e_faults.py.)"""
    ex = await harness.serve(step_delay_s=0.01)
    calls = [harness.stub.Generate(gen_request([5 + i, 6, 7, 8 + i], max_tokens=25))
             for i in range(4)]
    group = harness.stub.Generate(gen_request([9, 9, 9], max_tokens=20, n=3, seed=4,
                                              temperature=1.0))
    firsts = [await c.read() for c in calls]
    await asyncio.to_thread(ex.stop)
    await harness.wait_health(NOT_SERVING)
    await harness.serve()
    for i, (first, call) in enumerate(zip(firsts, calls, strict=True)):
        tokens = list(first.token_ids) + [t for r in await collect(call) for t in r.token_ids]
        assert tokens == null_continuation([5 + i, 6, 7, 8 + i], 25)
    by_index: dict[int, list[int]] = {}
    for r in await collect(group):
        by_index.setdefault(r.index, []).extend(r.token_ids)
    assert sorted(by_index) == [0, 1, 2]
    # The null model ignores seeds: every sequence continues the prompt the same way.
    assert all(v == null_continuation([9, 9, 9], 20) for v in by_index.values())
    stats = await wait_idle(harness)
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_resume_rechecks_each_request_against_the_new_executor(harness):
    ex = await harness.serve(step_delay_s=0.02)
    # Long enough to outgrow the next executor's max_model_len, one that fits, one whose
    # prompt alone is too long for it.
    grows = harness.stub.Generate(gen_request(list(range(10, 20)), max_tokens=40))
    fits = harness.stub.Generate(gen_request([5, 6], max_tokens=40))
    too_long = harness.stub.Generate(gen_request(list(range(30, 55)), max_tokens=30))
    first = await grows.read()
    for _ in range(12):  # past 20 tokens in all
        first.token_ids.extend((await grows.read()).token_ids)
    await asyncio.to_thread(ex.stop)
    await harness.wait_health(NOT_SERVING)
    await harness.serve(hello=make_hello(executor_id="small", max_model_len=20))
    rest = await collect(grows)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    tokens = list(first.token_ids) + [t for r in rest for t in r.token_ids]
    assert tokens == null_continuation(list(range(10, 20)), len(tokens))
    assert rest[-1].usage.completion_tokens == len(tokens) >= 10  # nothing re-sent, none lost
    out = await collect(fits)
    assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(r.token_ids) for r in out) <= 40
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(too_long)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot resume on the new executor" in err.value.details()
    assert "max_model_len is 20" in err.value.details()


async def test_a_scheduler_exception_ends_only_that_steps_requests(harness, monkeypatch):
    """A bug that raises in the engine loop: the requests of the step involved end with
    INTERNAL; the Scheduler is rebuilt and the executor told to drop its state (`reset`: the
    plan-checking executor would see a write into the failed request's blocks otherwise);
    serving goes on, token-exact, and every block comes back."""
    from scheduler_svc.sched.scheduler import Scheduler

    await harness.serve(step_delay_s=0.02, hello=make_hello(num_kv_blocks=32))
    running = harness.stub.Generate(gen_request([5, 6, 7], max_tokens=40))
    await running.read()
    real_update, calls = Scheduler.update, []

    def broken_update(self, result):
        calls.append(result.step_id)
        if len(calls) == 1:
            raise RuntimeError("a scheduler bug")
        return real_update(self, result)

    monkeypatch.setattr(Scheduler, "update", broken_update)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(running)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "RuntimeError: a scheduler bug" in err.value.details()
    monkeypatch.undo()
    assert await harness.health_status() == SERVING
    responses = await collect(harness.stub.Generate(gen_request([8, 9], max_tokens=5)))
    assert [t for r in responses for t in r.token_ids] == null_continuation([8, 9], 5)
    stats = await wait_idle(harness)
    assert stats.kv_blocks_free == stats.kv_blocks_total

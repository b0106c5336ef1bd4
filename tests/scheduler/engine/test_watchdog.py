"""The stall watchdog (scheduler_svc/engine/watchdog.py): on the real Scheduler, Registry and admission
with a null-model executor and a hand-moved clock, then through the real gRPC server with a
request the engine is made to lose (a fault injected into admission, like the bug of issue
27: a request accepted and never queued)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import structlog

from protos.plan import SamplingSpec
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import admission
from scheduler_svc.engine.admission import submit_request
from scheduler_svc.engine.handshake import ExecutorInfo, new_scheduler
from scheduler_svc.engine.registry import ClientRequest, Registry
from scheduler_svc.engine.watchdog import RequestStalled, StallWatchdog
from scheduler_svc.sched.request import SubmitParams
from tests.scheduler.api.test_server import wait_idle
from tests.scheduler.grpc_harness import collect, gen_request, null_continuation, running_server
from tests.scheduler.null_executor import PlanMirror, make_hello

TIMEOUT_S = 30.0
STALLED = "request stalled: ended by the watchdog"


class Engine:
    """The scheduler-side pieces the real engine composes, stepped by hand: admission into
    a Scheduler built from a Hello, a Registry, and a null-model executor (PlanMirror)."""

    def __init__(self, tokenizer, **hello):
        hello = make_hello(**hello)
        self.info = ExecutorInfo.from_hello(b"ex", hello, None)
        self.sched = new_scheduler(self.info, hello, SchedulerConfig(max_num_seqs=4))
        self.registry = Registry()
        self.mirror = PlanMirror(hello.block_size)
        self.tokenizer = tokenizer
        self.num_submitted = 0

    def submit(self, prompt: list[int], max_tokens: int, queue: bool = True) -> ClientRequest:
        params = SubmitParams(req_id=f"r{self.num_submitted}", prompt_token_ids=prompt,
                              sampling=SamplingSpec(temperature=0.0), max_tokens=max_tokens,
                              ignore_eos=True)
        if queue:
            client = submit_request(self.sched, self.registry, params, self.info,
                                    self.tokenizer, self.num_submitted)
        else:  # the fault: accepted into the registry, queued nowhere
            client = ClientRequest(params.req_id, params, max_tokens, self.num_submitted,
                                   [admission.new_sequence_output(0, params, self.tokenizer)])
        self.num_submitted += 1
        self.registry.add(client)
        return client

    def step(self) -> None:
        plan = self.sched.schedule()
        assert plan is not None
        self.sched.update(self.mirror.apply(plan))


def test_an_orphaned_request_ends_after_the_timeout_with_its_state_logged(tiny_tokenizer):
    engine = Engine(tiny_tokenizer)
    watchdog = StallWatchdog(TIMEOUT_S)
    orphan = engine.submit([5, 6, 7], 4, queue=False)
    assert watchdog.check(0.0, engine.registry, engine.sched) == []
    assert watchdog.check(TIMEOUT_S - 1, engine.registry, engine.sched) == []
    with structlog.testing.capture_logs() as logs:
        ((client, error),) = watchdog.check(TIMEOUT_S + 1, engine.registry, engine.sched)
    assert client is orphan and isinstance(error, RequestStalled)
    assert error.code == grpc.StatusCode.INTERNAL
    assert "made no progress for 31s (not held by the scheduler)" in str(error)
    (line,) = [e for e in logs if e["event"] == STALLED]
    assert line["log_level"] == "error" and line["req_id"] == orphan.req_id
    assert line["state"] == "not held by the scheduler" and line["sequences"] == []
    assert watchdog.num_stalled == 1


def test_a_request_waiting_its_turn_behind_progress_is_never_stalled(tiny_tokenizer):
    # 8 blocks of 4 slots: the first request holds 6 of them, so the second waits for it.
    engine = Engine(tiny_tokenizer, num_kv_blocks=8, block_size=4, max_model_len=32)
    watchdog = StallWatchdog(TIMEOUT_S)
    running = engine.submit(list(range(10, 30)), 4)
    waiting = engine.submit(list(range(40, 60)), 4)
    now = 0.0
    for _ in range(3):  # each step far apart: the clock alone would call both stalled
        engine.step()
        now += TIMEOUT_S + 1
        assert watchdog.check(now, engine.registry, engine.sched) == []
        assert engine.sched.queues.requests[waiting.req_id].status.value == "waiting"
    # The engine stops stepping (a bug): nothing completes, so both are stalled.
    now += TIMEOUT_S + 1
    with structlog.testing.capture_logs() as logs:
        stalled = watchdog.check(now, engine.registry, engine.sched)
    assert [c for c, _ in stalled] == [running, waiting]
    lines = {e["req_id"]: e for e in logs if e["event"] == STALLED}
    assert lines[running.req_id]["state"] == "running"
    (seq,) = lines[waiting.req_id]["sequences"]
    assert (seq["status"], seq["queue_position"], seq["num_blocks"]) == ("waiting", 0, 0)
    assert lines[waiting.req_id]["num_running"] == 1


def test_progress_resets_the_clock_and_the_watchdog_can_be_off(tiny_tokenizer):
    engine = Engine(tiny_tokenizer)
    watchdog, off = StallWatchdog(TIMEOUT_S), StallWatchdog(0)
    engine.submit([5, 6, 7], 50)
    orphan = engine.submit([8, 9], 50, queue=False)
    now = 0.0
    assert watchdog.check(now, engine.registry, engine.sched) == []  # the clocks start
    for _ in range(4):
        engine.step()
        now += TIMEOUT_S - 1  # progress within each window, for the queued request only
        stalled = watchdog.check(now, engine.registry, engine.sched)
        assert [c for c, _ in stalled] == ([orphan] if now == 2 * (TIMEOUT_S - 1) else [])
        for client, _ in stalled:
            engine.registry.remove(client)  # ended: the next checks forget it
        assert off.check(now, engine.registry, engine.sched) == []
    assert watchdog.num_stalled == 1 and off.num_stalled == 0


def test_without_an_executor_the_resume_timeout_governs(tiny_tokenizer):
    engine = Engine(tiny_tokenizer)
    watchdog = StallWatchdog(TIMEOUT_S)
    engine.submit([5, 6, 7], 4, queue=False)
    assert watchdog.check(0.0, engine.registry, engine.sched) == []
    assert watchdog.check(10 * TIMEOUT_S, engine.registry, None) == []  # executor lost
    # Back: the clock starts again from the reconnection.
    assert watchdog.check(11 * TIMEOUT_S, engine.registry, engine.sched) == []
    assert len(watchdog.check(12 * TIMEOUT_S + 1, engine.registry, engine.sched)) == 1


@pytest.mark.timeout(60)
async def test_the_server_ends_a_lost_request_and_keeps_serving(tiny_tokenizer, monkeypatch):
    real_admit = admission.admit

    def admit_dropping_prompts_of_nines(sched, client, info, tokenizer):
        if client.params.prompt_token_ids[0] == 99:
            return []  # accepted, queued nowhere: the engine loses it
        return real_admit(sched, client, info, tokenizer)

    monkeypatch.setattr(admission, "admit", admit_dropping_prompts_of_nines)
    async with running_server(tiny_tokenizer, stall_timeout_s=1.0, expect_stalled=1) as h:
        await h.serve(step_delay_s=0.01)
        lost = asyncio.ensure_future(collect(h.stub.Generate(gen_request([99, 98], max_tokens=4))))
        served = await collect(h.stub.Generate(gen_request([5, 6], max_tokens=20)))
        assert [t for r in served for t in r.token_ids] == null_continuation([5, 6], 20)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(lost, 20)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "ended by the stall watchdog (--stall-timeout)" in err.value.details()
        stats = await wait_idle(h)
        assert stats.num_stalled_requests == 1
        assert stats.kv_blocks_free == stats.kv_blocks_total
        # Serving goes on.
        again = await collect(h.stub.Generate(gen_request([7, 8], max_tokens=3)))
        assert [t for r in again for t in r.token_ids] == null_continuation([7, 8], 3)

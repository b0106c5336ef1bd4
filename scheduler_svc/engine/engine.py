"""The engine loop: executor connections, then schedule -> plan -> result -> outputs, forever.
With overlapped scheduling (scheduler.py "Overlap") the loop sends plan N+1 before it waits for
step N's result; where the Scheduler cannot plan ahead it returns no plan (lockstep).

One asyncio task runs the loop; gRPC handlers call `submit`/`abort` from the same event loop,
so no locks are needed; the one blocking read, checking a tier file's blocks when an executor
connects (host_tier.py), runs on a worker thread while the loop waits for it before the new
Scheduler becomes the engine's. A reader task (`channel_reader.py`) moves every channel event into
`_inbox`, so the loop can wait on "an event or new work" without two readers on the socket.

    handlers --submit/abort--> Registry --admit--> Scheduler <--schedule/update-- loop
       ^                          ^                                  | StepPlan / StepResult
       +-- client queues <-- OutputProcessor <-- StepOutputs --------+  (ZeroMQ, executor)

Failure model (docs/architecture.md, "Failures"): a bad request is refused at submit; a bad
channel message is dropped; a failed step ends its requests; a lost executor (connection
closed, heartbeat silence, no result within --executor-timeout) leaves every request waiting in
the registry, to resume on the next executor from prompt + streamed tokens, or to end with
UNAVAILABLE after --resume-timeout; an exception in this loop ends the requests of the step
involved and rebuilds the Scheduler from the registry on the same executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog
import zmq

from protos.channel import PeerLost, SchedulerEnd
from protos.plan import (
    ExecutorError,
    Hello,
    Message,
    Reject,
    Shutdown,
    StepPlan,
    StepResult,
)
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.admission import readmit_all, submit_request
from scheduler_svc.engine.channel_reader import ChannelReader
from scheduler_svc.engine.handshake import ExecutorInfo, answer_hello, log_connected, new_scheduler
from scheduler_svc.engine.host_tier import surviving_host_blocks
from scheduler_svc.engine.kv_event_stream import KvEventStream
from scheduler_svc.engine.log_limit import LogLimiter
from scheduler_svc.engine.metrics import RequestMetrics
from scheduler_svc.engine.output_processor import OutputProcessor
from scheduler_svc.engine.registry import ClientRequest, Registry
from scheduler_svc.engine.stats import COUNTERS, StatsLogger, retire_counters, server_stats
from scheduler_svc.engine.watchdog import StallWatchdog
from scheduler_svc.errors import (
    ExecutorFailed,
    ExecutorUnavailable,
    FolioError,
)
from scheduler_svc.sched.kv_events import KvEventLog, Tier
from scheduler_svc.sched.request import RequestStatus, SubmitParams
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.text.tokenizer import Tokenizer

log = structlog.get_logger("folio.scheduler.engine")

NO_EXECUTOR = ("no executor connected; start one with `python -m executor_svc --model DIR "
               "--scheduler-address ADDR`, or wait until it has loaded the model")
UNKNOWN_EXECUTOR = "this scheduler has no handshake with this connection; send Hello"

# (connected, reason) -> None: health, and the supervisor of a spawned executor.
ExecutorCallback = Callable[[bool, str], Awaitable[None]]


class Engine:
    def __init__(self, config: SchedulerConfig, tokenizer: Tokenizer, channel: SchedulerEnd,
                 on_executor_change: ExecutorCallback | None = None,
                 shutdown_executor_on_stop: bool = False, metrics: RequestMetrics | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.channel = channel
        self.registry = Registry()
        self.metrics = metrics or RequestMetrics("", export=False)
        self.outputs = OutputProcessor(self.registry, self.metrics)
        self.executor: ExecutorInfo | None = None
        self.scheduler: Scheduler | None = None
        self._hello: Hello | None = None  # the connected executor's Hello
        self._on_executor_change = on_executor_change
        self._shutdown_executor_on_stop = shutdown_executor_on_stop
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._next_arrival = 0
        self._next_step_id = 0
        self._max_in_flight = 2 if config.overlap_scheduling else 1
        self.stats = StatsLogger(config.stats_interval_s, self.metrics)
        self.watchdog = StallWatchdog(config.stall_timeout_s)
        self._warn = LogLimiter(log)
        self._reader = ChannelReader(channel, self._from_executor, self._warn)
        self._inbox = self._reader.inbox
        # Counters of schedulers retired with their executor, for cumulative ServerStats.
        self._past_totals = dict.fromkeys(COUNTERS, 0)
        # The prefix cache's events, published once per turn of the loop (kv_event_stream.py).
        self._host_index: dict[int, bytes] = {}  # a retired scheduler's host tier promises
        # The promises being checked against the tier file (on a thread) for a scheduler not
        # yet the engine's; a flush meanwhile replaces it with None, so they are not adopted.
        self._adopting: dict[int, bytes] | None = None
        self.kv_events = KvEventLog()
        self.host_kv_events = KvEventLog(Tier.HOST)  # the host tier's (--kv-offloading-size)
        self.kv_event_stream = KvEventStream(self.kv_events, self.host_kv_events)

    # ---- called by gRPC handlers -----------------------------------------------------------

    def submit(self, params: SubmitParams) -> ClientRequest:
        """Queue a request; raise a FolioError the client can act on when it cannot run.
        The returned request's `queue` receives its stream's messages."""
        if self.scheduler is None or self.executor is None:
            raise ExecutorUnavailable(NO_EXECUTOR)
        client = submit_request(self.scheduler, self.registry, params, self.executor,
                                self.tokenizer, self._next_arrival)
        self._next_arrival += 1
        self.registry.add(client)
        self._wakeup.set()
        log.debug("request queued", req_id=client.req_id, n=params.sequence.n,
                  beam_width=params.sequence.beam_width,
                  num_prompt_tokens=len(params.prompt_token_ids), max_tokens=client.max_tokens)
        return client

    def abort(self, req_id: str) -> bool:
        """Abort a request; its stream ends with an ABORT message per unfinished sequence."""
        client = self.registry.get(req_id)
        if client is None:
            return False
        self._drop_from_scheduler(client)
        self.outputs.abort(client)
        self._wakeup.set()
        log.info("request aborted", req_id=req_id)
        return True

    def server_stats(self) -> dict[str, int | bool]:
        """ServerStats fields: counters cover every executor this server has had; without an
        executor, requests waiting for one count as waiting."""
        stats = server_stats(self.scheduler, self._past_totals, self.executor is not None)
        stats.update(self.stats.step_times())
        stats["num_stalled_requests"] = self.watchdog.num_stalled
        if self.scheduler is None:
            stats["num_waiting"] = len(self.registry)
        return stats

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()

    def subscribe_kv_events(self):
        """A KV-event subscription (kv_event_stream.Subscription), starting from a snapshot
        of the cache as published so far."""
        self.kv_event_stream.publish()  # so the snapshot and the live batches meet exactly
        return self.kv_event_stream.subscribe()

    async def flush_prefix_cache(self, timeout_s: float) -> tuple[bool, str]:
        """FlushCache: forget every cached block once no request is in the server, waiting
        at most `timeout_s` for that (0: only if idle now). Returns (success, why)."""
        deadline = time.monotonic() + timeout_s
        while True:
            sched = self.scheduler
            if sched is None:
                # What a retired or connecting scheduler's host tier promised is forgotten
                # too: the next scheduler adopts nothing.
                if self._host_index or self._adopting is not None:
                    self._host_index, self._adopting = {}, None
                    self.host_kv_events.cleared()
                self.kv_event_stream.publish()
                return True, "no executor connected: the prefix cache is empty"
            idle = not len(self.registry) and not sched.has_unfinished() \
                and not sched.num_in_flight
            if idle and sched.block_manager.reset_prefix_cache():
                self.kv_event_stream.publish()
                log.info("prefix cache flushed")
                return True, "prefix cache flushed"
            if time.monotonic() >= deadline:
                return False, (f"the prefix cache was not flushed: {len(self.registry)} "
                               f"request(s) in flight hold its blocks; retry when they have "
                               f"finished, or give timeout_s to wait for them")
            await asyncio.sleep(0.01)

    # ---- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        reader = asyncio.create_task(self._reader.run(), name="folio-channel-reader")
        try:
            while not self._stopping:
                self._wakeup.clear()
                try:
                    await self._iterate()
                    self._end_stalled()
                except Exception as e:  # a scheduler bug: scope it, keep serving
                    log.exception("engine step failed")
                    await self._recover(e)
                self.kv_event_stream.publish()
                self.stats.maybe_log_server(self.server_stats())
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            await self._close("the server is shutting down")
            self.kv_event_stream.publish()
            self.kv_event_stream.close()

    async def _iterate(self) -> None:
        """One turn of the loop: send a plan if one can go now; then, with the pipeline full
        or nothing more to plan, wait for the oldest result; with nothing in flight, wait for
        an event."""
        self._expire_suspended()
        sched = self.scheduler
        if sched is None:
            await self._wait_for_event()
            return
        plan = None
        if sched.has_unfinished() and sched.num_in_flight < self._max_in_flight:
            start = time.perf_counter()
            plan = sched.schedule()
            self.stats.scheduler_busy_s += time.perf_counter() - start
            if plan is not None:
                if not await self._send_plan(plan):
                    return
                if sched.num_in_flight < self._max_in_flight:
                    return  # plan the next step while this one runs
        if sched.num_in_flight:
            await self._await_result(sched)
        elif plan is None:
            self.stats.went_idle()
            await self._wait_for_event()

    def _end_stalled(self) -> None:
        """End the requests the stall watchdog finds (watchdog.py): a server bug, logged."""
        for client, error in self.watchdog.check(time.monotonic(), self.registry,
                                                 self.scheduler):
            self._end_client(client, error)

    def _from_executor(self, event) -> bool:
        identity = event[0] if isinstance(event, tuple) else getattr(event, "identity", None)
        return self.executor is not None and identity == self.executor.identity

    async def _wait_for_event(self) -> None:
        """Idle: sleep until new work, an event from the channel, or a resume deadline."""
        timeout = self.config.stats_interval_s
        if self.scheduler is None and len(self.registry):
            timeout = min(timeout, 0.5)  # resume deadlines are checked at each turn
        wake = asyncio.create_task(self._wakeup.wait())
        get = asyncio.create_task(self._inbox.get())
        done, _ = await asyncio.wait({wake, get}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        wake.cancel()
        if get in done:
            await self._handle(get.result())
        else:
            get.cancel()

    async def _send_plan(self, plan: StepPlan) -> bool:
        log.debug("step planned", step=plan.step_id, num_new=len(plan.new_reqs),
                  num_cached=len(plan.cached_reqs),
                  num_scheduled_tokens=plan.num_scheduled_tokens,
                  num_in_flight=self.scheduler.num_in_flight)
        self._next_step_id = plan.step_id + 1
        self.stats.plan_sent(plan.step_id, overlapped=self.scheduler.num_in_flight > 1)
        self.metrics.scheduled(plan, self.registry)
        try:
            await self.channel.send(self.executor.identity, plan)
            return True
        except zmq.ZMQError as e:
            await self._lose_executor(f"sending step {plan.step_id} failed: {e}")
            return False

    async def _await_result(self, sched: Scheduler) -> None:
        """Wait for the oldest plan's result (the executor answers in order) and apply it."""
        info, plan = self.executor, sched.oldest_in_flight()
        deadline = time.monotonic() + self.config.executor_timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                event = await asyncio.wait_for(self._inbox.get(), remaining)
            except TimeoutError:
                break
            match event:
                case (identity, StepResult(step_id=plan.step_id) as result) \
                        if identity == info.identity:
                    self._apply_result(sched, plan, result)
                    return
                case (identity, ExecutorError(step_id=plan.step_id) as error) \
                        if identity == info.identity:
                    self.stats.step_failed(plan.step_id)
                    self._fail_step(plan, error.message)
                    return
            await self._handle(event)
            if self.executor is not info:
                return  # lost while the step ran; its requests wait in the registry
        await self._lose_executor(f"no result for step {plan.step_id} within "
                                  f"{self.config.executor_timeout_s:g}s")
        # If it ever wakes up: drop its state and say Hello again.
        await self._send_quietly(info.identity, Reject(reason=UNKNOWN_EXECUTOR, retry=True))

    def _apply_result(self, sched: Scheduler, plan: StepPlan, result: StepResult) -> None:
        start = time.perf_counter()
        for req_id in self.outputs.process(sched.update(result)):
            sched.stop_request(req_id)  # its text completed a stop string
        self.stats.record_step(plan, result, time.perf_counter() - start,
                               work_queued=sched.has_unfinished())

    async def _handle(self, event) -> None:
        """Any channel event other than the in-flight step's answer."""
        match event:
            case PeerLost(identity=identity):
                if self.executor is not None and identity == self.executor.identity:
                    await self._lose_executor("its connection closed")
            case (identity, Hello() as hello):
                await self._handshake(identity, hello)
            case (identity, msg) if not self._from_executor(event):
                self._warn.warning("ignored a message from an unknown executor connection",
                                   message=type(msg).__name__)
                if isinstance(msg, StepResult | ExecutorError):
                    # An executor that served an earlier scheduler (or connection): make it
                    # drop its state and say Hello again.
                    await self._send_quietly(identity, Reject(reason=UNKNOWN_EXECUTOR, retry=True))
            case (_, msg):
                self._warn.warning("ignored an unexpected executor message",
                                   message=type(msg).__name__)

    def _fail_step(self, plan: StepPlan, message: str) -> None:
        log.error("executor failed a step", step=plan.step_id, error=message)
        failed = self.scheduler.fail_requests(self.scheduler.abandon_oldest())
        error = ExecutorFailed(f"the executor failed step {plan.step_id}: {message}")
        for client in self.registry.clients_of(r.req_id for r in failed):
            self._end_client(client, error)

    # ---- executor lifecycle ----------------------------------------------------------------

    async def _send_quietly(self, identity: bytes, msg: Message) -> bool:
        try:
            await self.channel.send(identity, msg)
            return True
        except zmq.ZMQError as e:  # the peer vanished; its PeerLost event follows
            log.warning("could not send to an executor", message=type(msg).__name__,
                        error=str(e))
            return False

    async def _handshake(self, identity: bytes, hello: Hello) -> None:
        answer, note = answer_hello(self.executor, self._hello, identity, hello, self.tokenizer)
        if note is not None:
            final = isinstance(answer, Reject) and not answer.retry
            (log.error if final else self._warn.warning)(note, executor_id=hello.executor_id)
        if answer is None or not await self._send_quietly(identity, answer):
            return
        if self.executor is not None or isinstance(answer, Reject):
            return
        info = ExecutorInfo.from_hello(identity, hello, self.config.max_model_len,
                                       self.config.max_num_batched_tokens)
        self.executor, self._hello = info, hello
        scheduler = new_scheduler(info, hello, self.config, first_step_id=self._next_step_id,
                                  kv_events=self.kv_events, host_kv_events=self.host_kv_events)
        log_connected(info, hello, self.config)
        await self._adopt_host_tier(scheduler, hello)
        self.scheduler = scheduler  # only now: requests are queued and scheduled
        self._readmit_all()
        if self._on_executor_change is not None:
            await self._on_executor_change(True, "connected")

    async def _lose_executor(self, reason: str) -> None:
        """The executor is gone: keep every request for the next one, report NOT_SERVING."""
        if self.executor is None:
            return
        self._retire_scheduler()
        self.executor = self._hello = None
        num_waiting = self.registry.suspend_all(time.monotonic())
        log.error("executor lost; requests wait for the next one", reason=reason,
                  num_requests=num_waiting, resume_timeout_s=self.config.resume_timeout_s)
        if self._on_executor_change is not None:
            await self._on_executor_change(False, reason)

    def _retire_scheduler(self) -> None:
        if self.scheduler is not None:
            retire_counters(self._past_totals, self.scheduler)
            self._next_step_id = max(self._next_step_id, self.scheduler.next_step_id)
            self.kv_events.cleared()  # its cache goes with it
            bm = self.scheduler.block_manager
            # A host tier in a tier file may outlive the executor: keep what it promised
            # for the next scheduler to check against the file (host_tier.py).
            self._host_index = bm.host_index() if self.config.kv_offloading_path else {}
            if not self._host_index:
                self.host_kv_events.cleared()
        self.scheduler = None

    async def _adopt_host_tier(self, scheduler: Scheduler, hello: Hello) -> None:
        """Start `scheduler`'s host tier with what the tier file still vouches for.

        Checking reads every promised block (a crc32 each), so it runs on a worker thread and
        the loop keeps answering (health, stats, other executors' Hellos) meanwhile. The
        caller makes `scheduler` the engine's only once this returns: until then no request
        is queued on it and nothing is scheduled, so nothing reads a block before it is
        adopted, and the engine's loop, waiting here, handles no channel event."""
        promised, self._host_index = self._host_index, {}
        bm = scheduler.block_manager
        if not promised:
            return
        kept: dict[int, bytes] = {}
        if bm.num_host_blocks:
            self._adopting = promised
            kept = await asyncio.to_thread(surviving_host_blocks,
                                           self.config.kv_offloading_path, hello, promised)
            if self._adopting is not promised:  # the prefix cache was flushed meanwhile
                kept = {}
            self._adopting = None
        bm.adopt_host_blocks(kept)

    def _readmit_all(self) -> None:
        """Queue every unfinished request on the new Scheduler, in arrival order."""
        refused, no_room = readmit_all(self.scheduler, self.registry, self.executor,
                                       self.tokenizer)
        for client, e in refused:
            self._end_client(client, ExecutorUnavailable(
                f"the request cannot resume on the new executor: {e}"))
        for client, seq in no_room:
            self.outputs.finish(client, seq, RequestStatus.FINISHED_LENGTH)
        if len(self.registry):
            log.info("requests resumed", num_requests=len(self.registry))

    def _expire_suspended(self) -> None:
        if self.scheduler is not None:
            return
        for client in self.registry.expired(time.monotonic(), self.config.resume_timeout_s):
            self._end_client(client, ExecutorUnavailable(
                f"the executor was lost and none came back within "
                f"{self.config.resume_timeout_s:g}s; retry later"))

    async def _recover(self, error: Exception) -> None:
        """After an exception in the loop: end the requests it most likely concerns, and
        rebuild the Scheduler from the registry on the same executor (if even that fails,
        every request ends)."""
        sched = self.scheduler
        if sched is None or self.executor is None:
            return
        try:
            blamed = sched.abandon_in_flight() or sched.queues.running_ids() or \
                [r.req_id for r in list(sched.queues.waiting)[:1]]
            failure = ExecutorFailed(f"internal scheduler error ({type(error).__name__}: "
                                     f"{error}) while running this request; see the server log")
            for client in self.registry.clients_of(blamed):
                self.outputs.fail(client, failure)
            await self._reset_scheduler()
            self._readmit_all()
        except Exception:
            log.exception("recovering from a scheduler error failed; ending every request")
            for client in self.registry:
                self.outputs.fail(client, ExecutorFailed("internal scheduler error; see the "
                                                         "server log"))
            await self._reset_scheduler()

    async def _reset_scheduler(self) -> None:
        """A new Scheduler on the same executor, whose first plan drops all it holds."""
        self._retire_scheduler()
        scheduler = new_scheduler(self.executor, self._hello, self.config,
                                  first_step_id=self._next_step_id, reset_executor=True,
                                  kv_events=self.kv_events, host_kv_events=self.host_kv_events)
        await self._adopt_host_tier(scheduler, self._hello)
        self.scheduler = scheduler

    async def _close(self, reason: str) -> None:
        """Shutting down: end every request with UNAVAILABLE."""
        error = ExecutorUnavailable(reason)
        for client in self.registry:
            self.outputs.fail(client, error)
        info = self.executor
        self._retire_scheduler()
        self.executor = self._hello = None
        if info is None:
            return
        if self._shutdown_executor_on_stop:
            await self._send_quietly(info.identity, Shutdown())
        if self._on_executor_change is not None:
            await self._on_executor_change(False, reason)

    def _drop_from_scheduler(self, client: ClientRequest) -> None:
        if self.scheduler is not None:
            if client.is_group:
                self.scheduler.abort_group(client.req_id)
            for seq in client.sequences:  # resumed group sequences run as plain requests
                self.scheduler.abort_request(client.seq_id(seq.index))

    def _end_client(self, client: ClientRequest, error: FolioError) -> None:
        self._drop_from_scheduler(client)
        self.outputs.fail(client, error)

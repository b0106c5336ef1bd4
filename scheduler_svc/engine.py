"""The engine loop: handshake with the executor, then schedule -> plan -> result -> outputs.

One asyncio task runs the loop; gRPC handlers call `submit`/`abort` from the same event loop,
so no locks are needed. A reader task moves every channel message into `_inbox`, so the loop
can wait on "a message or new work" without racing two readers on the socket.

    handlers --submit/abort--> Scheduler <--schedule/update-- loop --StepPlan--> executor
       ^                                                       |   <--StepResult--
       +------------- RequestStream queues <-- outputs --------+

The engine holds the state that changes with the executor (its ExecutorInfo and a Scheduler
made for it) and moves it through connect / replace / lose. What needs none of that state lives
beside it: checks of a request against the executor (`inputs.py`), the Hello check, the new
Scheduler and the connection log (`handshake.py`), ServerStats and the stats line (`stats.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog
import zmq

from protos.channel import ProtocolError, SchedulerEnd
from protos.plan import (
    PROTOCOL_VERSION,
    ExecutorError,
    Hello,
    Message,
    Reject,
    SamplingSpec,
    Shutdown,
    StepPlan,
    StepResult,
    Welcome,
)
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.errors import DuplicateRequest, ExecutorFailed, ExecutorUnavailable, Overloaded
from scheduler_svc.handshake import ExecutorInfo, check_hello, log_connected, new_scheduler
from scheduler_svc.inputs import check_beam_fits, check_for_executor
from scheduler_svc.request import (
    Request,
    RequestOutput,
    RequestStatus,
    RequestStream,
    SubmitParams,
)
from scheduler_svc.scheduler import Scheduler, StepOutput
from scheduler_svc.sequence_group import BeamGroup, ParallelGroup, SequenceGroup
from scheduler_svc.stats import COUNTERS, StatsLogger, retire_counters, server_stats
from scheduler_svc.tokenizer import Tokenizer

log = structlog.get_logger("folio.scheduler.engine")

MAX_WAITING_REQUESTS = 65536  # beyond this, new requests get RESOURCE_EXHAUSTED
NO_EXECUTOR = ("no executor connected; start one with `python -m executor_svc --model DIR "
               "--scheduler-address ADDR`, or wait until it has loaded the model")


class Engine:
    def __init__(self, config: SchedulerConfig, tokenizer: Tokenizer, channel: SchedulerEnd,
                 on_executor_change: Callable[[bool], Awaitable[None]] | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.channel = channel
        self.executor: ExecutorInfo | None = None
        self.scheduler: Scheduler | None = None
        self._hello: Hello | None = None  # the connected executor's Hello
        self._on_executor_change = on_executor_change
        self._inbox: asyncio.Queue[tuple[bytes, Message]] = asyncio.Queue()
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._next_arrival = 0
        self.stats = StatsLogger(config.stats_interval_s)
        # Counters of schedulers retired with their executor, for cumulative ServerStats.
        self._past_totals = dict.fromkeys(COUNTERS, 0)

    # ---- called by gRPC handlers -----------------------------------------------------------

    def submit(self, params: SubmitParams) -> RequestStream:
        """Queue a request; raise a FolioError the client can act on when it cannot run."""
        if self.scheduler is None or self.executor is None:
            raise ExecutorUnavailable(NO_EXECUTOR)
        max_tokens = check_for_executor(params, self.executor.vocab_size,
                                        self.executor.max_model_len)
        if params.req_id in self.scheduler.requests or params.req_id in self.scheduler.groups:
            raise DuplicateRequest(f"request_id {params.req_id!r} is already in use by a "
                                   "waiting or running request; pick another or leave it empty")
        if len(self.scheduler.waiting) >= MAX_WAITING_REQUESTS:
            raise Overloaded(f"{len(self.scheduler.waiting)} requests are already waiting; "
                             "retry later")
        if not params.sequence.is_single:
            return self._submit_group(params, max_tokens)
        stream = RequestStream(IncrementalDetokenizer(self.tokenizer))
        req = Request(req_id=params.req_id, prompt_token_ids=list(params.prompt_token_ids),
                      sampling=params.sampling, max_tokens=max_tokens,
                      arrival=self._next_arrival, eos_token_ids=self.tokenizer.eos_token_ids,
                      stop_token_ids=frozenset(params.stop_token_ids),
                      ignore_eos=params.ignore_eos, stream=stream)
        self._next_arrival += 1
        self.scheduler.add_request(req)
        self._wakeup.set()
        log.debug("request queued", req_id=req.req_id, num_prompt_tokens=req.num_prompt_tokens,
                  max_tokens=max_tokens)
        return stream

    def _submit_group(self, params: SubmitParams, max_tokens: int) -> RequestStream:
        """n > 1 or beam search: one stream whose n sequences share the prompt's blocks."""
        seq, arrival = params.sequence, self._next_arrival
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()  # one gRPC stream for all n
        streams = [RequestStream(IncrementalDetokenizer(self.tokenizer), queue)
                   for _ in range(seq.n)]
        stop_token_ids = frozenset(params.stop_token_ids)

        def new_request(seq_id: str, prompt: list[int], sampling: SamplingSpec,
                        stream: RequestStream | None, index: int) -> Request:
            return Request(req_id=seq_id, prompt_token_ids=prompt, sampling=sampling,
                           max_tokens=max_tokens, arrival=arrival,
                           eos_token_ids=self.tokenizer.eos_token_ids,
                           stop_token_ids=stop_token_ids, ignore_eos=params.ignore_eos,
                           stream=stream, index=index)

        group: SequenceGroup
        if seq.is_beam_search:
            check_beam_fits(params, max_tokens, self.scheduler.block_manager)
            # A beam ends on the ids that would stop a sequence.
            eos = frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
            group = BeamGroup(params.req_id, seq, params.prompt_token_ids, max_tokens,
                              stop_token_ids | eos, self.executor.vocab_size, new_request,
                              streams)
        else:
            group = ParallelGroup(params.req_id, seq, params.prompt_token_ids, params.sampling,
                                  new_request, streams)
        if taken := [m.req_id for m in group.members() if m.req_id in self.scheduler.requests]:
            raise DuplicateRequest(f"request ids {taken} of this request's sequences are in "
                                   "use; pick another request_id or leave it empty")
        self._next_arrival += 1
        self.scheduler.add_group(group)
        self._wakeup.set()
        log.debug("request queued", req_id=params.req_id, n=seq.n, beam_width=seq.beam_width,
                  num_prompt_tokens=len(params.prompt_token_ids), max_tokens=max_tokens)
        return streams[0]

    def abort(self, req_id: str) -> bool:
        """Abort a waiting or running request; its stream ends with an ABORT message (one per
        unfinished sequence of a group)."""
        if self.scheduler is not None and req_id in self.scheduler.groups:
            self._emit([StepOutput(r, [], True) for r in self.scheduler.abort_group(req_id)])
            self._wakeup.set()
            log.info("request aborted", req_id=req_id)
            return True
        req = self.scheduler.abort_request(req_id) if self.scheduler else None
        if req is None:
            return False
        self._emit([StepOutput(req, [], True)])
        self._wakeup.set()
        log.info("request aborted", req_id=req_id)
        return True

    # ---- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        reader = asyncio.create_task(self._read_channel(), name="folio-channel-reader")
        try:
            while not self._stopping:
                self._wakeup.clear()
                try:
                    await self._iterate()
                except Exception as e:  # a scheduler bug: end every request, keep serving
                    log.exception("engine step failed")
                    await self._close_executor(f"internal scheduler error ({e!r}); the "
                                               "executor was reset", send_shutdown=True)
                self._log_stats()
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            await self._close_executor("the server is shutting down")

    async def _iterate(self) -> None:
        """One turn of the loop: a step if there is one to run, else wait for work."""
        if self.scheduler is not None and self.scheduler.has_unfinished():
            if (plan := self.scheduler.schedule()) is not None:
                await self._run_step(plan)
                return
        await self._wait_for_message()

    def server_stats(self) -> dict[str, int | bool]:
        """ServerStats fields: counters cover every executor this server has had."""
        return server_stats(self.scheduler, self._past_totals, self.executor is not None)

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()

    async def _read_channel(self) -> None:
        while True:
            try:
                self._inbox.put_nowait(await self.channel.recv())
            except ProtocolError as e:
                log.warning("dropped a malformed executor message", error=str(e))

    async def _wait_for_message(self) -> None:
        """Idle: sleep until new work arrives, or handle what the executor sends meanwhile."""
        wake = asyncio.create_task(self._wakeup.wait())
        get = asyncio.create_task(self._inbox.get())
        done, _ = await asyncio.wait({wake, get}, timeout=self.config.stats_interval_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        wake.cancel()
        if get in done:
            await self._handle_unsolicited(*get.result())
        else:
            get.cancel()

    async def _handle_unsolicited(self, identity: bytes, msg: Message) -> None:
        match msg:
            case Hello():
                await self._handshake(identity, msg)
            case _:
                log.warning("ignored an unexpected executor message", message=type(msg).__name__)

    async def _run_step(self, plan: StepPlan) -> None:
        info = self.executor
        step_log = log.bind(step=plan.step_id)
        step_log.debug("step planned", num_new=len(plan.new_reqs),
                       num_cached=len(plan.cached_reqs),
                       num_scheduled_tokens=plan.num_scheduled_tokens)
        try:
            await self.channel.send(info.identity, plan)
        except zmq.ZMQError as e:
            await self._lose_executor(f"sending step {plan.step_id} failed: {e}")
            return
        deadline = time.monotonic() + self.config.executor_timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                identity, msg = await asyncio.wait_for(self._inbox.get(), remaining)
            except TimeoutError:
                break
            match msg:
                case StepResult(step_id=plan.step_id) if identity == info.identity:
                    self.stats.record_step(plan.num_scheduled_tokens, len(msg.sampled))
                    self._emit(self.scheduler.update(msg))
                    return
                case ExecutorError(step_id=plan.step_id) if identity == info.identity:
                    self._fail_step(plan, msg.message)
                    return
                case Hello() if self._is_resent_hello(identity, msg):
                    await self._send_quietly(identity, Welcome(PROTOCOL_VERSION))
                case Hello():
                    if await self._handshake(identity, msg):
                        return  # replaced mid-step: the old executor's requests failed
                case _:
                    step_log.warning("ignored an unexpected executor message",
                                     message=type(msg).__name__)
        await self._lose_executor(f"no result for step {plan.step_id} within "
                                  f"{self.config.executor_timeout_s:g}s")

    def _fail_step(self, plan: StepPlan, message: str) -> None:
        log.error("executor failed a step", step=plan.step_id, error=message)
        failed = self.scheduler.fail_requests(self.scheduler.abandon_in_flight())
        error = ExecutorFailed(f"the executor failed step {plan.step_id}: {message}")
        for req in failed:
            if req.stream is not None:
                req.stream.put(RequestOutput([], error=error))

    def _emit(self, outputs: list[StepOutput]) -> None:
        """Turn step outputs into stream messages: token ids, text delta, finish, usage."""
        for out in outputs:
            req, stream = out.req, out.req.stream
            if stream is None:
                continue
            text = stream.detokenizer.push(out.new_token_ids) if stream.detokenizer else ""
            if out.finished and stream.detokenizer:
                text += stream.detokenizer.flush()
            stream.put(RequestOutput(
                token_ids=out.new_token_ids, text=text,
                finish_status=req.status if out.finished else None,
                num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
                num_cached_tokens=req.num_cached_tokens, index=req.index))
            if out.finished:
                log.debug("request finished", req_id=req.req_id, status=req.status.value,
                          num_output_tokens=req.num_output_tokens)

    # ---- executor lifecycle ----------------------------------------------------------------

    def _is_resent_hello(self, identity: bytes, hello: Hello) -> bool:
        # An executor resends Hello until answered; a copy arriving after our Welcome is no
        # restart (a restarted process connects with a new identity).
        return self.executor is not None and identity == self.executor.identity \
            and hello == self._hello

    async def _send_quietly(self, identity: bytes, msg: Message) -> bool:
        try:
            await self.channel.send(identity, msg)
            return True
        except zmq.ZMQError as e:  # the peer vanished; whoever waits on it times out
            log.warning("could not send to the executor", message=type(msg).__name__,
                        error=str(e))
            return False

    async def _handshake(self, identity: bytes, hello: Hello) -> bool:
        """Answer a Hello; True if this executor is now the connected one."""
        if self._is_resent_hello(identity, hello):
            await self._send_quietly(identity, Welcome(PROTOCOL_VERSION))
            return False
        reason = check_hello(hello, self.tokenizer)
        if reason is not None:  # a bad newcomer does not disturb a connected executor
            log.error("executor rejected", executor_id=hello.executor_id, reason=reason)
            await self._send_quietly(identity, Reject(reason))
            return False
        if self.executor is not None:
            # A new executor replaces the old one (a restart): the old KV state is gone.
            await self._close_executor("a new executor replaced the one running this request",
                                       send_shutdown=True)
        info = ExecutorInfo.from_hello(identity, hello, self.config.max_model_len)
        self.executor, self._hello = info, hello
        self.scheduler = new_scheduler(info, hello, self.config)
        if not await self._send_quietly(identity, Welcome(PROTOCOL_VERSION)):
            self.executor = self.scheduler = self._hello = None
            return False
        log_connected(info, hello, self.config)
        if self._on_executor_change is not None:
            await self._on_executor_change(True)
        return True

    async def _lose_executor(self, reason: str) -> None:
        log.error("executor lost", reason=reason)
        await self._close_executor(f"the executor was lost ({reason}); retry once it is back")

    async def _close_executor(self, reason: str, send_shutdown: bool = False) -> None:
        """Fail every unfinished request with UNAVAILABLE and forget the executor."""
        info, scheduler = self.executor, self.scheduler
        if info is None:
            return
        self.executor, self.scheduler = None, None
        error = ExecutorUnavailable(reason)
        # Group outputs not scheduled yet (beam results, children before the fork) too.
        for req in [*scheduler.requests.values(),
                    *(r for g in scheduler.groups.values() for r in g.outputs)]:
            req.status = RequestStatus.FINISHED_ERROR
            if req.stream is not None:
                req.stream.put(RequestOutput([], error=error))
        retire_counters(self._past_totals, scheduler)
        if send_shutdown or self._stopping:
            await self._send_quietly(info.identity, Shutdown())
        if self._on_executor_change is not None:
            await self._on_executor_change(False)

    def _log_stats(self) -> None:
        stats = self.server_stats()
        self.stats.maybe_log(num_running=stats["num_running"], num_waiting=stats["num_waiting"],
                             num_swapped=stats["num_swapped"],
                             num_free_blocks=stats["kv_blocks_free"],
                             num_free_swap_blocks=stats["swap_blocks_free"],
                             num_preemptions=stats["num_preemptions"],
                             prefix_cache_hit_rate=stats["prefix_cache_hit_rate"])

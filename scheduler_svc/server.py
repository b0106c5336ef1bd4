"""The public gRPC API (folio.v1.Generator), health checking and reflection on grpc.aio.

`grpc_errors` is the one place where exceptions become statuses: FolioError subclasses carry
their code and a message for the client; anything else is INTERNAL and logged with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.channel import SchedulerEnd
from protos.folio.v1 import generator_pb2 as pb
from protos.folio.v1 import generator_pb2_grpc as pb_grpc
from scheduler_svc import inputs
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import Engine, ExecutorCallback
from scheduler_svc.errors import FolioError
from scheduler_svc.request import RequestStatus
from scheduler_svc.tokenizer import Tokenizer

log = structlog.get_logger("folio.scheduler.server")

GENERATOR_SERVICE = pb.DESCRIPTOR.services_by_name["Generator"].full_name
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: pb.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: pb.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: pb.FINISH_REASON_ABORT,
}


async def _abort_with(context: grpc.aio.ServicerContext, e: Exception, method: str) -> None:
    if isinstance(e, FolioError):
        log.info("request refused", method=method, code=e.code.name, reason=str(e))
        await context.abort(e.code, str(e))
    log.exception("unexpected error in a handler", method=method)
    await context.abort(grpc.StatusCode.INTERNAL,
                        f"internal scheduler error ({type(e).__name__}: {e}); see the server log")


def grpc_errors(fn):
    """Map exceptions from a unary or server-streaming handler to gRPC statuses."""
    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def stream_handler(self, request, context):
            try:
                # aclosing: a client that goes away closes the inner generator right here, so
                # its cleanup (aborting the request, freeing blocks) runs now, not at GC time.
                async with contextlib.aclosing(fn(self, request, context)) as responses:
                    async for response in responses:
                        yield response
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await _abort_with(context, e, fn.__name__)
        return stream_handler

    @functools.wraps(fn)
    async def unary_handler(self, request, context):
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort_with(context, e, fn.__name__)
    return unary_handler


class GeneratorService(pb_grpc.GeneratorServicer):
    def __init__(self, engine: Engine, tokenizer: Tokenizer):
        self.engine = engine
        self.tokenizer = tokenizer

    @grpc_errors
    async def Generate(self, request: pb.GenerateRequest, context):
        params = inputs.submit_params(request, self.tokenizer)
        stream = self.engine.submit(params)
        num_open = params.sequence.n  # sequences (n > 1, beams) whose last message is due
        done = False
        try:
            while True:
                out = await stream.queue.get()
                if out.error is not None:
                    done = True  # the engine already dropped the request
                    raise out.error
                response = pb.GenerateResponse(request_id=params.req_id,
                                               token_ids=out.token_ids, text=out.text,
                                               index=out.index)
                if out.finish_status is not None:
                    num_open -= 1
                    done = num_open == 0
                    response.finish_reason = FINISH_REASONS[out.finish_status]
                    response.usage.prompt_tokens = out.num_prompt_tokens
                    response.usage.completion_tokens = out.num_output_tokens
                    response.usage.cached_tokens = out.num_cached_tokens
                    yield response
                    if done:
                        return
                    continue
                yield response
        finally:
            if not done:  # client cancelled or went away: free the request's blocks now
                self.engine.abort(params.req_id)

    @grpc_errors
    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.engine.abort(request.request_id))

    @grpc_errors
    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        if request.WhichOneof("input") == "text" and not request.text:
            return pb.TokenizeResponse(token_ids=[])
        return pb.TokenizeResponse(token_ids=inputs.prompt_token_ids(request, self.tokenizer))

    @grpc_errors
    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        info, tok = self.engine.executor, self.tokenizer
        if info is None:  # what the scheduler knows alone; executor facts stay zero
            return pb.ModelInfo(model_name=tok.model_name, architecture=tok.architecture,
                                vocab_size=tok.config_vocab_size,
                                random_weights=tok.random_weights)
        return pb.ModelInfo(model_name=info.model_name, architecture=info.architecture,
                            max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                            block_size=info.block_size, num_kv_blocks=info.num_kv_blocks,
                            dtype=info.dtype, device=info.device,
                            random_weights=info.random_weights)

    @grpc_errors
    async def GetServerStats(self, request, context) -> pb.ServerStats:
        return pb.ServerStats(**self.engine.server_stats())


class SchedulerServer:
    """The gRPC server plus the engine task; `start()` then `stop()`."""

    def __init__(self, config: SchedulerConfig, tokenizer: Tokenizer, channel: SchedulerEnd,
                 on_executor_change: ExecutorCallback | None = None,
                 shutdown_executor_on_stop: bool = False):
        self.health = health.aio.HealthServicer()
        self._on_executor_change = on_executor_change
        self.engine = Engine(config, tokenizer, channel, on_executor_change=self._executor_change,
                             shutdown_executor_on_stop=shutdown_executor_on_stop)
        # No SO_REUSEPORT: a second server on a busy port must fail, not share its traffic.
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_GeneratorServicer_to_server(GeneratorService(self.engine, tokenizer),
                                                self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (GENERATOR_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        self.port = self.server.add_insecure_port(config.grpc_address)
        self._engine_task: asyncio.Task | None = None

    async def _executor_change(self, connected: bool, reason: str) -> None:
        await self._set_health(connected)
        if self._on_executor_change is not None:
            await self._on_executor_change(connected, reason)

    async def _set_health(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", GENERATOR_SERVICE):
            await self.health.set(service, status)

    async def start(self) -> None:
        await self._set_health(False)  # until an executor completes the handshake
        await self.server.start()
        self._engine_task = asyncio.create_task(self.engine.run(), name="folio-engine")

    async def wait_engine(self) -> None:
        """Returns only if the engine loop ends (stop() or a crash, which it logs)."""
        assert self._engine_task is not None
        await asyncio.shield(self._engine_task)

    async def stop(self, grace_s: float = 0.5) -> None:
        """End every stream with UNAVAILABLE and stop, within about 2 x grace_s: a step still
        running (a long prefill) is not waited for."""
        self.engine.stop()
        if self._engine_task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._engine_task, timeout=grace_s)
        await self.server.stop(grace_s)

"""The public gRPC API (folio.v1.Generator), health checking and reflection on grpc.aio.

`grpc_errors` is the one place where exceptions become statuses: FolioError subclasses carry
their code and a message for the client; anything else is INTERNAL and logged with a traceback.

The Generator service is registered with our own method handlers (`generator_handlers`) whose
request deserializer never raises: a message protobuf cannot parse (invalid UTF-8 in a string
field, truncated bytes) arrives as `Undecodable` and is answered INVALID_ARGUMENT, where
grpc's generated handlers would answer UNKNOWN. Requests are bounded at MAX_REQUEST_BYTES by
gRPC itself (RESOURCE_EXHAUSTED beyond it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.channel import SchedulerEnd
from protos.folio.v1 import generator_pb2 as pb
from scheduler_svc import inputs
from scheduler_svc.auth import ApiKeyInterceptor, server_credentials
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import Engine, ExecutorCallback
from scheduler_svc.errors import FolioError, InvalidRequest
from scheduler_svc.metrics import RequestMetrics
from scheduler_svc.metrics_http import MetricsServer
from scheduler_svc.prompts import PromptEncoder
from scheduler_svc.request import RequestStatus, TokenLogprobs
from scheduler_svc.structured_output import StructuredValidator
from scheduler_svc.tokenizer import Tokenizer

log = structlog.get_logger("folio.scheduler.server")

GENERATOR_SERVICE = pb.DESCRIPTOR.services_by_name["Generator"].full_name
# Largest request message accepted. A prompt of max_model_len tokens is a few bytes per token
# (text or token ids), so this leaves room for million-token contexts while bounding what one
# call can make the server hold; gRPC's default is 4 MiB.
MAX_REQUEST_BYTES = 16 * 1024 * 1024
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


def _token_logprobs(t: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        token_id=t.token_id, logprob=t.logprob, rank=t.rank,
        top_logprobs=[pb.Logprob(token_id=i, logprob=v)
                      for i, v in zip(t.top_ids, t.top_logprobs, strict=True)])


@dataclasses.dataclass(frozen=True)
class Undecodable:
    """A request message protobuf could not parse."""

    message_type: str
    reason: str

    def error(self) -> InvalidRequest:
        return InvalidRequest(f"could not decode the request as a {self.message_type} "
                              f"({self.reason}); serialize it from folio/v1/generator.proto, "
                              "with valid UTF-8 in every string field")


def lenient_deserializer(message_cls) -> Callable[[bytes], object]:
    def deserialize(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError as e:
            return Undecodable(message_cls.DESCRIPTOR.full_name, str(e))
    return deserialize


def grpc_errors(fn):
    """Map exceptions from a unary or server-streaming handler to gRPC statuses; a request
    that could not be decoded is INVALID_ARGUMENT before the handler runs."""
    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def stream_handler(self, request, context):
            try:
                if isinstance(request, Undecodable):
                    raise request.error()
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
            if isinstance(request, Undecodable):
                raise request.error()
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort_with(context, e, fn.__name__)
    return unary_handler


class GeneratorService:
    """folio.v1.Generator. Handlers run on the event loop with the engine; tokenization and
    chat rendering go to the PromptEncoder's threads."""

    def __init__(self, engine: Engine, prompts: PromptEncoder, served_model_name: str,
                 structured: StructuredValidator | None = None):
        self.engine = engine
        self.prompts = prompts
        self.tokenizer = prompts.tokenizer
        self.served_model_name = served_model_name
        self.structured = structured or StructuredValidator(prompts.tokenizer.eos_token_ids)

    def max_model_len(self) -> int:
        info = self.engine.executor
        return info.max_model_len if info is not None else self.prompts.model_max_len

    @grpc_errors
    async def Generate(self, request: pb.GenerateRequest, context):
        arrival_time = time.monotonic()  # latencies count tokenization, as vLLM's do
        params = inputs.submit_params(request)  # every cheap check before tokenizing
        prompt = await self.prompts.token_ids(request, self.max_model_len())
        bad_words = await self.prompts.bad_words(params.bad_words)
        params = dataclasses.replace(
            params, prompt_token_ids=prompt,
            sampling=dataclasses.replace(params.sampling, bad_words=bad_words))
        if (spec := params.sampling.structured) is not None:  # compiled off the event loop
            sampling = dataclasses.replace(params.sampling,
                                           structured=await self.structured.check(spec))
            params = dataclasses.replace(params, sampling=sampling)
        stream = self.engine.submit(params)
        stream.arrival_time = arrival_time
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
                if out.logprobs is not None:
                    response.logprobs.extend(map(_token_logprobs, out.logprobs))
                if out.prompt_logprobs is not None:
                    response.prompt_logprobs.extend(map(_token_logprobs, out.prompt_logprobs))
                if out.finish_status is not None:
                    num_open -= 1
                    done = num_open == 0
                    response.finish_reason = FINISH_REASONS[out.finish_status]
                    response.usage.prompt_tokens = out.num_prompt_tokens
                    response.usage.completion_tokens = out.num_output_tokens
                    response.usage.cached_tokens = out.num_cached_tokens
                    if isinstance(out.matched_stop, str):
                        response.matched_stop_str = out.matched_stop
                    elif out.matched_stop is not None:
                        response.matched_token_id = out.matched_stop
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
        ids = await self.prompts.token_ids(request, self.max_model_len())
        return pb.TokenizeResponse(token_ids=ids)

    @grpc_errors
    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        # model_name is the served name, never the executor's --model path.
        info, tok = self.engine.executor, self.tokenizer
        if info is None:  # what the scheduler knows alone; executor facts stay zero
            return pb.ModelInfo(model_name=self.served_model_name,
                                architecture=tok.architecture,
                                vocab_size=tok.config_vocab_size,
                                random_weights=tok.random_weights)
        return pb.ModelInfo(model_name=self.served_model_name, architecture=info.architecture,
                            max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                            block_size=info.block_size, num_kv_blocks=info.num_kv_blocks,
                            dtype=info.dtype, device=info.device,
                            random_weights=info.random_weights)

    @grpc_errors
    async def GetServerStats(self, request, context) -> pb.ServerStats:
        return pb.ServerStats(**self.engine.server_stats())


def generator_handlers(service: GeneratorService) -> dict[str, grpc.RpcMethodHandler]:
    """The method table grpc's generated `add_GeneratorServicer_to_server` would build, with
    lenient request deserializers."""
    def handler(kind, method, request_cls, response_cls):
        return kind(method, request_deserializer=lenient_deserializer(request_cls),
                    response_serializer=response_cls.SerializeToString)

    unary, streaming = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    return {
        "Generate": handler(streaming, service.Generate, pb.GenerateRequest,
                            pb.GenerateResponse),
        "Abort": handler(unary, service.Abort, pb.AbortRequest, pb.AbortResponse),
        "Tokenize": handler(unary, service.Tokenize, pb.TokenizeRequest, pb.TokenizeResponse),
        "GetModelInfo": handler(unary, service.GetModelInfo, pb.GetModelInfoRequest,
                                pb.ModelInfo),
        "GetServerStats": handler(unary, service.GetServerStats, pb.GetServerStatsRequest,
                                  pb.ServerStats),
    }


def served_model_name(config: SchedulerConfig, model_dir: Path) -> str:
    """--served-model-name, else the model's own name: a GGUF file's stem, a checkpoint
    directory's name, a hub id as given. Never a filesystem path, which would tell clients
    about the server's disk."""
    if config.served_model_name:
        return config.served_model_name
    if config.model is None:
        return Path(model_dir).resolve().name  # the default model
    path = Path(config.model).expanduser()
    if not path.exists():
        return config.model  # a hub id, resolved to a cache directory by the tokenizer
    if path.is_file():  # a GGUF file: its name, not its cache entry's
        return path.stem if path.suffix.lower() == ".gguf" else path.name
    return path.resolve().name  # a checkpoint directory, or one holding a GGUF file


class SchedulerServer:
    """The gRPC server plus the engine task; `start()` then `stop()`."""

    def __init__(self, config: SchedulerConfig, tokenizer: Tokenizer, channel: SchedulerEnd,
                 on_executor_change: ExecutorCallback | None = None,
                 shutdown_executor_on_stop: bool = False):
        self.health = health.aio.HealthServicer()
        self._on_executor_change = on_executor_change
        self.served_model_name = served_model_name(config, tokenizer.model_dir)
        self.metrics = RequestMetrics(self.served_model_name,
                                      export=config.metrics_port is not None)
        self.engine = Engine(config, tokenizer, channel, on_executor_change=self._executor_change,
                             shutdown_executor_on_stop=shutdown_executor_on_stop,
                             metrics=self.metrics)
        self.prompts = PromptEncoder(tokenizer, config.max_model_len)
        interceptors = [ApiKeyInterceptor(config.api_key)] if config.api_key else []
        # No SO_REUSEPORT: a second server on a busy port must fail, not share its traffic.
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[("grpc.so_reuseport", 0),
                     ("grpc.max_receive_message_length", MAX_REQUEST_BYTES)])
        self.structured = StructuredValidator(tokenizer.eos_token_ids)
        service = GeneratorService(self.engine, self.prompts, self.served_model_name,
                                   self.structured)
        handlers = generator_handlers(service)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(GENERATOR_SERVICE, handlers),))
        self.server.add_registered_method_handlers(GENERATOR_SERVICE, handlers)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (GENERATOR_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        if config.tls_cert is not None:
            self.port = self.server.add_secure_port(
                config.grpc_address, server_credentials(config.tls_cert, config.tls_key))
        else:
            self.port = self.server.add_insecure_port(config.grpc_address)
        # Bound now, like the gRPC port: a busy one fails start-up (OSError), not a later call.
        self.metrics_server = (MetricsServer(self.metrics.registry, config.host,
                                             config.metrics_port)
                               if config.metrics_port is not None else None)
        self._front_end = dict(served_model_name=self.served_model_name,
                               tls=config.tls_cert is not None, api_key=bool(config.api_key),
                               max_request_bytes=MAX_REQUEST_BYTES,
                               max_token_chars=self.prompts.max_token_chars,
                               metrics_url=self.metrics_server.url
                               if self.metrics_server is not None else None)
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
        if self.metrics_server is not None:
            self.metrics.serve_stats_from(asyncio.get_running_loop(), self.engine.server_stats)
            self.metrics_server.start()
        log.info("public API ready", **self._front_end)
        self._engine_task = asyncio.create_task(self.engine.run(), name="folio-engine")

    async def wait_engine(self) -> None:
        """Returns only if the engine loop ends (stop() or a crash, which it logs)."""
        assert self._engine_task is not None
        await asyncio.shield(self._engine_task)

    async def stop(self, grace_s: float = 0.3) -> None:
        """End every stream with UNAVAILABLE and stop, within about 2 x grace_s: a step still
        running (a long prefill) is not waited for."""
        self.engine.stop()
        if self._engine_task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._engine_task, timeout=grace_s)
        await self.server.stop(grace_s)
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.stop)
        self.prompts.close()
        self.structured.close()

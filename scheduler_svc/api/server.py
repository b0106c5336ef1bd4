"""The public gRPC API on grpc.aio: folio.v1.Generator and, on the same port, the vLLM worker
contract (`vllm_contract.py`) for gateways; health checking and reflection (v1, v1alpha).

Both services take their handlers from `grpc_handlers` (statuses, lenient deserializers) and
their request path from `generation`. Requests are bounded at MAX_REQUEST_BYTES by gRPC itself
(RESOURCE_EXHAUSTED beyond it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.channel import SchedulerEnd
from protos.folio.v1 import generator_pb2 as pb
from scheduler_svc.api import generation, inputs
from scheduler_svc.api.auth import ApiKeyInterceptor, server_credentials
from scheduler_svc.api.grpc_handlers import grpc_errors, register
from scheduler_svc.api.metrics_http import MetricsServer
from scheduler_svc.api.prompts import PromptEncoder
from scheduler_svc.api.reflection import enable_reflection
from scheduler_svc.api.structured_output import StructuredValidator
from scheduler_svc.api.vllm_contract import VLLM_SERVICE, VllmEngineService
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.engine import Engine, ExecutorCallback
from scheduler_svc.engine.metrics import RequestMetrics
from scheduler_svc.sched.request import RequestOutput, RequestStatus, TokenLogprobs
from scheduler_svc.text.tokenizer import Tokenizer

log = structlog.get_logger("folio.scheduler.server")

GENERATOR = pb.DESCRIPTOR.services_by_name["Generator"]
GENERATOR_SERVICE = GENERATOR.full_name
# Largest request message accepted. A prompt of max_model_len tokens is a few bytes per token
# (text or token ids), so this leaves room for million-token contexts while bounding what one
# call can make the server hold; gRPC's default is 4 MiB.
MAX_REQUEST_BYTES = 16 * 1024 * 1024
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: pb.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: pb.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: pb.FINISH_REASON_ABORT,
}


def _token_logprobs(t: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        token_id=t.token_id, logprob=t.logprob, rank=t.rank,
        top_logprobs=[pb.Logprob(token_id=i, logprob=v)
                      for i, v in zip(t.top_ids, t.top_logprobs, strict=True)])


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
        params = await generation.prepare(
            dataclasses.replace(params, prompt_token_ids=prompt), self.prompts, self.structured)
        outs = generation.outputs(self.engine, params, arrival_time)
        async with contextlib.aclosing(outs):
            async for out in outs:
                yield self._response(params.req_id, out)

    @staticmethod
    def _response(req_id: str, out: RequestOutput) -> pb.GenerateResponse:
        response = pb.GenerateResponse(request_id=req_id, token_ids=out.token_ids,
                                       text=out.text, index=out.index)
        if out.logprobs is not None:
            response.logprobs.extend(map(_token_logprobs, out.logprobs))
        if out.prompt_logprobs is not None:
            response.prompt_logprobs.extend(map(_token_logprobs, out.prompt_logprobs))
        if out.finish_status is not None:
            response.finish_reason = FINISH_REASONS[out.finish_status]
            response.usage.prompt_tokens = out.num_prompt_tokens
            response.usage.completion_tokens = out.num_output_tokens
            response.usage.cached_tokens = out.num_cached_tokens
            if isinstance(out.matched_stop, str):
                response.matched_stop_str = out.matched_stop
            elif out.matched_stop is not None:
                response.matched_token_id = out.matched_stop
        return response

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
                            random_weights=info.random_weights,
                            tensor_parallel_size=info.tensor_parallel_size,
                            kv_cache_dtype=info.kv_cache_dtype)

    @grpc_errors
    async def GetServerStats(self, request, context) -> pb.ServerStats:
        return pb.ServerStats(**self.engine.server_stats())


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
        register(self.server, GENERATOR, service)
        self.vllm = VllmEngineService(self.engine, self.prompts, self.served_model_name,
                                      self.structured, max_num_seqs=config.max_num_seqs,
                                      start_time=time.time())
        register(self.server, VLLM_SERVICE, self.vllm)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(
            (GENERATOR_SERVICE, VLLM_SERVICE.full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), self.server)
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
        for service in ("", GENERATOR_SERVICE, VLLM_SERVICE.full_name):
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

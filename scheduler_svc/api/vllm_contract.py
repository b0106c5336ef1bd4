"""vLLM's worker contract (`vllm.grpc.engine.VllmEngine`, the generated modules of the pinned
smg-grpc-proto package), served beside folio.v1.Generator on the same port so that the
Shepherd Model Gateway (`smg launch --worker-urls grpc://...`) can front Folio replicas: the
gateway speaks OpenAI's HTTP API, applies chat templates and detokenizes; workers take token
ids and return token ids.

Generate maps the request onto a folio.v1 GenerateRequest (`vllm_fields`) and takes the
Generator's own path (`inputs.submit_params`, `generation`), so both services accept and
refuse the same things with the same messages. The stream is, per sequence (`index`):

    stream=true:   GenerateStreamChunk* (new token ids; prompt, completion and cached token
                   counts so far; logprobs of the new tokens; prompt logprobs on index 0's
                   first chunk), then one GenerateComplete (all output ids, finish reason,
                   matched stop)
    stream=false:  one GenerateComplete with everything, logprobs included

SubscribeKvEvents streams the prefix cache's blocks stored, removed and cleared
(`kv_event_wire`: each stream starts with a snapshot, then live batches, numbered on from the
subscriber's cursor), so the gateway's cache-aware policy routes from the replicas' real cache
contents. FlushCache forgets every cached block once no request is in flight (waiting up to
timeout_s), as vLLM's reset_prefix_cache. RPCs Folio has no counterpart for (Embed,
StartProfile, StopProfile) answer UNIMPLEMENTED with a reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import hashlib
import io
import math
import time
import zipfile
from importlib import metadata

from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import common_pb2

from scheduler_svc.api import generation, inputs, kv_event_wire, vllm_fields
from scheduler_svc.api.grpc_handlers import grpc_errors
from scheduler_svc.api.prompts import PromptEncoder
from scheduler_svc.api.structured_output import StructuredValidator
from scheduler_svc.engine.engine import Engine
from scheduler_svc.errors import InvalidRequest, NotSupported
from scheduler_svc.sched.request import RequestOutput

VLLM_SERVICE = vpb.DESCRIPTOR.services_by_name["VllmEngine"]
MAX_FLUSH_TIMEOUT_S = 3600.0
TOKENIZER_CHUNK_BYTES = 64 * 1024  # the gateway's GetTokenizer client reads 64 KiB chunks
# The model directory's files a tokenizer is rebuilt from (those scheduler_svc.text.tokenizer
# reads), zipped flat for GetTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "config.json", "generation_config.json")
try:
    FOLIO_VERSION = metadata.version("folio")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    FOLIO_VERSION = "unknown"


def tokenizer_zip(model_dir) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                zf.write(model_dir / name, name)
    return buf.getvalue()


class VllmEngineService:
    """vllm.grpc.engine.VllmEngine on Folio's engine. Handlers run on the event loop with the
    engine, as GeneratorService's do."""

    def __init__(self, engine: Engine, prompts: PromptEncoder, served_model_name: str,
                 structured: StructuredValidator, max_num_seqs: int, start_time: float):
        self.engine = engine
        self.prompts = prompts
        self.tokenizer = prompts.tokenizer
        self.served_model_name = served_model_name
        self.structured = structured
        self.max_num_seqs = max_num_seqs
        self.start_time = start_time
        self.last_receive_timestamp = 0.0
        self._tokenizer_zip: asyncio.Future[bytes] | None = None

    def max_model_len(self) -> int:
        info = self.engine.executor
        return info.max_model_len if info is not None else self.prompts.model_max_len

    # ---- generation --------------------------------------------------------------------

    @grpc_errors
    async def Generate(self, request: vpb.GenerateRequest, context):
        self.last_receive_timestamp = time.time()
        arrival_time = time.monotonic()  # latencies count tokenization, as vLLM's do
        msg = vllm_fields.folio_request(request)
        params = inputs.submit_params(msg)  # every cheap check before tokenizing
        max_model_len = self.max_model_len()
        keep = vllm_fields.truncate_to(request.sampling_params, max_model_len)
        if keep is not None and msg.WhichOneof("input") == "token_ids":
            del msg.token_ids.ids[:-keep]  # before the prompt-length check, as vLLM does
        prompt = await self.prompts.token_ids(msg, max_model_len)
        if keep is not None:
            prompt = prompt[-keep:]
        params = await generation.prepare(
            dataclasses.replace(params, prompt_token_ids=prompt), self.prompts, self.structured)
        sampling = request.sampling_params
        top_logprobs = sampling.HasField("logprobs") and sampling.logprobs > 0
        top_prompt_logprobs = (sampling.HasField("prompt_logprobs")
                               and sampling.prompt_logprobs > 0)
        output_ids: dict[int, list[int]] = {}  # index -> all its output ids so far
        logprobs: dict[int, list] = {}  # index -> all its logprobs (stream=false)
        prompt_logprobs = None
        outs = generation.outputs(self.engine, params, arrival_time)
        async with contextlib.aclosing(outs):
            async for out in outs:
                output_ids.setdefault(out.index, []).extend(out.token_ids)
                if out.prompt_logprobs is not None:
                    prompt_logprobs = vllm_fields.input_logprobs(
                        prompt, out.prompt_logprobs, top_prompt_logprobs)
                if request.stream:
                    if out.token_ids or out.prompt_logprobs is not None:
                        yield self._chunk(out, prompt_logprobs, top_logprobs)
                        prompt_logprobs = None  # sent once, on that first chunk
                elif out.logprobs is not None:
                    logprobs.setdefault(out.index, []).extend(out.logprobs)
                if out.finish_status is None:
                    continue
                done = vllm_fields.complete(out, output_ids[out.index])
                if not request.stream:
                    if out.index in logprobs:
                        done.output_logprobs.CopyFrom(vllm_fields.output_logprobs(
                            logprobs[out.index], top_logprobs))
                    if prompt_logprobs is not None and out.index == 0:
                        done.input_logprobs.CopyFrom(prompt_logprobs)
                yield vpb.GenerateResponse(complete=done)

    @staticmethod
    def _chunk(out: RequestOutput, prompt_logprobs: vpb.InputLogProbs | None,
               top_logprobs: bool) -> vpb.GenerateResponse:
        chunk = vpb.GenerateStreamChunk(
            token_ids=out.token_ids, prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens, cached_tokens=out.num_cached_tokens,
            index=out.index)
        if out.logprobs is not None:
            chunk.output_logprobs.CopyFrom(vllm_fields.output_logprobs(out.logprobs,
                                                                       top_logprobs))
        if prompt_logprobs is not None:
            chunk.input_logprobs.CopyFrom(prompt_logprobs)
        return vpb.GenerateResponse(chunk=chunk)

    @grpc_errors
    async def Abort(self, request: vpb.AbortRequest, context) -> vpb.AbortResponse:
        for req_id in request.request_ids:
            self.engine.abort(req_id)  # an unknown id (already finished) is no error
        return vpb.AbortResponse()

    # ---- state -------------------------------------------------------------------------

    @grpc_errors
    async def HealthCheck(self, request, context) -> vpb.HealthCheckResponse:
        if self.engine.executor is None:
            return vpb.HealthCheckResponse(healthy=False, message="no executor connected")
        return vpb.HealthCheckResponse(healthy=True, message="serving")

    @grpc_errors
    async def GetModelInfo(self, request, context) -> vpb.GetModelInfoResponse:
        # tokenizer_path stays empty: a path would tell clients about the server's disk
        # (served_model_name's rule); the gateway then fetches the files with GetTokenizer.
        info, tok = self.engine.executor, self.tokenizer
        max_len = self.max_model_len()
        return vpb.GetModelInfoResponse(
            model_path=self.served_model_name, is_generation=True,
            max_context_length=max_len, max_req_input_len=max_len,
            vocab_size=info.vocab_size if info is not None else tok.config_vocab_size,
            served_model_name=self.served_model_name, tokenizer_path="",
            model_type=tok.model_type,
            architectures=[info.architecture if info is not None else tok.architecture],
            eos_token_ids=sorted(tok.eos_token_ids))

    @grpc_errors
    async def GetServerInfo(self, request, context) -> vpb.GetServerInfoResponse:
        info = self.engine.executor
        return vpb.GetServerInfoResponse(
            active_requests=len(self.engine.registry),
            last_receive_timestamp=self.last_receive_timestamp,
            uptime_seconds=time.time() - self.start_time, server_type="folio-grpc",
            data_parallel_size=1, max_num_seqs=self.max_num_seqs,
            block_size=info.block_size if info is not None else 0,
            model_dtype=info.dtype if info is not None else "",
            kv_cache_dtype=info.kv_cache_dtype if info is not None else "",
            constrained_decoding_start="first_token")

    @grpc_errors
    async def GetLoads(self, request: vpb.GetLoadsRequest, context) -> vpb.GetLoadsResponse:
        response = vpb.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.UTC).isoformat(),
            version=FOLIO_VERSION, dp_rank_count=1)
        if request.HasField("dp_rank") and request.dp_rank != 0:
            return response  # the one rank is 0
        stats = self.engine.server_stats()
        block_size = self.engine.executor.block_size if self.engine.executor else 0
        used_blocks = stats["kv_blocks_total"] - stats["kv_blocks_free"]
        response.loads.add(
            dp_rank=0, num_running_reqs=stats["num_running"],
            num_waiting_reqs=stats["num_waiting"],
            num_total_reqs=stats["num_running"] + stats["num_waiting"],
            num_used_tokens=used_blocks * block_size,
            max_total_num_tokens=stats["kv_blocks_total"] * block_size,
            token_usage=used_blocks / stats["kv_blocks_total"] if stats["kv_blocks_total"]
            else 0.0,
            cache_hit_rate=stats["prefix_cache_hit_rate"],
            max_running_requests=self.max_num_seqs)
        return response

    @grpc_errors
    async def GetTokenizer(self, request, context):
        """The tokenizer's files as one zip, in 64 KiB chunks; the last carries the zip's
        SHA-256 (hex). Built once, off the event loop."""
        if self._tokenizer_zip is None:
            self._tokenizer_zip = asyncio.ensure_future(
                asyncio.to_thread(tokenizer_zip, self.tokenizer.model_dir))
        data = await asyncio.shield(self._tokenizer_zip)
        sha256 = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = start + TOKENIZER_CHUNK_BYTES
            yield common_pb2.GetTokenizerChunk(data=data[start:end],
                                               sha256=sha256 if end >= len(data) else "")

    # ---- the prefix cache ----------------------------------------------------------------

    @grpc_errors
    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest, context):
        """A snapshot of the cached blocks, then every change, until the server stops (the
        stream ends OK) or this subscriber falls too far behind (RESOURCE_EXHAUSTED: subscribe
        again). `load_records_before_first_batch` is accepted; Folio sends no load records on
        this stream (GetLoads serves them)."""
        kv_event_wire.check_start(request.start_sequence_number)
        subscription = self.engine.subscribe_kv_events()
        try:
            # Headers now: the gateway's subscribe call returns before the first batch.
            await context.send_initial_metadata(())
            sequence_number, event_id = request.start_sequence_number, 0
            while (batch := await subscription.get()) is not None:
                sequence_number += 1
                msg, event_id = kv_event_wire.batch_message(batch, sequence_number, event_id)
                yield msg
        finally:
            subscription.cancel()

    @grpc_errors
    async def FlushCache(self, request: common_pb2.FlushCacheRequest, context
                         ) -> common_pb2.FlushCacheResponse:
        timeout_s = request.timeout_s
        if not (math.isfinite(timeout_s) and 0 <= timeout_s <= MAX_FLUSH_TIMEOUT_S):
            raise InvalidRequest(f"timeout_s must be 0 (flush only if idle now) to "
                                 f"{MAX_FLUSH_TIMEOUT_S:g} seconds, got {timeout_s}")
        success, message = await self.engine.flush_prefix_cache(timeout_s)
        return common_pb2.FlushCacheResponse(success=success, message=message)

    # ---- not in Folio ------------------------------------------------------------------

    @grpc_errors
    async def Embed(self, request, context):
        raise NotSupported("Folio serves generative models only; Embed is not supported")

    @grpc_errors
    async def StartProfile(self, request, context):
        raise NotSupported("profiling over gRPC is not supported by Folio")

    @grpc_errors
    async def StopProfile(self, request, context):
        raise NotSupported("profiling over gRPC is not supported by Folio")


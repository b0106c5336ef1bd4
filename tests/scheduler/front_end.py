"""Helpers for the front-end tests: a real SchedulerServer with any tokenizer and config (TLS,
API key), and raw-bytes calls that send what no protobuf library would serialize."""

from __future__ import annotations

import contextlib

import grpc
from grpc_health.v1 import health_pb2_grpc

from protos.channel import SchedulerEnd
from protos.folio.v1 import generator_pb2 as pb
from protos.folio.v1 import generator_pb2_grpc as pb_grpc
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import SchedulerServer
from scheduler_svc.tokenizer import Tokenizer
from tests.scheduler.grpc_harness import Harness

INVALID_UTF8 = b"\xff\xfe\xc3("  # a lone continuation byte, and a truncated sequence


@contextlib.asynccontextmanager
async def running_server(tokenizer: Tokenizer, credentials: grpc.ChannelCredentials | None = None,
                         **config):
    """Like the `harness` fixture, for any tokenizer and SchedulerConfig fields; the client
    channel uses `credentials` (TLS) when given."""
    config = SchedulerConfig(model=str(tokenizer.model_dir), port=0, executor_timeout_s=2.0,
                             stats_interval_s=0.5, **config)
    channel = SchedulerEnd("tcp://127.0.0.1:*")
    server = SchedulerServer(config, tokenizer, channel)
    await server.start()
    target = f"127.0.0.1:{server.port}"
    grpc_channel = (grpc.aio.secure_channel(target, credentials) if credentials is not None
                    else grpc.aio.insecure_channel(target))
    h = Harness(server, channel.address, pb_grpc.GeneratorStub(grpc_channel),
                health_pb2_grpc.HealthStub(grpc_channel), [])
    try:
        yield h
    finally:
        await server.stop(grace_s=0.5)
        await grpc_channel.close()
        for ex in h.executors:
            ex.stop()
            assert ex.violation is None, f"plan protocol violated: {ex.violation}"
        channel.close()


def with_invalid_utf8(msg, marker: str) -> bytes:
    """`msg` serialized with the string `marker` (which it must contain exactly once, e.g. as
    a field's value) replaced by invalid UTF-8 of the same length, so the framing stays valid."""
    assert len(marker.encode()) == len(INVALID_UTF8)
    data = msg.SerializeToString()
    assert data.count(marker.encode()) == 1
    return data.replace(marker.encode(), INVALID_UTF8)


async def raw_generate(port: int, data: bytes, timeout: float = 30.0
                       ) -> list[pb.GenerateResponse]:
    """A Generate call whose request is `data` as is."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream("/folio.v1.Generator/Generate",
                                    response_deserializer=pb.GenerateResponse.FromString)
        return [r async for r in call(data, timeout=timeout)]


async def raw_unary(port: int, method: str, data: bytes, response_cls, timeout: float = 30.0):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(f"/folio.v1.Generator/{method}",
                                   response_deserializer=response_cls.FromString)
        return await call(data, timeout=timeout)

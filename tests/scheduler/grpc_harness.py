"""The gRPC test harness: the real SchedulerServer on 127.0.0.1 with null-model executors
(tests.scheduler.null_executor) over real ZeroMQ. The `harness` fixture is in conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.channel import MAX_FRAME_BYTES, SchedulerEnd
from protos.channel_keys import ChannelKeys
from protos.folio.v1 import generator_pb2 as pb
from protos.folio.v1 import generator_pb2_grpc as pb_grpc
from scheduler_svc.api.server import SchedulerServer
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.text.tokenizer import Tokenizer
from tests.scheduler.null_executor import NullExecutor, next_token

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Harness:
    server: SchedulerServer
    executor_address: str
    stub: pb_grpc.GeneratorStub
    health: health_pb2_grpc.HealthStub
    executors: list[NullExecutor]

    def connect(self, **kwargs) -> NullExecutor:
        ex = NullExecutor(self.executor_address, **kwargs)
        self.executors.append(ex)
        ex.start()
        return ex

    async def health_status(self, service: str = "") -> int:
        resp = await self.health.Check(health_pb2.HealthCheckRequest(service=service))
        return resp.status

    async def wait_health(self, status: int, timeout: float = 10.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while await self.health_status() != status:
            assert asyncio.get_running_loop().time() < deadline, "health never changed"
            await asyncio.sleep(0.02)

    async def serve(self, **kwargs) -> NullExecutor:
        ex = self.connect(**kwargs)
        await self.wait_health(SERVING)
        return ex

    async def stats(self) -> pb.ServerStats:
        return await self.stub.GetServerStats(pb.GetServerStatsRequest())


def gen_request(ids=None, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids or [5, 6, 7]),
                              sampling=pb.SamplingParams(**sampling))


async def collect(call) -> list[pb.GenerateResponse]:
    """Every remaining message (read() style, so it can follow an earlier call.read())."""
    responses = []
    while (resp := await call.read()) is not grpc.aio.EOF:
        responses.append(resp)
    return responses


def null_continuation(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(next_token(ids))
    return ids[len(prompt):]


@contextlib.asynccontextmanager
async def running_server(tokenizer: Tokenizer, credentials: grpc.ChannelCredentials | None = None,
                         keys: ChannelKeys | None = None, max_frame_bytes: int = MAX_FRAME_BYTES,
                         expect_stalled: int = 0, **config):
    """A real SchedulerServer on 127.0.0.1 for `tokenizer`'s model dir with these
    SchedulerConfig fields, its channel authenticated by `keys` when given, as a Harness; the
    client channel uses `credentials` (TLS) when given. It tells its executors to shut down
    when it stops, as `folio serve` does. On the way out it checks that the stall watchdog
    ended exactly `expect_stalled` requests (none, but in its own tests)."""
    config = SchedulerConfig(**{"model": str(tokenizer.model_dir), "port": 0,
                                "executor_timeout_s": 2.0, "stats_interval_s": 0.5, **config})
    channel = SchedulerEnd("tcp://127.0.0.1:*", keys, max_frame_bytes=max_frame_bytes)
    server = SchedulerServer(config, tokenizer, channel, shutdown_executor_on_stop=True)
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
        assert server.engine.watchdog.num_stalled == expect_stalled, "the stall watchdog fired"

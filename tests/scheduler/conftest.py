"""Fixtures for the scheduler tests: a tokenizer-only model dir, shared per session, and the
gRPC harness (tests.scheduler.grpc_harness) around a real SchedulerServer."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc

from protos.channel import SchedulerEnd
from protos.folio.v1 import generator_pb2_grpc as pb_grpc
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import SchedulerServer
from scheduler_svc.tokenizer import Tokenizer
from tests.scheduler.grpc_harness import Harness
from tests.scheduler.tiny_model import write_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


@pytest.fixture
async def harness(tiny_model_dir, tiny_tokenizer):
    config = SchedulerConfig(model=str(tiny_model_dir), port=0, executor_timeout_s=2.0,
                             stats_interval_s=0.5)
    channel = SchedulerEnd("tcp://127.0.0.1:*")
    server = SchedulerServer(config, tiny_tokenizer, channel, shutdown_executor_on_stop=True)
    await server.start()
    grpc_channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
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

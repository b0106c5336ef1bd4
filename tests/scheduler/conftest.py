"""Fixtures for the scheduler tests: a tokenizer-only model dir, shared per session, and the
gRPC harness (tests.scheduler.grpc_harness) around a real SchedulerServer."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler_svc.text.tokenizer import Tokenizer
from tests.fixtures.tiny_model import write_model_dir
from tests.scheduler.grpc_harness import running_server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


@pytest.fixture
async def harness(tiny_tokenizer):
    async with running_server(tiny_tokenizer) as h:
        yield h

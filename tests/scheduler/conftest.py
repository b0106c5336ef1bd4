"""Fixtures for the scheduler tests: a tokenizer-only model dir, shared per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler_svc.tokenizer import Tokenizer
from tests.scheduler.tiny_model import write_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer(tiny_model_dir)

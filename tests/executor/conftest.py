"""Fixtures for the executor tests (helpers live in harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.executor.harness import make_hf_model, save_checkpoint


@pytest.fixture(scope="module")
def checkpoint_cache(tmp_path_factory):
    """arch -> (HF model, checkpoint dir), built once per test module."""
    built: dict[str, tuple[object, Path]] = {}

    def get(arch: str):
        if arch not in built:
            model = make_hf_model(arch)
            built[arch] = (model, save_checkpoint(model, tmp_path_factory.mktemp(arch)))
        return built[arch]

    return get



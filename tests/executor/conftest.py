"""Fixtures for the executor tests (helpers live in harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.executor.harness import MXFP4_ARCH, make_hf_model, save_checkpoint
from tests.fixtures.mxfp4_checkpoints import load_hf_mxfp4, write_mxfp4_experts


@pytest.fixture(scope="module")
def checkpoint_cache(tmp_path_factory):
    """arch (a harness architecture, or MXFP4_ARCH) -> (HF model, checkpoint dir), built once
    per test module."""
    built: dict[str, tuple[object, Path]] = {}

    def get(arch: str):
        if arch in built:
            return built[arch]
        if arch == MXFP4_ARCH:
            model_dir = save_checkpoint(make_hf_model("gpt_oss"), tmp_path_factory.mktemp(arch))
            write_mxfp4_experts(model_dir)
            built[arch] = (load_hf_mxfp4(model_dir), model_dir)
        else:
            model = make_hf_model(arch)
            built[arch] = (model, save_checkpoint(model, tmp_path_factory.mktemp(arch)))
        return built[arch]

    return get

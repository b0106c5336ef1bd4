"""GGUF test set-up: tiny checkpoints written as GGUF files and converted back, once per
module."""

import pytest

from checkpoints.gguf import gguf_checkpoint_dir
from tests.fixtures.gguf_files import make_gguf


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(arch, tensor type) -> (HF dir, GGUF file, converted dir), built once per module."""
    built: dict[tuple[str, str], tuple] = {}

    def get(arch: str, tensor_type: str = "F32"):
        if (arch, tensor_type) not in built:
            root = tmp_path_factory.mktemp(f"{arch}-{tensor_type}")
            hf_dir, gguf_file = make_gguf(arch, tensor_type, root)
            built[arch, tensor_type] = (hf_dir, gguf_file,
                                        gguf_checkpoint_dir(gguf_file, root / "cache"))
        return built[arch, tensor_type]

    return get

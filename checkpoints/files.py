"""A checkpoint directory's files, checked without torch.

Everything here reads only JSON and safetensors headers, so the executor can refuse a damaged
checkpoint in a fraction of a second, before its multi-second torch import: a missing or
unreadable file, bad JSON, an index naming shards that are not there, a truncated or garbage
safetensors file, header offsets past the end of the file, a non-float tensor. Each is a
`CheckpointError` whose text starts with the path of the file at fault.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names; the loader converts
# fp8 checkpoints' weights (e4m3); the loader takes them only into layers with a weight_scale.
FP8_DTYPES = ("F8_E4M3",)
PACKED_DTYPES = ("I32", "U8")  # quantized checkpoints' packed tensors (GPTQ, AWQ, GGUF blocks)


class CheckpointError(ValueError):
    """A checkpoint file Folio cannot use. ``str()`` is ``<file>: <what is wrong>``, the one line
    the executor prints before it exits (no traceback: the fix is in the file, not the code)."""

    def __init__(self, path: Path | str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; every way it can fail is a CheckpointError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(path, "file not found") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(path, f"not UTF-8 text (byte {e.start}): the file is damaged "
                                    "or not a JSON file") from None
    except OSError as e:  # permissions, a directory in the file's place, I/O errors
        raise CheckpointError(path, f"cannot be read: {e.strerror or e}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(path, f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(path, f"holds a JSON {_json_type(value)}; expected an object "
                                    "({...})")
    return value


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: the shards named by the index, or model.safetensors."""
    index = model_dir / INDEX_FILE
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if (not isinstance(weight_map, dict) or not weight_map
                or not all(isinstance(v, str) for v in weight_map.values())):
            raise CheckpointError(index, "has no 'weight_map' object mapping tensor names to "
                                         "shard file names")
        files = []
        for name in sorted(set(weight_map.values())):
            # A shard is a file of this directory: no path may lead elsewhere.
            if Path(name).name != name:
                raise CheckpointError(index, f"names the shard {name!r}, which is not a plain "
                                             "file name in the checkpoint directory")
            if not (model_dir / name).exists():
                raise CheckpointError(model_dir / name,
                                      f"not found, but {INDEX_FILE} names it as a shard")
            files.append(model_dir / name)
        return files
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise CheckpointError(single, f"not found (the directory has no model.safetensors nor "
                                  f"{INDEX_FILE}; only safetensors checkpoints are supported)")


@contextlib.contextmanager
def open_safetensors(file: Path, framework: str = "np") -> Iterator[Any]:
    """safe_open whose failures (bad header, offsets past the end, I/O) name the file. The
    header is validated when the file is opened; "np" reads headers without importing torch."""
    if not file.is_file():
        raise CheckpointError(file, "not a regular file")
    try:
        with safe_open(str(file), framework=framework, device="cpu") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise CheckpointError(file, f"not a readable safetensors file ({e})") from None


@dataclass(frozen=True)
class TensorHeader:
    """One tensor as a safetensors header declares it."""

    file: Path
    name: str
    dtype: str  # safetensors' name: F32, BF16, I32, ...
    shape: tuple[int, ...]


def read_weight_headers(files: list[Path]) -> list[TensorHeader]:
    """Every tensor the weight files (at least one) declare; refuses non-float tensors, a
    tensor name that two shards both claim, and a checkpoint with no tensor at all."""
    headers: list[TensorHeader] = []
    seen: dict[str, Path] = {}
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                tensor = f.get_slice(name)
                header = TensorHeader(file, name, tensor.get_dtype(), tuple(tensor.get_shape()))
                if header.dtype not in FLOAT_DTYPES + FP8_DTYPES + PACKED_DTYPES:
                    raise CheckpointError(file, f"tensor {name} has dtype {header.dtype}; "
                                                "weights must be floating point (F32, F16, "
                                                "BF16, F64), fp8 (F8_E4M3) or the packed "
                                                "integers of a quantized checkpoint (I32, U8)")
                if name in seen:
                    raise CheckpointError(file, f"tensor {name} is also in {seen[name].name}")
                seen[name] = file
                headers.append(header)
    if not headers:
        raise CheckpointError(files[0] if len(files) == 1 else files[0].parent / INDEX_FILE,
                              "the checkpoint declares no tensors")
    return headers

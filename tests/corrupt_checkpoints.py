"""Corrupt variants of a valid checkpoint directory, one damage each, for the start-up tests.

Each `Damage` edits a copy of a good checkpoint in place and names the file a clear error must
mention. `executor` / `scheduler` say which process reads that file: the executor reads
config.json, the index and the weights; the scheduler reads config.json and the tokenizer files
(it never opens the weights).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Damage:
    name: str
    file: str  # the file the error must name
    apply: Callable[[Path], None]
    executor: bool = True  # the executor must refuse to start
    scheduler: bool = False  # Tokenizer(model_dir) must raise ModelDirError


def _edit_config(**changes) -> Callable[[Path], None]:
    def apply(model_dir: Path) -> None:
        path = model_dir / "config.json"
        config = json.loads(path.read_text())
        config.update(changes)
        path.write_text(json.dumps(config))
    return apply


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    def apply(model_dir: Path) -> None:
        (model_dir / name).write_bytes(data)
    return apply


def _remove(name: str) -> Callable[[Path], None]:
    def apply(model_dir: Path) -> None:
        (model_dir / name).unlink()
    return apply


def _replace_with_directory(name: str) -> Callable[[Path], None]:
    """A file that cannot be read as one (EISDIR): what root sees of an unreadable file too."""
    def apply(model_dir: Path) -> None:
        (model_dir / name).unlink()
        (model_dir / name).mkdir()
    return apply


def _read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _truncate(model_dir: Path) -> None:
    path = model_dir / WEIGHTS
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) // 2])


def _offsets_past_eof(model_dir: Path) -> None:
    """The last tensor's byte range ends beyond the file (the header claims more data)."""
    path = model_dir / WEIGHTS
    header, data = _read_header(path)
    last = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1])
    start, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [start, end + 4096]
    _write_header(path, header, data)


def _huge_header_length(model_dir: Path) -> None:
    path = model_dir / WEIGHTS
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 60) + raw[8:])


def _integer_tensor(model_dir: Path) -> None:
    """A weight stored as int32: same byte size, so only the dtype is wrong."""
    path = model_dir / WEIGHTS
    header, data = _read_header(path)
    name = next(k for k in header if k.endswith("norm.weight"))
    header[name]["dtype"] = "I32"
    _write_header(path, header, data)


def _wrong_shape(model_dir: Path) -> None:
    """A norm weight declared [2, n/2]: consistent bytes, a shape the model cannot take."""
    path = model_dir / WEIGHTS
    header, data = _read_header(path)
    name = next(k for k in header if k.endswith("norm.weight"))
    (n,) = header[name]["shape"]
    header[name]["shape"] = [2, n // 2]
    _write_header(path, header, data)


def _shard(model_dir: Path) -> None:
    """Turn model.safetensors into a one-shard sharded checkpoint with its index."""
    header, _ = _read_header(model_dir / WEIGHTS)
    shard = "model-00001-of-00001.safetensors"
    (model_dir / WEIGHTS).rename(model_dir / shard)
    weight_map = {k: shard for k in header if k != "__metadata__"}
    (model_dir / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _index_names_missing_shard(model_dir: Path) -> None:
    _shard(model_dir)
    index = json.loads((model_dir / INDEX).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "model-00002-of-00002.safetensors"
    (model_dir / INDEX).write_text(json.dumps(index))


def _index_then(edit: Callable[[Path], None]) -> Callable[[Path], None]:
    def apply(model_dir: Path) -> None:
        _shard(model_dir)
        edit(model_dir)
    return apply


DAMAGES: tuple[Damage, ...] = (
    # config.json: read by both processes
    Damage("config-missing", "config.json", _remove("config.json")),
    Damage("config-not-json", "config.json", _write("config.json", b'{"vocab_size": 2'),
           scheduler=True),
    Damage("config-binary", "config.json", _write("config.json", bytes(range(256)) * 4),
           scheduler=True),
    Damage("config-is-a-list", "config.json", _write("config.json", b"[1, 2, 3]"),
           scheduler=True),
    Damage("config-unreadable", "config.json", _replace_with_directory("config.json"),
           scheduler=True),
    Damage("config-negative-vocab", "config.json", _edit_config(vocab_size=-5), scheduler=True),
    Damage("config-zero-hidden-size", "config.json", _edit_config(hidden_size=0)),
    Damage("config-zero-layers", "config.json", _edit_config(num_hidden_layers=0)),
    Damage("config-heads-do-not-divide-hidden", "config.json",
           _edit_config(num_attention_heads=3, num_key_value_heads=1, head_dim=None)),
    Damage("config-kv-heads-do-not-divide-heads", "config.json",
           _edit_config(num_key_value_heads=3)),
    Damage("config-size-is-a-string", "config.json", _edit_config(hidden_size="64")),
    Damage("config-size-is-a-fraction", "config.json", _edit_config(intermediate_size=127.5)),
    Damage("config-eps-is-negative", "config.json", _edit_config(rms_norm_eps=-1.0)),
    Damage("config-architectures-not-a-list", "config.json",
           _edit_config(architectures="LlamaForCausalLM"), scheduler=True),
    # refused by the model code, after the torch import
    Damage("config-unknown-architecture", "config.json",
           _edit_config(architectures=["GPT2LMHeadModel"])),
    Damage("config-unsupported-rope", "config.json",
           _edit_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})),
    Damage("config-eos-is-a-string", "config.json", _edit_config(eos_token_id="</s>"),
           executor=False, scheduler=True),
    # the weights
    Damage("weights-missing", WEIGHTS, _remove(WEIGHTS)),
    Damage("weights-empty", WEIGHTS, _write(WEIGHTS, b"")),
    Damage("weights-truncated", WEIGHTS, _truncate),
    Damage("weights-garbage", WEIGHTS, _write(WEIGHTS, bytes(range(256)) * 64)),
    Damage("weights-offsets-past-eof", WEIGHTS, _offsets_past_eof),
    Damage("weights-huge-header-length", WEIGHTS, _huge_header_length),
    Damage("weights-integer-dtype", WEIGHTS, _integer_tensor),
    Damage("weights-wrong-shape", WEIGHTS, _wrong_shape),
    Damage("weights-unreadable", WEIGHTS, _replace_with_directory(WEIGHTS)),
    # the sharded index
    Damage("index-names-missing-shard", "model-00002-of-00002.safetensors",
           _index_names_missing_shard),
    Damage("index-not-json", INDEX, _index_then(_write(INDEX, b"{weight_map"))),
    Damage("index-without-weight-map", INDEX, _index_then(_write(INDEX, b'{"metadata": {}}'))),
    Damage("index-weight-map-is-a-list", INDEX,
           _index_then(_write(INDEX, b'{"weight_map": ["model-00001-of-00001.safetensors"]}'))),
    # tokenizer files: the scheduler's
    Damage("tokenizer-missing", "tokenizer.json", _remove("tokenizer.json"),
           executor=False, scheduler=True),
    Damage("tokenizer-garbage", "tokenizer.json", _write("tokenizer.json", b"\x00garbage\xff"),
           executor=False, scheduler=True),
    Damage("tokenizer-wrong-structure", "tokenizer.json",
           _write("tokenizer.json", b'{"model": {"type": "BPE", "vocab": 5}}'),
           executor=False, scheduler=True),
    Damage("tokenizer-unreadable", "tokenizer.json", _replace_with_directory("tokenizer.json"),
           executor=False, scheduler=True),
    Damage("tokenizer-config-not-json", "tokenizer_config.json",
           _write("tokenizer_config.json", b"{,}"), executor=False, scheduler=True),
    Damage("chat-template-syntax-error", "tokenizer_config.json",
           _write("tokenizer_config.json",
                  json.dumps({"chat_template": "{% for m in messages %}{{ m"}).encode()),
           executor=False, scheduler=True),
    Damage("generation-config-not-json", "generation_config.json",
           _write("generation_config.json", b"eos"), executor=False, scheduler=True),
)

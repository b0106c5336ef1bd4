"""A bad GGUF input ends each entry point with one line naming the file, never a traceback:
the converter's CLI, the executor (`python -m executor_svc --model BAD`), the scheduler's
model resolution, and `folio serve`."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from scheduler_svc.text.tokenizer import ModelDirError, resolve_model_dir
from tests.conftest import run_server
from tests.fixtures.gguf_files import make_gguf, write_gguf

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class BadInput:
    model: Path  # what --model gets
    culprit: Path  # the file (or directory) the message must start with
    says: str  # and a phrase it must contain


def _write_metadata_only(path: Path, arch: str) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _q8_1_down_proj(name: str, values: np.ndarray):
    """A tensor stored as Q8_1, a type the gguf package cannot dequantize."""
    import gguf

    if name != "blk.0.ffn_down.weight":
        return None
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    rows, cols = values.shape
    return np.zeros((rows, cols // block * size), np.uint8), gguf.GGMLQuantizationType.Q8_1


def _write_big_vocab(writer) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(2100)])


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory) -> dict[str, BadInput]:
    root = tmp_path_factory.mktemp("bad-gguf")
    hf_dir, good = make_gguf("llama2", "F16", root / "good", num_hidden_layers=1)
    cases: dict[str, BadInput] = {}

    def add(name: str, model: Path, says: str, culprit: Path | None = None) -> None:
        cases[name] = BadInput(model, culprit or model, says)

    garbage = root / "garbage.gguf"
    garbage.write_bytes(b"\x00not a model\xff" * 100)
    add("garbage", garbage, "not a GGUF file")
    empty = root / "empty.gguf"
    empty.write_bytes(b"")
    add("empty", empty, "empty file")
    truncated = root / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:good.stat().st_size // 2])
    add("truncated", truncated, "truncated GGUF file")
    add("unknown-architecture", _write_metadata_only(root / "gpt2.gguf", "gpt2"),
        "GGUF architecture 'gpt2' is not supported; supported: gemma2, gemma3, llama, phi3, "
        "qwen2, qwen2moe, qwen3, qwen3moe")
    add("missing-metadata", _write_metadata_only(root / "bare-llama.gguf", "llama"),
        "metadata llama.embedding_length is missing")
    add("unknown-tensor-type",
        write_gguf(hf_dir, root / "q8_1.gguf", "F16", encode=_q8_1_down_proj),
        "tensor blk.0.ffn_down.weight is stored as Q8_1, which cannot be dequantized")
    add("more-tokens-than-embeddings",
        write_gguf(hf_dir, root / "big-vocab.gguf", "F16", write_tokenizer=_write_big_vocab),
        "its tokenizer lists 2100 tokens, more than the model's 2048 embeddings")
    add("missing-file", root / "no-such-model.gguf", "file not found")
    two = root / "two-files"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(good.read_bytes())
    add("directory-with-two", two, "holds 2 .gguf files (a.gguf, b.gguf)")
    one_bad = root / "one-bad-file"
    one_bad.mkdir()
    (one_bad / "model.gguf").write_bytes(b"GGUF\x03\x00")
    add("directory-with-a-truncated-one", one_bad, "truncated GGUF file",
        culprit=one_bad / "model.gguf")
    return cases


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)


def _assert_one_line(stderr: str, prefix: str, case: BadInput) -> None:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    failures = [line for line in lines if line.startswith(f"{prefix}{case.culprit}")]
    assert len(failures) == 1, stderr[-3000:]
    assert case.says in failures[0], failures[0]


CONVERTER_CASES = ["garbage", "empty", "truncated", "unknown-architecture", "missing-metadata",
                   "unknown-tensor-type", "more-tokens-than-embeddings", "missing-file",
                   "directory-with-two", "directory-with-a-truncated-one"]


@pytest.mark.parametrize("name", CONVERTER_CASES)
def test_converter_cli_prints_one_line(name, bad_inputs, tmp_path):
    case = bad_inputs[name]
    done = _run(["-m", "checkpoints.gguf", str(case.model),
                 "--cache-dir", str(tmp_path)])
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stdout == ""
    # Nothing else to say: the one line is all of stderr.
    assert [line for line in done.stderr.splitlines() if line.strip()] == [
        line for line in done.stderr.splitlines() if line.startswith(str(case.culprit))]
    _assert_one_line(done.stderr, "", case)


def test_converter_cli_refuses_a_directory_without_gguf(tmp_path):
    done = _run(["-m", "checkpoints.gguf", str(tmp_path)])
    assert done.returncode == 1
    assert done.stderr.strip() == f"{tmp_path}: holds no .gguf file"


@pytest.mark.parametrize("name", ["garbage", "unknown-architecture", "unknown-tensor-type",
                                  "directory-with-two"])
def test_executor_exits_with_one_line(name, bad_inputs, tmp_path):
    case = bad_inputs[name]
    done = _run(["-m", "executor_svc", "--model", str(case.model), "--device", "cpu",
                 "--scheduler-address", "tcp://127.0.0.1:9", "--log-format", "console"])
    assert done.returncode == 1, done.stderr[-3000:]
    _assert_one_line(done.stderr, "executor failed to start: ", case)


@pytest.mark.parametrize("name", ["truncated", "unknown-architecture", "directory-with-two"])
def test_scheduler_resolution_raises_the_converters_line(name, bad_inputs, tmp_path,
                                                         monkeypatch):
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path))  # the converter subprocess's cache
    case = bad_inputs[name]
    with pytest.raises(ModelDirError) as info:
        resolve_model_dir(str(case.model))
    assert str(info.value).startswith(f"{case.culprit}: ") and case.says in str(info.value)


def test_folio_serve_says_which_file(bad_inputs, tmp_path):
    case = bad_inputs["unknown-tensor-type"]
    with run_server(tmp_path, model=case.model, args=["--log-format", "console"],
                    env={"FOLIO_CACHE_DIR": str(tmp_path / "cache")}, wait=False) as server:
        server.proc.wait(timeout=TIMEOUT_S)
        log = server.log_tail(1 << 20)
    assert server.proc.returncode == 1, log[-3000:]
    assert "cannot load the model's tokenizer" in log and case.says in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]

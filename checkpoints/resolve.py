"""Where a `--model` value leads: a local checkpoint directory, one rule for both services.

    a directory (with config.json)       itself
    a .gguf file, or a directory          converted once into a cached checkpoint directory
      holding one and no config.json      (checkpoints/gguf), by `convert_gguf`
    anything else that is not a path      a model hub id, downloaded (`hub_files` only)

The services differ only in the two parameters:
- the executor downloads what it loads (HUB_WEIGHT_FILES) and converts a GGUF file in its own
  process (`convert_in_process`), before its torch import;
- the scheduler downloads config and tokenizer files only (HUB_CONFIG_FILES) and runs the
  converter as a subprocess (`convert_in_subprocess`): the converter's tokenizer step imports
  transformers, which the scheduler keeps out, and a server told to stop must not wait for a
  conversion that can take minutes.

`folio:` names and the default model are resolved before this (named_models.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from checkpoints.files import CheckpointError
from checkpoints.gguf import find_gguf_file, gguf_checkpoint_dir, names_gguf

HUB_WEIGHT_FILES = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt")
HUB_CONFIG_FILES = ("*.json", "FOLIO_RANDOM_WEIGHTS")


class HubDownloadError(ValueError):
    """`--model` is neither a local path nor a model the hub would give; `cause` is the hub
    client's exception (it raises many types: offline, 404, auth, a malformed id)."""

    def __init__(self, model: str, cause: Exception):
        super().__init__(f"--model {model!r} is not a local directory and downloading it from "
                         f"the model hub failed: {type(cause).__name__}: {cause}")
        self.model = model
        self.cause = cause


def convert_in_process(path: Path) -> Path:
    """The checkpoint directory converted from the GGUF model at `path`, converted here (with
    progress bars on a terminal). Errors are CheckpointErrors naming the file."""
    gguf_file = find_gguf_file(path)
    if gguf_file is None:  # names_gguf() said otherwise a moment ago: the file went away
        raise CheckpointError(path, "holds no .gguf file")
    return gguf_checkpoint_dir(gguf_file, progress=sys.stderr.isatty())


def resolve_model_dir(model: str, cache_dir: str | None = None, *,
                      hub_files: Sequence[str] = HUB_WEIGHT_FILES,
                      convert_gguf: Callable[[Path], Path] = convert_in_process) -> Path:
    """The local checkpoint directory behind `model` (see the module docstring). `cache_dir`
    is where hub downloads go (GGUF conversions: $FOLIO_CACHE_DIR). Raises ValueError with a
    sentence for the operator: CheckpointError for a GGUF file at fault, HubDownloadError."""
    path = Path(model).expanduser()
    if names_gguf(path):
        return convert_gguf(path)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"--model {model!r} is a file; give the checkpoint's directory or a "
                         ".gguf file")
    try:
        from huggingface_hub import snapshot_download  # lazy: only for hub ids

        local = snapshot_download(repo_id=model, cache_dir=cache_dir,
                                  allow_patterns=list(hub_files))
    except Exception as e:  # the hub client raises many types (offline, 404, auth, bad id)
        raise HubDownloadError(model, e) from e
    return Path(local)


class ConverterFailed(ValueError):
    """The converter subprocess failed or was cancelled; ``str()`` is its one line,
    ``<file>: <what is wrong>``."""


def convert_in_subprocess(path: Path, cancel: threading.Event | None = None,
                          log_format: str | None = None) -> Path:
    """The checkpoint directory converted from a GGUF model by `python -m checkpoints.gguf` in
    its own process. Its stderr (progress, logs) is passed through; on failure its last line,
    which names the file and the problem, becomes the ConverterFailed. Setting `cancel` ends
    the subprocess and raises ConverterFailed. `log_format` is the caller's (console/json), so
    its log lines read like the caller's; by default console in a terminal (with progress
    bars), json otherwise."""
    # The converter of this installation: the checkpoints package's parent directory.
    root = str(Path(__file__).resolve().parents[1])  # checkpoints/resolve.py
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, "-m", "checkpoints.gguf", str(path.resolve()),
            "--log-format", log_format or ("console" if sys.stderr.isatty() else "json")]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    tail: list[bytes] = []
    forward = threading.Thread(target=_forward_stderr, args=(proc.stderr, tail), daemon=True)
    forward.start()
    try:
        while True:
            try:
                proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if cancel is not None and cancel.is_set():
                    raise ConverterFailed(f"{path}: GGUF conversion cancelled") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        forward.join(timeout=5)
        stdout = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        last = b"".join(tail).decode(errors="replace").strip().splitlines()
        raise ConverterFailed(last[-1] if last else
                              f"{path}: the GGUF converter exited with status {proc.returncode}")
    return Path(lines[-1])


def _forward_stderr(stream, tail: list[bytes]) -> None:
    """Copy the converter's stderr to ours as it comes, keeping the last 4 KiB."""
    out = getattr(sys.stderr, "buffer", None)
    for chunk in iter(lambda: stream.read1(4096), b""):
        if out is not None:
            out.write(chunk)
            out.flush()
        tail.append(chunk)
        while sum(map(len, tail)) > 4096 and len(tail) > 1:
            tail.pop(0)

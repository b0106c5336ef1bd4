"""Where converted GGUF files live, and how two processes share the work.

    <cache>/gguf/<sha256 of the file>/     the converted checkpoint; complete iff MARKER_FILE
    <cache>/gguf/<sha256>.lock             flock held while converting that file
    <cache>/gguf/.<sha256>-XXXX/           a conversion in progress (renamed into place)
    <cache>/gguf/hashes/<key>.json         memo: (absolute path, size, mtime_ns) -> sha256

Keying by content means a renamed or copied file reuses its conversion, and a file replaced in
place (new mtime) is hashed again. A conversion is built in a temp directory and renamed into
place under the lock, so a reader sees either no directory or a complete one, and two processes
converting the same file at once do the work once: the second waits on the lock, then finds the
first one's directory. The cache-hit path only stats the file and reads two small JSON files.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import structlog

from checkpoints.cache_dir import default_cache_dir
from checkpoints.files import CheckpointError
from checkpoints.gguf.convert import CONVERTER_VERSION, MARKER_FILE, convert

log = structlog.get_logger("checkpoints.gguf")

_HASH_CHUNK = 8 << 20


def gguf_cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "gguf"


def is_complete(model_dir: Path) -> bool:
    """The directory holds a finished conversion by this version of the converter."""
    try:
        marker = json.loads((model_dir / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("converter_version") == CONVERTER_VERSION


def file_sha256(path: Path, root: Path) -> str:
    """The file's sha256, memoised by (absolute path, size, mtime_ns) under `root`/hashes."""
    path = path.resolve()
    stat = path.stat()
    memo = root / "hashes" / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")
    key = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    with contextlib.suppress(OSError, ValueError):
        saved = json.loads(memo.read_text(encoding="utf-8"))
        if {k: saved.get(k) for k in key} == key and isinstance(saved.get("sha256"), str):
            return saved["sha256"]
    if stat.st_size > 1 << 30:
        log.info("hashing the GGUF file to find its cache entry (once per file)",
                 file=str(path), gib=round(stat.st_size / 2**30, 1))
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    sha = digest.hexdigest()
    with contextlib.suppress(OSError):  # only a speed-up: a read-only cache still serves
        memo.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(memo, json.dumps({**key, "sha256": sha}) + "\n")
    return sha


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _locked(lock_file: Path, gguf_file: Path) -> Iterator[None]:
    """An exclusive flock on `lock_file` (released when the process dies, too)."""
    with open(lock_file, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is converting this GGUF file; waiting for it",
                     file=str(gguf_file))
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def gguf_checkpoint_dir(gguf_file: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                        progress: bool = False) -> Path:
    """The HF checkpoint directory converted from `gguf_file`, converting it first if the
    cache does not hold it. Raises CheckpointError naming the file for anything wrong with it."""
    gguf_file = Path(gguf_file).expanduser().resolve()
    root = gguf_cache_root(cache_dir)
    try:
        sha = file_sha256(gguf_file, root)
    except FileNotFoundError:
        raise CheckpointError(gguf_file, "file not found") from None
    except IsADirectoryError:
        raise CheckpointError(gguf_file, "is a directory, not a GGUF file") from None
    target = root / sha
    if is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f"{sha}.lock", gguf_file):
        if is_complete(target):  # converted by another process while we waited
            return target
        # Holding the lock, nobody else is writing here: anything left is from a dead
        # conversion (killed mid-way) or an older converter version.
        shutil.rmtree(target, ignore_errors=True)
        for stale in root.glob(f".{sha}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{sha}-", dir=root))
        try:
            convert(gguf_file, tmp, sha, progress)
            tmp.chmod(0o755)  # mkdtemp makes it private; a model cache is meant to be shared
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("GGUF file converted", file=str(gguf_file), model_dir=str(target))
    return target

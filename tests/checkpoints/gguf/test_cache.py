"""The GGUF cache: keyed by content, found again without re-hashing, built once under a lock
when processes race, and never seen half-written."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoints.gguf import gguf_checkpoint_dir
from checkpoints.gguf.cache import is_complete
from tests.fixtures.gguf_files import make_gguf

ROOT = Path(__file__).resolve().parents[3]
CONVERTING = "converting GGUF to a checkpoint"  # the converter's log line when it does the work
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    _, path = make_gguf("qwen2", "Q8_0", tmp_path_factory.mktemp("model"), num_hidden_layers=1)
    return path


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def converter(path: Path, cache: Path, **popen_kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "checkpoints.gguf", str(path), "--cache-dir",
         str(cache), "--log-format", "json"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, text=True, **popen_kwargs)


def run_converter(path: Path, cache: Path) -> tuple[Path, str]:
    proc = converter(path, cache, stderr=subprocess.PIPE)
    stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, stderr[-3000:]
    return Path(stdout.splitlines()[-1]), stderr


def test_second_start_finds_the_cache(gguf_file, tmp_path):
    first, log = run_converter(gguf_file, tmp_path)
    assert log.count(CONVERTING) == 1
    assert first == tmp_path / "gguf" / sha256_of(gguf_file) and is_complete(first)
    marker_mtime = (first / "folio-gguf.json").stat().st_mtime_ns
    second, log = run_converter(gguf_file, tmp_path)
    assert second == first and CONVERTING not in log
    assert (first / "folio-gguf.json").stat().st_mtime_ns == marker_mtime
    # The hash is memoised by path, size and mtime, so that second start read no weights.
    [memo] = (tmp_path / "gguf" / "hashes").iterdir()
    saved = json.loads(memo.read_text())
    assert saved["sha256"] == first.name and saved["path"] == str(gguf_file.resolve())
    assert saved["mtime_ns"] == gguf_file.stat().st_mtime_ns


def test_a_copy_reuses_the_conversion_and_a_changed_file_does_not(gguf_file, tmp_path):
    first = gguf_checkpoint_dir(gguf_file, tmp_path)
    copy = tmp_path / "renamed.gguf"
    shutil.copyfile(gguf_file, copy)
    assert gguf_checkpoint_dir(copy, tmp_path) == first  # keyed by content, not by name
    # Rewritten in place with other content: the memo's mtime no longer matches, so the file
    # is hashed again and gets its own entry.
    _, other = make_gguf("qwen2", "F16", tmp_path / "other", num_hidden_layers=1)
    shutil.copyfile(other, copy)
    os.utime(copy, ns=(time.time_ns(), time.time_ns() + 10**9))
    changed = gguf_checkpoint_dir(copy, tmp_path)
    assert changed != first and changed.name == sha256_of(copy)


def test_leftovers_of_a_killed_conversion_are_replaced(gguf_file, tmp_path):
    root = tmp_path / "gguf"
    sha = sha256_of(gguf_file)
    (root / sha).mkdir(parents=True)
    (root / sha / "config.json").write_text("{}")  # no marker: never finished
    (root / f".{sha}-deadbeef").mkdir()  # the temp dir of a killed converter
    model_dir = gguf_checkpoint_dir(gguf_file, tmp_path)
    assert model_dir == root / sha and is_complete(model_dir)
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "qwen2"
    assert not list(root.glob(".*"))


def test_waits_for_a_conversion_in_progress(gguf_file, tmp_path):
    """Another process holds the file's lock: the converter waits, writes nothing, then finds
    the cache entry the other process made."""
    root = tmp_path / "gguf"
    root.mkdir()
    sha = sha256_of(gguf_file)
    stderr_path = tmp_path / "stderr.log"
    with open(root / f"{sha}.lock", "a") as lock, open(stderr_path, "w") as stderr:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = converter(gguf_file, tmp_path, stderr=stderr)
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while ("another process is converting" not in stderr_path.read_text()
                   and proc.poll() is None and time.monotonic() < deadline):
                time.sleep(0.05)
            assert proc.poll() is None, stderr_path.read_text()
            assert "another process is converting" in stderr_path.read_text()
            assert not (root / sha).exists() and not list(root.glob(f".{sha}-*"))
            # "The other process" finishes: the waiter must take its result as is.
            other = gguf_checkpoint_dir(gguf_file, tmp_path / "elsewhere")
            shutil.copytree(other, root / sha)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
        stdout, _ = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, stderr_path.read_text()
    assert Path(stdout.splitlines()[-1]) == root / sha
    assert CONVERTING not in stderr_path.read_text()


def test_racing_converters_do_the_work_once(gguf_file, tmp_path):
    procs = [converter(gguf_file, tmp_path, stderr=subprocess.PIPE) for _ in range(2)]
    outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outputs]
    dirs = {Path(out.splitlines()[-1]) for out, _ in outputs}
    assert dirs == {tmp_path / "gguf" / sha256_of(gguf_file)}
    assert sum(err.count(CONVERTING) for _, err in outputs) == 1
    assert not list((tmp_path / "gguf").glob(".*"))


def test_the_executor_resolves_a_gguf_and_a_directory_holding_one(gguf_file, tmp_path,
                                                                  monkeypatch):
    from checkpoints.resolve import resolve_model_dir

    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path))
    converted = resolve_model_dir(str(gguf_file))
    assert converted == tmp_path / "gguf" / sha256_of(gguf_file) and is_complete(converted)
    assert resolve_model_dir(str(gguf_file.parent)) == converted  # its only .gguf


def test_an_unwritable_hash_memo_does_not_stop_serving(gguf_file, tmp_path):
    # The memo only saves re-hashing: where it cannot be written (a read-only cache, here a
    # file in the way of its directory, which stops root too), the entry is still served.
    converted = gguf_checkpoint_dir(gguf_file, tmp_path)
    shutil.rmtree(tmp_path / "gguf" / "hashes")
    (tmp_path / "gguf" / "hashes").write_text("in the way")
    assert gguf_checkpoint_dir(gguf_file, tmp_path) == converted

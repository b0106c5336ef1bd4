"""A damaged checkpoint ends each process with one line naming the file, never a traceback.

Every variant in tests/fixtures/corrupt_checkpoints.py is a copy of one small valid checkpoint with one
file damaged. The executor (`python -m executor_svc`) must exit 1 within a bounded time, printing
exactly one `executor failed to start: <file>: <what is wrong>` line; the scheduler's
`Tokenizer(model_dir)` must raise ModelDirError starting with the file's path; and `folio serve`
must say the same without a traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import run_server
from tests.fixtures.checkpoints import make_checkpoint
from tests.fixtures.corrupt_checkpoints import DAMAGES, Damage

ROOT = Path(__file__).resolve().parents[2]
EXIT_TIMEOUT_S = 90.0  # torch import + config/header checks on a busy 2-core machine
PARALLEL_EXECUTORS = 3  # mostly waiting on the torch import; more would only thrash
FAILED_PREFIX = "executor failed to start: "

EXECUTOR_CASES = [d for d in DAMAGES if d.executor]
SCHEDULER_CASES = [d for d in DAMAGES if d.scheduler]


@dataclass
class ExecutorRun:
    returncode: int | None  # None: still running at EXIT_TIMEOUT_S (then killed)
    seconds: float
    stderr: str


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint("llama2", tmp_path_factory.mktemp("good"), num_hidden_layers=1)


@pytest.fixture(scope="module")
def damaged(good_checkpoint, tmp_path_factory):
    """name -> a copy of the good checkpoint with that damage applied."""
    root = tmp_path_factory.mktemp("damaged")
    dirs = {}
    for d in DAMAGES:
        dirs[d.name] = Path(shutil.copytree(good_checkpoint, root / d.name))
        d.apply(dirs[d.name])
    return dirs


def _run_executor(model_dir: Path) -> ExecutorRun:
    # A scheduler address nobody listens on: a wrongly accepted checkpoint would sit in the
    # handshake loop and show up as a timeout, not hang the test.
    cmd = [sys.executable, "-m", "executor_svc", "--model", str(model_dir), "--device", "cpu",
           "--scheduler-address", "tcp://127.0.0.1:9", "--log-format", "console"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=EXIT_TIMEOUT_S)
        return ExecutorRun(proc.returncode, time.monotonic() - start, stderr)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate(timeout=10)
        return ExecutorRun(None, time.monotonic() - start, stderr)


@pytest.fixture(scope="module")
def executor_runs(damaged) -> dict[str, ExecutorRun]:
    """Every executor case run once, a few at a time (each mostly waits on its torch import)."""
    with ThreadPoolExecutor(PARALLEL_EXECUTORS) as pool:
        runs = pool.map(lambda d: (d.name, _run_executor(damaged[d.name])), EXECUTOR_CASES)
        return dict(runs)


def test_the_good_checkpoint_is_good(good_checkpoint):
    """The oracle for every case below: undamaged, both sides load it."""
    import torch

    from executor_svc.loading.loader import load_model
    from scheduler_svc.text.tokenizer import Tokenizer

    assert Tokenizer(good_checkpoint).vocab_size > 0
    load_model(good_checkpoint, dtype=torch.float32, device=torch.device("cpu"), max_model_len=64)


def test_enough_cases_across_the_files():
    files = {d.file for d in DAMAGES}
    assert len(DAMAGES) >= 12
    assert {"config.json", "model.safetensors", "model.safetensors.index.json",
            "tokenizer.json"} <= files


@pytest.mark.parametrize("damage", EXECUTOR_CASES, ids=lambda d: d.name)
def test_executor_exits_with_one_line_naming_the_file(damage: Damage, damaged, executor_runs):
    run = executor_runs[damage.name]
    path = damaged[damage.name] / damage.file
    assert run.returncode is not None, (
        f"executor still running after {EXIT_TIMEOUT_S:g}s: the damage went unnoticed\n"
        f"{run.stderr[-2000:]}")
    assert run.returncode == 1, run.stderr[-2000:]
    assert "Traceback" not in run.stderr, run.stderr[-4000:]
    lines = [line for line in run.stderr.splitlines() if "executor failed to start" in line]
    assert len(lines) == 1, run.stderr[-2000:]
    assert lines[0].startswith(f"{FAILED_PREFIX}{path}: "), lines[0]
    assert len(lines[0]) > len(f"{FAILED_PREFIX}{path}: ") + 10  # says what is wrong


@pytest.mark.parametrize("damage", SCHEDULER_CASES, ids=lambda d: d.name)
def test_scheduler_tokenizer_raises_naming_the_file(damage: Damage, damaged):
    from scheduler_svc.text.tokenizer import ModelDirError, Tokenizer

    path = damaged[damage.name] / damage.file
    with pytest.raises(ModelDirError) as info:
        Tokenizer(damaged[damage.name])
    assert str(info.value).startswith(f"{path}: "), str(info.value)


def _log_after(server, text: str, timeout: float, settle_s: float = 5.0) -> str:
    """The server's log once `text` is in it (or the server exited, or `timeout` passed), plus
    what it wrote in the next `settle_s` seconds or until it exited: a traceback printed while
    reacting to the failure must be seen too."""
    deadline = time.monotonic() + timeout
    while (time.monotonic() < deadline and server.proc.poll() is None
           and text not in server.log_tail(1 << 20)):
        time.sleep(0.2)
    settle_end = time.monotonic() + settle_s
    while time.monotonic() < settle_end and server.proc.poll() is None:
        time.sleep(0.2)
    return server.log_tail(1 << 20)


@pytest.mark.parametrize("name, expected", [
    # The scheduler refuses before it spawns anything.
    ("tokenizer-garbage", "cannot load the model's tokenizer"),
    # The scheduler is happy; its executor child is not.
    ("weights-truncated", FAILED_PREFIX),
])
def test_folio_serve_says_which_file(name, expected, damaged, tmp_path):
    damage = next(d for d in DAMAGES if d.name == name)
    path = str(damaged[name] / damage.file)
    with run_server(tmp_path, model=damaged[name], args=["--log-format", "console"],
                    env={"OMP_NUM_THREADS": "1"}, wait=False) as server:
        log = _log_after(server, expected, EXIT_TIMEOUT_S)
    assert expected in log and path in log, log[-4000:]
    assert "Traceback" not in log, log[-4000:]

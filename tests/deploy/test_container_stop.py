"""`podman stop` ends a containerised executor (PID 1 of its container) well before the 10 s
SIGKILL fallback. Needs podman and the image built as docs/containers.md describes; skipped
otherwise. Run with `pytest -m slow tests/deploy/test_container_stop.py`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest

from tests.fixtures.checkpoints import make_checkpoint

IMAGE = os.environ.get("FOLIO_IMAGE", "localhost/folio:cpu")
STOP_BUDGET_S = 2.0  # podman's own default timeout before SIGKILL is 10 s
START_TIMEOUT_S = 120.0

pytestmark = pytest.mark.slow


def _podman(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)


def _image_present() -> bool:
    if shutil.which("podman") is None:
        return False
    try:
        return _podman("image", "exists", IMAGE).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _image_present(), reason=f"needs podman and the image {IMAGE} "
                                                 "(see docs/containers.md)")
def test_podman_stop_ends_the_executor_within_two_seconds(tmp_path):
    model_dir = make_checkpoint("llama2", tmp_path / "tiny", num_hidden_layers=1)
    for path in [model_dir, *model_dir.iterdir()]:  # the image runs as uid 1000
        path.chmod(0o755 if path.is_dir() else 0o644)
    name = f"folio-stop-test-{uuid.uuid4().hex[:8]}"
    # No network: nothing answers the Hello, so the executor sits in its handshake loop.
    started = _podman("run", "-d", "--name", name, "--network", "none",
                      "-v", f"{model_dir}:/models/tiny:ro", IMAGE,
                      "executor", "--model", "/models/tiny", "--device", "cpu",
                      "--scheduler-address", "tcp://127.0.0.1:9", "--num-kv-blocks", "16",
                      "--log-format", "console")
    assert started.returncode == 0, started.stderr
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        logs = ""
        while "hello sent" not in logs and time.monotonic() < deadline:
            time.sleep(0.5)
            logs = _podman("logs", name).stderr
        assert "hello sent" in logs, logs[-3000:]
        assert "pid=1 " in logs  # the executor is the container's PID 1

        start = time.monotonic()
        stopped = _podman("stop", name)
        took = time.monotonic() - start
        assert stopped.returncode == 0, stopped.stderr
        exit_code = _podman("inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip()
        logs = _podman("logs", name).stderr
        assert took < STOP_BUDGET_S, f"podman stop took {took:.1f}s"
        assert exit_code == "0", logs[-3000:]  # 137 would mean SIGKILL
        assert "shutdown requested by signal" in logs and "reason=SIGTERM" in logs
    finally:
        _podman("rm", "-f", name)

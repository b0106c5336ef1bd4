"""The executor ends promptly on SIGTERM/SIGINT in every phase, and when its parent is gone.

Real executor processes on the CPU. A phase is reached by waiting for the log line that starts
it, then the signal is sent at once; the log afterwards shows which phase it interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from protos.channel import PeerLost, SchedulerEnd
from protos.plan import PROTOCOL_VERSION, Hello, StepResult, Welcome
from tests.executor.harness import PlanDriver
from tests.fixtures.checkpoints import make_checkpoint

# Each test starts a real executor process.
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
STOP_BUDGET_S = 2.0  # from the signal to the process being gone
START_TIMEOUT_S = 120.0  # torch import + model load on a busy 2-core machine
BLOCK_SIZE = 4  # PlanDriver's
NUM_BLOCKS = 160
LONG_PROMPT = 400  # tokens: a prefill long enough to be interrupted in the middle
SHUTDOWN_LINE = "shutdown requested by signal"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """Wide enough (~250 MB of fp32 weights) that loading takes a while to interrupt, and a
    400-token prefill is a step long enough to land a signal in."""
    return make_checkpoint("llama2", tmp_path_factory.mktemp("lifecycle"), hidden_size=512,
                           intermediate_size=2048, num_hidden_layers=16,
                           num_attention_heads=8, num_key_value_heads=2)


class Executor:
    """An executor process; a thread collects its stderr so a test can wait for a log line."""

    def __init__(self, argv: list[str], prefix: tuple[str, ...] = ()):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        cmd = [*prefix, sys.executable, "-m", "executor_svc", "--device", "cpu",
               "--log-format", "console", *argv]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self._lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self._cond:
                self._lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._lines.append("")  # EOF marker: nothing more will come
            self._cond.notify_all()

    @property
    def log(self) -> str:
        with self._cond:
            return "".join(self._lines)

    def wait_for(self, text: str, timeout: float = START_TIMEOUT_S) -> None:
        def seen() -> bool:
            return any(text in line for line in self._lines) or self._lines[-1:] == [""]
        with self._cond:
            self._cond.wait_for(seen, timeout)
        assert text in self.log, f"no {text!r} in the executor's log:\n{self.log[-3000:]}"

    def wait_gone(self, pid: int | None = None, timeout: float = STOP_BUDGET_S) -> float:
        """Seconds until `pid` (the executor by default) is gone; fails past `timeout`."""
        start = time.monotonic()
        if pid is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        else:
            while _alive(pid) and time.monotonic() - start < timeout:
                time.sleep(0.02)
        took = time.monotonic() - start
        assert not _alive(pid or self.proc.pid), (
            f"still running {timeout:g}s after the signal; log:\n{self.log[-3000:]}")
        return took

    def stop_with(self, sig: int) -> float:
        self.proc.send_signal(sig)
        return self.wait_gone()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _executor(model_dir: Path, address: str = "tcp://127.0.0.1:9", *extra: str,
              prefix: tuple[str, ...] = ()) -> Executor:
    # Port 9 (discard) has no listener: the executor stays in its handshake loop.
    return Executor(["--model", str(model_dir), "--scheduler-address", address,
                     "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_BLOCKS),
                     *extra], prefix)


def _assert_clean_exit(ex: Executor, took: float, reason: str) -> None:
    assert took < STOP_BUDGET_S
    assert ex.proc.returncode == 0, ex.log[-3000:]
    assert f"{SHUTDOWN_LINE}" in ex.log and f"reason={reason}" in ex.log, ex.log[-3000:]
    assert "Traceback" not in ex.log, ex.log[-3000:]


SIGNALS = [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGINT, id="SIGINT")]


@pytest.mark.parametrize("sig", SIGNALS)
def test_signal_while_importing_torch(model_dir, sig):
    ex = _executor(model_dir)
    try:
        ex.wait_for("executor starting")  # handlers are in place; torch is not imported yet
        took = ex.stop_with(sig)
        _assert_clean_exit(ex, took, sig.name)
        assert "loading model" not in ex.log
    finally:
        ex.kill()


@pytest.mark.parametrize("sig", SIGNALS)
def test_signal_while_loading_the_model(model_dir, sig):
    ex = _executor(model_dir)
    try:
        ex.wait_for("loading model")
        took = ex.stop_with(sig)
        _assert_clean_exit(ex, took, sig.name)
        assert "model loaded" not in ex.log
    finally:
        ex.kill()


@pytest.mark.parametrize("sig", SIGNALS)
def test_signal_in_the_handshake_loop(model_dir, sig):
    ex = _executor(model_dir)
    try:
        ex.wait_for("waiting for the scheduler")
        took = ex.stop_with(sig)
        _assert_clean_exit(ex, took, sig.name)
    finally:
        ex.kill()


async def _welcomed(sched: SchedulerEnd, ex: Executor) -> bytes:
    peer, hello = await asyncio.wait_for(sched.recv(), START_TIMEOUT_S)
    assert isinstance(hello, Hello)
    await sched.send(peer, Welcome(protocol_version=PROTOCOL_VERSION))
    await asyncio.to_thread(ex.wait_for, "welcomed by the scheduler")
    return peer


@pytest.mark.parametrize("sig", SIGNALS)
async def test_signal_while_connected_and_idle(model_dir, sig):
    sched = SchedulerEnd("tcp://127.0.0.1:0")
    ex = _executor(model_dir, sched.address)
    try:
        await _welcomed(sched, ex)
        took = await asyncio.to_thread(ex.stop_with, sig)
        _assert_clean_exit(ex, took, sig.name)
    finally:
        ex.kill()
        sched.close()


async def test_sigterm_in_the_middle_of_a_step(model_dir):
    sched = SchedulerEnd("tcp://127.0.0.1:0")
    ex = _executor(model_dir, sched.address)
    try:
        peer = await _welcomed(sched, ex)
        driver = PlanDriver(num_blocks=NUM_BLOCKS)
        # One short step first: it measures how long a step of this model takes here.
        await sched.send(peer, driver.plan(new_reqs=[driver.new("warm", [1, 2, 3], 3)]))
        _, result = await asyncio.wait_for(sched.recv(), 60)
        assert isinstance(result, StepResult)
        prompt = [(7 * i) % 300 + 3 for i in range(LONG_PROMPT)]
        await sched.send(peer, driver.plan(new_reqs=[driver.new("long", prompt, LONG_PROMPT)]))
        await asyncio.sleep(0.05)
        took = await asyncio.to_thread(ex.stop_with, signal.SIGTERM)
        _assert_clean_exit(ex, took, "SIGTERM")
        # The step code's `except Exception` did not catch the shutdown: no step failed, and
        # the long step's result never came.
        assert "step failed" not in ex.log
        event = await asyncio.wait_for(sched.recv(), 10)
        assert event == PeerLost(identity=peer), event  # its connection closed, nothing was sent
    finally:
        ex.kill()
        sched.close()


def test_a_long_c_call_is_cut_short_by_the_watchdog():
    """The main thread inside one multi-second torch op (the GIL released) cannot run the
    Python handler; the watchdog thread ends the process within the budget instead."""
    script = (
        "import torch\n"
        "from executor_svc.lifecycle import Lifecycle\n"
        "torch.set_num_threads(1)\n"
        "a = torch.randn(6000, 6000)\n"  # 0.4 TFLOP: seconds on one core
        "Lifecycle().install()\n"
        "print('ready', flush=True)\n"
        "torch.mm(a, a)\n"
        "print('finished', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.monotonic() - start
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0 and took < STOP_BUDGET_S, (took, err)
        assert "did not stop within" in err and "finished" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


PARENT = """
import os, subprocess, sys, time
cmd = [sys.executable, "-m", "executor_svc", *sys.argv[1:], "--parent-pid", str(os.getpid())]
child = subprocess.Popen(cmd, stderr=open(os.environ["EXECUTOR_LOG"], "w"))
print(child.pid, flush=True)
time.sleep(600)
"""


def test_executor_exits_when_its_parent_is_killed(model_dir, tmp_path):
    log_path = tmp_path / "executor.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "EXECUTOR_LOG": str(log_path)}
    argv = ["--model", str(model_dir), "--device", "cpu", "--scheduler-address",
            "tcp://127.0.0.1:9", "--num-kv-blocks", "16", "--log-format", "console"]
    parent = subprocess.Popen([sys.executable, "-c", PARENT, *argv], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, text=True)
    executor_pid = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while ("waiting for the scheduler" not in log_path.read_text()
               and time.monotonic() < deadline):
            assert _alive(executor_pid), log_path.read_text()[-3000:]
            time.sleep(0.1)
        parent.kill()
        parent.wait(timeout=10)
        start = time.monotonic()
        while _alive(executor_pid) and time.monotonic() - start < STOP_BUDGET_S:
            time.sleep(0.02)
        log = log_path.read_text()
        assert not _alive(executor_pid), f"orphaned executor still running; log:\n{log[-3000:]}"
        assert f"reason='parent process {parent.pid} exited'" in log, log[-3000:]
    finally:
        parent.kill()
        with contextlib.suppress(ProcessLookupError):
            if _alive(executor_pid):
                os.kill(executor_pid, signal.SIGKILL)


def test_parent_that_is_not_the_direct_parent(model_dir):
    """--parent-pid of a process that did not start the executor: the watcher thread polls it
    (here it lingers as an unreaped zombie after SIGKILL, which counts as gone)."""
    other = subprocess.Popen(["sleep", "600"])
    ex = _executor(model_dir, "tcp://127.0.0.1:9", "--parent-pid", str(other.pid))
    try:
        ex.wait_for("waiting for the scheduler")
        other.kill()  # not waited for: a zombie until the end of the test
        took = ex.wait_gone()
        _assert_clean_exit(ex, took, f"'parent process {other.pid} exited'")
    finally:
        ex.kill()
        other.kill()
        other.wait(timeout=10)


def test_parent_gone_before_the_executor_started(model_dir):
    """The parent died before prctl could be armed: noticed at once, before the model load."""
    gone = subprocess.Popen(["true"])
    gone.wait(timeout=10)
    ex = _executor(model_dir, "tcp://127.0.0.1:9", "--parent-pid", str(gone.pid))
    try:
        ex.wait_gone(timeout=START_TIMEOUT_S)
        _assert_clean_exit(ex, 0.0, f"'parent process {gone.pid} exited'")
        assert "loading model" not in ex.log
    finally:
        ex.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
@pytest.mark.parametrize("direct", [True, False])
def test_parent_death_signal_is_set_for_a_direct_parent(direct):
    """The kernel-side half of --parent-pid: PR_SET_PDEATHSIG, read back with PR_GET."""
    script = (
        "import ctypes, os, sys\n"
        "from executor_svc.lifecycle import Lifecycle\n"
        "Lifecycle(os.getppid() if sys.argv[1] == 'direct' else 1).install()\n"
        "value = ctypes.c_int(-1)\n"
        "ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0)\n"  # PR_GET_PDEATHSIG
        "print(value.value)\n")
    out = subprocess.run([sys.executable, "-c", script, "direct" if direct else "other"],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == (signal.SIGUSR2 if direct else 0)


# A new PID namespace whose PID 1 is the command; --kill-child takes it down with unshare.
UNSHARE = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run([*UNSHARE, "true"],
                          capture_output=True, timeout=30)
    return done.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare --pid (root or user namespaces)")
def test_sigterm_as_pid_1_of_a_pid_namespace(model_dir):
    """As in a container: PID 1 gets no default signal action, only what it handles."""
    # The control: a process without a SIGTERM handler ignores it as PID 1.
    control = subprocess.Popen([*UNSHARE, "sleep", "600"])
    try:
        sleeper = _wait_child(control.pid)
        os.kill(sleeper, signal.SIGTERM)
        time.sleep(1.0)
        assert _alive(sleeper), "sleep as PID 1 died of SIGTERM: not a PID namespace's init?"
    finally:
        control.kill()  # --kill-child: PID 1 of the namespace goes with it
        control.wait(timeout=10)
    ex = _executor(model_dir, prefix=UNSHARE)
    try:
        ex.wait_for("waiting for the scheduler")
        executor_pid = _wait_child(ex.proc.pid)
        os.kill(executor_pid, signal.SIGTERM)
        took = ex.wait_gone()  # unshare exits with its child's status
        _assert_clean_exit(ex, took, "SIGTERM")
        assert "pid=1 " in ex.log  # the "executor starting" line, seen from inside
    finally:
        ex.kill()


def _wait_child(pid: int, timeout: float = 10.0) -> int:
    """The only child of `pid` (unshare --fork's), by /proc."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if kids:
                return int(kids[0])
        time.sleep(0.02)
    raise TimeoutError(f"process {pid} started no child")


def test_parent_pid_must_be_a_pid(capsys):
    from executor_svc.cli import main

    assert main(["--model", "m", "--parent-pid", "0"]) == 2
    assert "--parent-pid must be a process id" in capsys.readouterr().err

"""Shared fixtures: the default model in a private cache, and real Folio servers.

`folio_server(...)` starts the real serve mode (`scheduler_svc.cli.main(argv,
spawn_executor=True)`: scheduler process + executor child) on 127.0.0.1 with free ports, waits
until health says SERVING (the executor has shaken hands), yields a `Server`, and in `finally`
ends the process tree it started, by pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY_RANDOM = "folio:tiny-random"  # checkpoints.named_models
SERVER_START_TIMEOUT_S = 180.0  # model load + torch import on a busy 2-core machine
SERVER_STOP_TIMEOUT_S = 20.0
STALL_LINE = "request stalled: ended by the watchdog"  # scheduler_svc/engine/watchdog.py's ERROR

SERVE = "import sys; from scheduler_svc.cli import main; sys.exit(main(sys.argv[1:], spawn_executor=True))"


@dataclass
class Server:
    address: str  # host:port of the gRPC API
    proc: subprocess.Popen
    log_path: Path
    executor_address: str  # the ZeroMQ endpoint the scheduler binds

    def log_tail(self, num_chars: int | None = 6000) -> str:
        """The log's last `num_chars` characters (None: all of it)."""
        try:
            text = self.log_path.read_text(errors="replace")
            return text[-num_chars:] if num_chars else text
        except OSError:
            return ""


def _isa_line() -> str:
    """The run's ISA: the CPU's, torch's (and whether ATEN_CPU_CAPABILITY forced it lower),
    the fused kernels' build (asked of the build when cached), and native bf16."""
    try:
        from kernels import cpu, cpu_ext

        native = "yes" if cpu.has_native_bf16() else "no"
        return f"folio isa: {cpu_ext.describe()}; native bf16: {native}"
    except Exception as e:  # the line never stops a run; a broken import fails the tests
        return f"folio isa: unknown ({type(e).__name__}: {e})"


E2E_DIR = ROOT / "tests" / "e2e"
# Fixtures that start real Folio processes (`folio serve`, an executor).
SERVER_FIXTURES = {"folio_server", "default_server", "folio_executor"}


def pytest_collection_modifyitems(config, items) -> None:
    """`e2e`: a test that runs real server processes. Everything under tests/e2e/ is, and so is
    any test that takes a server fixture; tests elsewhere that start processes themselves carry
    the mark in their module. `make test-fast` deselects them."""
    for item in items:
        if E2E_DIR in item.path.parents or SERVER_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.e2e)


def pytest_report_header(config) -> list[str]:
    return [_isa_line()]


def pytest_terminal_summary(terminalreporter) -> None:
    """Again at the end, where `pytest -q` (make test, CI) shows it: the header it hides."""
    if terminalreporter.verbosity < 0:
        terminalreporter.write_line(_isa_line())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Child pids, recursively, read from /proc (Linux); empty where /proc is not there."""
    found: list[int] = []
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            found.extend(kids)
            stack.extend(kids)
    return found


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def stop_process_tree(proc: subprocess.Popen, timeout: float = SERVER_STOP_TIMEOUT_S) -> None:
    """SIGTERM the server (it shuts its executor down), then SIGKILL whatever is left."""
    kids = _descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    deadline = time.monotonic() + 5.0
    for pid in kids:  # the server should have ended these already
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.05)
        _signal(pid, signal.SIGKILL)
    # The server leads its own process group (start_new_session): this also reaches children
    # orphaned by a server that crashed before we could list them.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def wait_serving(server: Server, timeout: float) -> None:
    """Poll grpc health until SERVING; fail early with the log if the server died."""
    from client import FolioClient

    deadline = time.monotonic() + timeout
    last = "no answer"
    with FolioClient(server.address) as client:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(f"server exited with {server.proc.returncode} before "
                                   f"SERVING; log:\n{server.log_tail()}")
            try:
                last = client.health(timeout=2.0)
                if last == "SERVING":
                    return
            except Exception as e:  # grpc.RpcError while the port is not open yet
                last = repr(e)[:200]
            time.sleep(0.2)
    raise TimeoutError(f"server not SERVING after {timeout:g}s ({last}); log:\n"
                       f"{server.log_tail()}")


def _popen(argv: list[str], log_path: Path, env: dict[str, str] | None) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    with open(log_path, "wb") as log:
        # A new session makes the child lead its own process group (see stop_process_tree).
        return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=full_env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


@contextlib.contextmanager
def run_server(log_dir: Path, model: str | Path | None = None, args: list[str] | tuple = (),
               env: dict[str, str] | None = None, wait: bool = True,
               spawn_executor: bool = True,
               start_timeout: float = SERVER_START_TIMEOUT_S, port: int | None = None,
               executor_address: str | None = None) -> Iterator[Server]:
    """`folio serve` (spawn_executor=True) or the scheduler alone, on free local ports (or
    the given ones: a restarted scheduler reuses its predecessor's)."""
    port = port or free_port()
    executor_address = executor_address or f"tcp://127.0.0.1:{free_port()}"
    argv = ["--host", "127.0.0.1", "--port", str(port),
            "--executor-address", executor_address, *args]
    if model is not None:
        argv = ["--model", str(model), *argv]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{port}.log"
    code = SERVE if spawn_executor else SERVE.replace("spawn_executor=True", "spawn_executor=False")
    proc = _popen(["-c", code, *argv], log_path, env)
    server = Server(f"127.0.0.1:{port}", proc, log_path, executor_address)
    try:
        if wait:
            wait_serving(server, start_timeout)
        yield server
    finally:
        stop_process_tree(proc)
    # The stall watchdog (scheduler_svc/engine/watchdog.py) catches server bugs: it never fires here.
    assert STALL_LINE not in server.log_tail(num_chars=None), \
        f"the stall watchdog ended a request; log:\n{server.log_tail()}"


@contextlib.contextmanager
def run_executor(log_dir: Path, model: str | Path, scheduler_address: str,
                 args: list[str] | tuple = (), env: dict[str, str] | None = None
                 ) -> Iterator[subprocess.Popen]:
    """A standalone executor (`python -m executor_svc`) connecting to `scheduler_address`;
    its output goes to `proc.log_path`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"executor-{free_port()}.log"
    proc = _popen(["-m", "executor_svc", "--model", str(model), "--scheduler-address",
                   scheduler_address, *args], log_path, env)
    proc.log_path = log_path
    try:
        yield proc
    finally:
        stop_process_tree(proc)


@pytest.fixture(scope="session")
def folio_cache_dir(tmp_path_factory) -> Path:
    """A private FOLIO_CACHE_DIR so tests never write to ~/.cache."""
    return tmp_path_factory.mktemp("folio-cache")


@pytest.fixture(scope="session")
def default_model_dir(folio_cache_dir) -> Path:
    from checkpoints.tiny_random import tiny_random_dir as build

    return build(folio_cache_dir)


@pytest.fixture(scope="session")
def folio_server(tmp_path_factory, folio_cache_dir):
    """Factory: `with folio_server(model=dir, args=[...]) as server: ...`; model=None serves
    Folio's default model (SmolLM2, converted into the private cache), "folio:tiny-random" the
    tiny random-weight one."""
    log_dir = tmp_path_factory.mktemp("server-logs")

    from kernels.cpu_ext import build_dir

    # The fused CPU kernels' builds (make install's, by default) are shared, not rebuilt in
    # every private cache.
    ext_dir = str(build_dir())

    def start(model=None, args=(), env=None, **kwargs):
        env = {"FOLIO_CACHE_DIR": str(folio_cache_dir), "FOLIO_CPU_EXT_DIR": ext_dir,
               **(env or {})}
        return run_server(log_dir, model=model, args=args, env=env, **kwargs)

    return start


@pytest.fixture(scope="session")
def folio_executor(tmp_path_factory):
    """Factory: `with folio_executor(model, scheduler_address) as proc: ...`."""
    log_dir = tmp_path_factory.mktemp("executor-logs")

    def start(model, scheduler_address, args=(), env=None):
        return run_executor(log_dir, model, scheduler_address, args, env)

    return start


@pytest.fixture(scope="session")
def default_server(folio_server, default_model_dir) -> Iterator[Server]:
    """One `folio serve --model folio:tiny-random` (the tiny random-weight model, from the
    private cache that default_model_dir already filled), shared by the whole session: tests
    that need a server but no particular model use it, for its small shapes."""
    with folio_server(model=TINY_RANDOM) as server:
        yield server

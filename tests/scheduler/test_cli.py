"""`python -m scheduler_svc` as a real process: serving with a null-model executor, clean
shutdown on SIGTERM, and start-up errors that explain themselves."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.folio.v1 import generator_pb2 as pb
from protos.folio.v1 import generator_pb2_grpc as pb_grpc
from tests.scheduler.null_executor import NullExecutor

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(90)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_scheduler(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "scheduler_svc", *args], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def wait_serving(address: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError("scheduler never became SERVING")


def test_serves_a_null_executor_and_stops_on_sigterm(tiny_model_dir):
    port, executor_address = free_port(), f"tcp://127.0.0.1:{free_port()}"
    proc = start_scheduler(["--model", str(tiny_model_dir), "--port", str(port),
                            "--executor-address", executor_address, "--log-format", "json"])
    executor = NullExecutor(executor_address)
    try:
        executor.start()
        wait_serving(f"127.0.0.1:{port}", proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            responses = list(pb_grpc.GeneratorStub(channel).Generate(pb.GenerateRequest(
                text="hello world", sampling=pb.SamplingParams(max_tokens=3)), timeout=20))
        assert sum(len(r.token_ids) for r in responses) == 3
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
        assert proc.returncode == 0, stderr
        executor.join(timeout=10)
        # A scheduler run alone leaves its executor running (it reconnects to the next one);
        # the executor sees the connection go.
        assert executor.lost_scheduler and not executor.got_shutdown
        assert '"service": "scheduler"' in stderr and "hello world" not in stderr
    finally:
        stop(proc)
        executor.stop()


def test_an_unknown_model_name_is_explained():
    proc = start_scheduler(["--model", "folio:nope", "--port", str(free_port())])
    try:
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 1
        assert "unknown model name 'folio:nope'" in stderr and "folio:tiny-random" in stderr
    finally:
        stop(proc)


def test_busy_grpc_port_is_explained(tiny_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = start_scheduler(["--model", str(tiny_model_dir), "--port", str(port),
                                "--executor-address", f"tcp://127.0.0.1:{free_port()}"])
        try:
            _, stderr = proc.communicate(timeout=60)
            assert proc.returncode == 1
            assert "cannot start the gRPC server" in stderr
        finally:
            stop(proc)

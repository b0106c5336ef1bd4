"""compose.yaml as a deployment: the static shape of the file (always), and the real thing under
podman (marked slow): `pytest -m slow tests/deploy/test_compose.py`, with podman, podman-compose and
the images `folio:latest` and `folio-gateway:latest` built as docs/containers.md describes
(skipped otherwise). FOLIO_COMPOSE_MODEL picks the replicas' model (default folio:tiny-random;
empty: the image's default model)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
IMAGES = ["localhost/folio:latest", "localhost/folio-gateway:latest"]
UP_TIMEOUT_S = 900.0  # a cold start converts the default model once per volume
WORKER_CONTRACT = "vllm.grpc.engine.VllmEngine"


def _services(include_profiles: bool = False) -> dict:
    """The services plain `up` starts (none of a profile's, such as `monitoring`), or all."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return {n: s for n, s in services.items() if include_profiles or not s.get("profiles")}


def _role(service: dict) -> str:
    command = service.get("command") or []
    return command[0] if command else ""


def test_compose_validates_against_the_compose_spec():
    if importlib.util.find_spec("check_jsonschema") is None:
        pytest.skip("needs check-jsonschema (a test extra)")
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                          str(COMPOSE)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_compose_shape():
    services = _services()
    schedulers = {n for n, s in services.items() if _role(s) == "scheduler"}
    executors = {n: s for n, s in services.items() if _role(s) == "executor"}
    gateway = services["gateway"]
    assert len(schedulers) >= 2 and len(executors) == len(schedulers)
    # Each executor serves its own scheduler; the gateway routes to every scheduler.
    targets = {re.search(r"--scheduler-address=tcp://([\w-]+):5557", " ".join(s["command"]))[1]
               for s in executors.values()}
    assert targets == schedulers
    assert gateway["command"][0] == "launch" and gateway["image"].startswith("folio-gateway")
    # No model files in the gateway: it takes the tokenizer from the workers (GetTokenizer).
    assert "volumes" not in gateway and "--model-path" not in " ".join(gateway["command"])
    urls = gateway["command"][gateway["command"].index("--worker-urls") + 1:]
    assert {u.removeprefix("grpc://").removesuffix(":50051") for u in urls
            if u.startswith("grpc://")} == schedulers
    # Only the OpenAI API is published, on loopback unless told otherwise.
    assert [n for n, s in services.items() if s.get("ports")] == ["gateway"]
    assert gateway["ports"] == ["${FOLIO_OPENAI_PUBLISH:-127.0.0.1:8000}:8000"]
    for name, service in services.items():
        # Ordering only: podman-compose ignores depends_on conditions.
        assert isinstance(service.get("depends_on", []), list), name
        if name in schedulers or name == "gateway":
            assert service["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
    # The CPU build of torch unless asked otherwise.
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG TORCH_VARIANT=cpu" in dockerfile and "constraints-cpu.txt" in dockerfile


def _podman(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)


def _can_run() -> str | None:
    for tool in ("podman", "podman-compose"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    for image in IMAGES:
        if _podman("image", "exists", image).returncode != 0:
            return f"needs the image {image} (see docs/containers.md)"
    return None


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


class Deployment:
    def __init__(self, project: str, port: int):
        self.project, self.port = project, port
        self.base_url = f"http://127.0.0.1:{port}"

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def compose(self, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess:
        env = {**os.environ, "FOLIO_OPENAI_PUBLISH": f"127.0.0.1:{self.port}"}
        model = os.environ.get("FOLIO_COMPOSE_MODEL", "folio:tiny-random")
        if model:
            env["FOLIO_MODEL"] = model
        else:
            env.pop("FOLIO_MODEL", None)
        return subprocess.run(["nice", "-n", "19", "podman-compose", "-p", self.project,
                               "-f", str(COMPOSE), *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)

    def healthy(self, service: str) -> bool:
        return _podman("healthcheck", "run", self.container(service)).returncode == 0

    def logs(self, service: str) -> str:
        done = _podman("logs", self.container(service))
        return done.stdout + done.stderr


@pytest.fixture(scope="module")
def deployment():
    reason = _can_run()
    if reason:
        pytest.skip(reason)
    dep = Deployment(f"folio-test-{uuid.uuid4().hex[:8]}", free_port())
    try:
        # Named: podman-compose 1.0.3 ignores `profiles` and would start the monitoring ones.
        up = dep.compose("up", "-d", *_services())
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        # podman runs healthchecks from systemd timers; without systemd, run them here.
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not all(dep.healthy(s) for s in ("scheduler-1", "scheduler-2")):
            assert time.monotonic() < deadline, (dep.logs("scheduler-1")[-3000:]
                                                 + dep.logs("executor-1")[-3000:])
            time.sleep(2)
        yield dep
    finally:
        dep.compose("down", "-v", timeout=300)
        # podman-compose 1.0.3's `down` leaves the network, and `-v` may leave the volumes.
        _podman("network", "rm", "-f", f"{dep.project}_default")
        _podman("volume", "rm", "-f", f"{dep.project}_models", f"{dep.project}_secrets")


@pytest.mark.slow
def test_replicas_serve_and_only_the_api_is_published(deployment):
    for service in ("scheduler-1", "scheduler-2", "executor-1", "executor-2"):
        assert _podman("port", deployment.container(service)).stdout.strip() == "", service
    published = _podman("port", deployment.container("gateway")).stdout.strip()
    assert published == f"8000/tcp -> 127.0.0.1:{deployment.port}"
    # One channel secret for every service, written by whichever started first.
    logs = [deployment.logs(s) for s in ("scheduler-1", "scheduler-2", "executor-1",
                                         "executor-2")]
    assert sum(log.count("wrote a new channel secret") for log in logs) == 1
    for executor in ("executor-1", "executor-2"):
        assert "welcomed by the scheduler" in deployment.logs(executor)
    # Each replica answers Folio's own API inside the compose network.
    for scheduler in ("scheduler-1", "scheduler-2"):
        done = _podman("exec", deployment.container(scheduler), "folio", "generate",
                       "--address", "127.0.0.1:50051", "--max-tokens", "4", "--temperature",
                       "0", "--ignore-eos", "--json", "Hello")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["usage"]["completion_tokens"] == 4


@pytest.mark.slow
def test_the_gateway_starts(deployment):
    deadline = time.monotonic() + 120
    while _http_status(f"{deployment.base_url}/liveness") != 200:
        assert time.monotonic() < deadline, deployment.logs("gateway")[-3000:]
        time.sleep(1)
    assert "smg" in _podman("exec", deployment.container("gateway"), "smg", "--version").stdout


def _services_of_a_replica(deployment) -> list[str]:
    code = ("import grpc; from grpc_reflection.v1alpha import reflection_pb2 as r, "
            "reflection_pb2_grpc as g; "
            "c = grpc.insecure_channel('127.0.0.1:50051'); "
            "resp = next(g.ServerReflectionStub(c).ServerReflectionInfo(iter("
            "[r.ServerReflectionRequest(list_services='')]), timeout=10)); "
            "print(' '.join(s.name for s in resp.list_services_response.service))")
    done = _podman("exec", deployment.container("scheduler-1"), "python", "-c", code)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.slow
def test_openai_chat_through_the_gateway(deployment):
    # The gateway speaks only the worker contract to the replicas (listed by reflection).
    assert WORKER_CONTRACT in _services_of_a_replica(deployment)
    from openai import OpenAI

    deadline = time.monotonic() + 300
    while _http_status(f"{deployment.base_url}/readiness") != 200:
        assert time.monotonic() < deadline, deployment.logs("gateway")[-3000:]
        time.sleep(2)
    assert deployment.healthy("gateway")
    client = OpenAI(base_url=f"{deployment.base_url}/v1", api_key="unused", timeout=120)
    deadline = time.monotonic() + 120
    while not (models := [m.id for m in client.models.list()]):
        assert time.monotonic() < deadline
        time.sleep(2)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=models[0], messages=messages, max_tokens=8,
                                          temperature=0)
    choice = chat.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert 0 < chat.usage.completion_tokens <= 8 and chat.usage.prompt_tokens > 0
    # Greedy: the streamed answer (from either replica: same weights) is the same text.
    stream = client.chat.completions.create(model=models[0], messages=messages, max_tokens=8,
                                            temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == choice.message.content

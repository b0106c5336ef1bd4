"""`folio serve` with TLS, an API key (from a file) and a served model name, used through the
sync and asyncio clients and the `folio` command; health stays open without a key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from client import AsyncFolioClient, FolioClient
from tests.fixtures.tls_certs import self_signed_cert

ROOT = Path(__file__).resolve().parents[3]
KEY = "e2e-key-7f3a9c"
SERVED_NAME = "folio-test-model"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tls_server(folio_server, default_model_dir, tmp_path_factory):
    """The tiny random model behind TLS and an API key. conftest's readiness wait speaks
    plaintext, so this one waits itself, over TLS and without a key (health is open)."""
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = self_signed_cert(tmp)
    key_file = tmp / "api-key"
    key_file.write_text(KEY + "\n")
    args = ["--tls-cert", str(cert), "--tls-key", str(key), "--api-key-file", str(key_file),
            "--served-model-name", SERVED_NAME]
    with folio_server(model=default_model_dir, args=args, wait=False) as server:
        deadline = time.monotonic() + 180
        with FolioClient(server.address, tls_ca=cert, api_key="") as client:
            while True:
                assert server.proc.poll() is None, server.log_tail()
                try:
                    if client.health(timeout=2) == "SERVING":
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, server.log_tail()
                time.sleep(0.2)
        yield server, cert


def folio(*argv: str, env_key: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FOLIO_API_KEY"}
    if env_key is not None:
        env["FOLIO_API_KEY"] = env_key
    return subprocess.run([sys.executable, "-m", "client.cli", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_sync_client_with_tls_and_key(tls_server, monkeypatch):
    server, cert = tls_server
    monkeypatch.delenv("FOLIO_API_KEY", raising=False)
    with FolioClient(server.address, tls_ca=cert, api_key=KEY, timeout=60) as client:
        info = client.model_info()
        assert info["model_name"] == SERVED_NAME  # not the model directory's path
        done = client.generate_text("Hello", max_tokens=4, ignore_eos=True)
        assert done.finish_reason == "length" and len(done.token_ids) == 4
    for key in ("", "not-the-key"):
        with FolioClient(server.address, tls_ca=cert, api_key=key, timeout=60) as client:
            assert client.health() == "SERVING"
            with pytest.raises(grpc.RpcError) as err:
                client.model_info()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in err.value.details()
    monkeypatch.setenv("FOLIO_API_KEY", KEY)  # the client's default
    with FolioClient(server.address, tls_ca=cert, timeout=60) as client:
        assert client.tokenize("Hello") and client.stats()["executor_connected"]


async def test_async_client_with_tls_and_key(tls_server):
    server, cert = tls_server
    async with AsyncFolioClient(server.address, tls_ca=cert, api_key=KEY, timeout=60) as client:
        await client.wait_ready(timeout=10)
        choices = await client.generate_choices("Hi", n=2, max_tokens=3, ignore_eos=True)
        assert [len(c.token_ids) for c in choices] == [3, 3]
    async with AsyncFolioClient(server.address, tls_ca=cert, api_key="", timeout=60) as client:
        assert await client.health() == "SERVING"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate_text("Hi", max_tokens=1)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_clients_cannot_talk_to_the_tls_port(tls_server):
    server, _ = tls_server
    with FolioClient(server.address, api_key=KEY, timeout=10) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.model_info()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_cli_with_tls_and_key(tls_server):
    server, cert = tls_server
    common = ("--address", server.address, "--tls-ca", str(cert))
    info = folio("info", *common, "--api-key", KEY)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["model_name"] == SERVED_NAME
    done = folio("generate", *common, "--json", "--max-tokens", "3", "--ignore-eos", "Hi",
                 env_key=KEY)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["token_ids"]) == 3
    refused = folio("generate", *common, "--max-tokens", "3", "Hi")
    assert refused.returncode == 1
    assert "folio: UNAUTHENTICATED: this server requires an API key" in refused.stderr
    health = folio("health", *common)  # no key: health is open
    assert (health.returncode, health.stdout.strip()) == (0, "SERVING")
    missing = folio("health", "--address", server.address, "--tls-ca", "/nonexistent.pem")
    assert missing.returncode == 1 and "cannot read --tls-ca" in missing.stderr


def test_default_served_name_is_the_model_directory_name(default_server, default_model_dir):
    with FolioClient(default_server.address, timeout=60) as client:
        assert client.model_info()["model_name"] == Path(default_model_dir).name

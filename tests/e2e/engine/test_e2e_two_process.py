"""The scheduler and the executor as separate processes (how compose runs them): the server
answers health NOT_SERVING and refuses work with UNAVAILABLE until an executor has completed the
handshake, then serves."""

from __future__ import annotations

import time

import grpc
import pytest

from client import FolioClient


def wait_health_answer(client: FolioClient, proc, timeout: float = 60.0) -> str:
    """The first health status the server gives (it answers before any executor exists)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the scheduler exited"
        try:
            return client.health(timeout=2.0)
        except grpc.RpcError:
            time.sleep(0.1)  # port not open yet
    raise AssertionError(f"no health answer in {timeout:g}s")


def test_serving_only_after_the_executor_handshake(folio_server, folio_executor,
                                                   default_model_dir):
    with folio_server(model=default_model_dir, spawn_executor=False, wait=False) as scheduler:
        with FolioClient(scheduler.address, timeout=60) as client:
            assert wait_health_answer(client, scheduler.proc) == "NOT_SERVING"
            assert client.stats()["executor_connected"] is False
            with pytest.raises(grpc.RpcError) as err:
                client.generate_text("too early", max_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "executor" in err.value.details()
            time.sleep(0.5)  # nothing but an executor may flip it
            assert client.health() == "NOT_SERVING"

            with folio_executor(default_model_dir, scheduler.executor_address) as executor:
                client.wait_ready(timeout=180)
                assert executor.poll() is None
                assert client.stats()["executor_connected"] is True
                info = client.model_info()
                assert info["random_weights"] is True and info["num_kv_blocks"] > 0
                done = client.generate_text("now it works", max_tokens=5, ignore_eos=True,
                                            temperature=0.0)
                assert done.finish_reason == "length" and len(done.token_ids) == 5

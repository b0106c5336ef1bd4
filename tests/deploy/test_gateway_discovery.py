"""The gateway of deploy/kubernetes/base/gateway.yaml finds a Folio replica through Kubernetes
service discovery, with the manifest's own arguments (selector, namespace from the downward
API, port): smg lists the pods of the manifest's namespace by the manifest's selector, from
the Kubernetes API stand-in (tests/deploy/kube_api_standin.py: no cluster here), registers
the matching pod's gRPC port, and the official `openai` client gets a greedy chat answer
through it equal to Folio's own. Also: the scheduler's readiness probe (gRPC health, the
manifest's service name) answers SERVING on the real replica."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import FolioClient
from tests.deploy.conftest import base_documents, container, find

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_smg_lists_the_manifest_selector_in_the_pod_namespace(discovered_stack):
    lists = discovered_stack.kube_api.pod_lists()
    assert lists, "smg never listed pods"
    for request in lists:
        # Namespaced (a Role suffices), never the cluster-wide /api/v1/pods.
        assert request["namespace"] == discovered_stack.namespace
        selector = dict(t.split("=", 1) for t in request["query"]["labelSelector"].split(","))
        assert selector == discovered_stack.selector
    watches = [r for r in discovered_stack.kube_api.requests if r not in lists]
    assert watches and all(r["namespace"] == discovered_stack.namespace for r in watches)


def test_chat_through_the_discovered_replica(discovered_stack):
    client = openai.OpenAI(base_url=f"{discovered_stack.gateway_url}/v1", api_key="unused",
                           timeout=120, max_retries=0)
    response = client.chat.completions.create(model=discovered_stack.model, messages=CHAT,
                                              temperature=0, max_tokens=8)
    with FolioClient(discovered_stack.replica_address, timeout=120) as folio:
        expected = folio.generate_text(messages=CHAT, temperature=0.0, max_tokens=8)
    (choice,) = response.choices
    assert choice.message.content == expected.text
    assert response.usage.completion_tokens == len(expected.token_ids)
    # Registered from the pod the stand-in listed (127.0.0.1), not from a decoy.
    log = discovered_stack.gateway_log.read_text(errors="replace")
    port = discovered_stack.replica_address.rsplit(":", 1)[1]
    assert f"127.0.0.1:{port}" in log
    assert "127.0.0.2" not in log and "127.0.0.3" not in log


def test_the_readiness_probe_service_is_serving(discovered_stack):
    scheduler = container(find(base_documents(), "Deployment", "folio"), "scheduler")
    service = scheduler["readinessProbe"]["grpc"].get("service", "")
    with grpc.insecure_channel(discovered_stack.replica_address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING

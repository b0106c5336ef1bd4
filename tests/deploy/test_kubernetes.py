"""deploy/kubernetes: every manifest, rendered as kustomize renders it (`kubectl kustomize`,
where kubectl is installed) and as written, validated offline against the Kubernetes API's
JSON schemas (kubernetes-validate, strict: an unknown field fails), plus the facts the
manifests must agree on: the gateway's selector and port find the replicas, the probes ask
the scheduler's port, the secret and metrics are where the commands look, and the GPU
variant's GPU count is its tensor-parallel size. The gateway really discovering a replica by
these settings is tests/deploy/test_gateway_discovery.py."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.conftest import ROOT
from tests.deploy.conftest import (
    KUBE_BASE,
    base_documents,
    container,
    find,
    flag,
    kustomization,
    selector_flag,
)

KUBE_GPU = ROOT / "deploy" / "kubernetes" / "gpu"
# The oldest Kubernetes the manifests support (gRPC probes are GA from 1.27); the newest is
# the newest kubernetes-validate knows.
OLDEST_VERSION = "1.29.0"


def validator():
    return pytest.importorskip("kubernetes_validate",
                               reason="needs kubernetes-validate (a test extra)")


def render(directory) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("needs kubectl (its built-in kustomize) to render an overlay")
    done = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def validate(docs: list[dict]) -> None:
    kubernetes_validate = validator()
    assert docs
    for version in (OLDEST_VERSION, kubernetes_validate.latest_version()):
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_wrong_manifest():
    kubernetes_validate = validator()
    deployment = find(base_documents(), "Deployment", "folio")
    container(deployment, "scheduler")["readinessProbe"]["grpcPort"] = 50051  # no such field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(),
                                     strict=True)


def test_base_manifests_as_written_validate():
    validate(base_documents())


@pytest.mark.parametrize("directory", [KUBE_BASE, KUBE_GPU], ids=["base", "gpu"])
def test_rendered_manifests_validate(directory):
    docs = render(directory)
    validate(docs)
    namespace = kustomization(KUBE_BASE)["namespace"]
    assert {d["metadata"].get("namespace") for d in docs} == {namespace}
    binding = find(docs, "RoleBinding", "folio-gateway-pod-reader")
    assert [s["namespace"] for s in binding["subjects"]] == [namespace]


def test_the_gateway_selects_the_replicas_and_only_them():
    docs = base_documents()
    workers = find(docs, "Deployment", "folio")
    gateway_deployment = find(docs, "Deployment", "folio-gateway")
    gateway = container(gateway_deployment, "gateway")
    args = gateway["args"]
    assert args[0] == "launch" and "--service-discovery" in args
    assert "--worker-urls" not in args  # found by label, not listed
    pod_labels = workers["spec"]["template"]["metadata"]["labels"]
    selector = selector_flag(args)
    assert selector.items() <= pod_labels.items()
    # The gateway's own pods do not match (it must not route to itself).
    gateway_labels = gateway_deployment["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= gateway_labels.items()
    # Its namespace is the pod's own (downward API), watched with a namespaced Role.
    assert flag(args, "--service-discovery-namespace") == "$(POD_NAMESPACE)"
    (env,) = [e for e in gateway["env"] if e["name"] == "POD_NAMESPACE"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert flag(args, "--service-discovery-port") == flag(
        container(workers, "scheduler")["args"], "--port")
    # RBAC: the gateway's service account may read pods, nothing more.
    account = gateway_deployment["spec"]["template"]["spec"]["serviceAccountName"]
    role = find(docs, "Role", "folio-gateway-pod-reader")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    binding = find(docs, "RoleBinding", "folio-gateway-pod-reader")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [("ServiceAccount", account)]
    find(docs, "ServiceAccount", account)
    # The OpenAI port behind a Service, and the health paths smg serves.
    service = find(docs, "Service", "folio-gateway")
    assert service["spec"]["selector"].items() <= gateway_labels.items()
    (http,) = [p for p in gateway["ports"] if p["name"] == "http"]
    assert http["containerPort"] == int(flag(args, "--port"))
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/liveness"


def test_a_replica_pod_is_a_scheduler_and_its_executor():
    docs = base_documents()
    workers = find(docs, "Deployment", "folio")
    pod = workers["spec"]["template"]["spec"]
    scheduler, executor = container(workers, "scheduler"), container(workers, "executor")
    assert scheduler["args"][0] == "scheduler" and executor["args"][0] == "executor"
    # The channel: the pod's loopback, both ends holding the Secret's file.
    channel = flag(scheduler["args"], "--executor-address")
    assert channel.startswith("tcp://127.0.0.1:")
    assert flag(executor["args"], "--scheduler-address") == channel
    (secret_volume,) = [v for v in pod["volumes"] if "secret" in v]
    assert secret_volume["secret"]["secretName"] == "folio-channel"
    (item,) = secret_volume["secret"]["items"]
    for c in (scheduler, executor):
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == secret_volume["name"]]
        assert mount["readOnly"] is True
        assert flag(c["args"], "--channel-secret-file") == f"{mount['mountPath']}/{item['path']}"
    # gRPC health on the API port, the overall service (Folio sets "" with its services).
    port = int(flag(scheduler["args"], "--port"))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert scheduler[probe]["grpc"]["port"] == port, probe
        assert scheduler[probe]["grpc"].get("service", "") == "", probe
    # Requests and limits on both; the executor's threads are its CPU request.
    for c in (scheduler, executor):
        assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    assert flag(executor["args"], "--cpu-threads") == executor["resources"]["requests"]["cpu"]
    # Prometheus finds /metrics from the pod's annotations.
    annotations = workers["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == flag(scheduler["args"], "--metrics-port")
    assert annotations["prometheus.io/port"] in {str(p["containerPort"]) for p in
                                                 scheduler["ports"]}
    # The headless Service resolves the replicas.
    service = find(docs, "Service", "folio-workers")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= workers["spec"]["template"]["metadata"][
        "labels"].items()


def test_the_gpu_variant_shards_over_its_gpus():
    docs = render(KUBE_GPU)
    workers = find(docs, "Deployment", "folio")
    executor = container(workers, "executor")
    gpus = executor["resources"]["limits"]["nvidia.com/gpu"]
    assert int(flag(executor["args"], "--tensor-parallel-size")) == int(gpus) >= 2
    assert flag(executor["args"], "--device") == "cuda"
    assert executor["image"].endswith(":cuda")
    # NCCL's shared memory, and the base's channel and secret kept.
    assert any(m["mountPath"] == "/dev/shm" for m in executor["volumeMounts"])
    assert flag(executor["args"], "--scheduler-address") == flag(
        container(workers, "scheduler")["args"], "--executor-address")
    assert flag(executor["args"], "--channel-secret-file")
    # The scheduler needs no GPU.
    assert "nvidia.com/gpu" not in container(workers, "scheduler")["resources"].get("limits", {})


def test_kubernetes_prometheus_config_scrapes_by_annotation():
    config = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod"
    assert sd["namespaces"]["names"] == [kustomization(KUBE_BASE)["namespace"]]
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"] in [
        r["source_labels"] for r in keep]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs promtool (Debian's prometheus package)")
    done = subprocess.run([promtool, "check", "config", "--syntax-only",
                           str(ROOT / "deploy" / "kubernetes" / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    if "kubernetes_sd_configs not found" in done.stdout + done.stderr:
        pytest.skip("this promtool is built without Kubernetes service discovery (Debian's)")
    assert done.returncode == 0, done.stdout + done.stderr

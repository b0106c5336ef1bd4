"""The deployment as its manifests describe it, on 127.0.0.1: one real `folio serve` replica
(the tiny random model, with /metrics) and the real gateway (`smg launch`) started with the
arguments of deploy/kubernetes/base/gateway.yaml, which find the replica through Kubernetes
service discovery. No cluster here: the Kubernetes API is kube_api_standin's stand-in, which
lists one pod carrying the replica's labels at 127.0.0.1 (and decoys it must not pick)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, TINY_RANDOM, free_port, stop_process_tree
from tests.deploy.kube_api_standin import FakePod, KubeApiStandIn

KUBE_BASE = ROOT / "deploy" / "kubernetes" / "base"
GATEWAY_READY_S = 180.0


def kustomization(directory: Path) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def base_documents() -> list[dict]:
    """Every object of the base's resources, as written (kustomize's namespace not applied)."""
    docs = []
    for name in kustomization(KUBE_BASE)["resources"]:
        docs.extend(d for d in yaml.safe_load_all((KUBE_BASE / name).read_text()) if d)
    return docs


def find(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(deployment: dict, name: str) -> dict:
    (c,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name=value` or `--name value` in a container's args."""
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(args):
            return args[i + 1]
    return None


def selector_flag(args: list[str]) -> dict[str, str]:
    """smg's `--selector k=v k2=v2` (values up to the next flag) as a dict."""
    start = args.index("--selector") + 1
    terms = []
    for arg in args[start:]:
        if arg.startswith("--"):
            break
        terms.append(arg)
    return dict(t.split("=", 1) for t in terms)


def expand_env(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of container args (unknown references stay as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)


def gateway_argv(args: list[str], env: dict[str, str], overrides: dict[str, str]) -> list[str]:
    """The manifest's args, expanded, with `--flag=value` entries replaced from `overrides`."""
    out = []
    for arg in (expand_env(a, env) for a in args):
        name = arg.split("=", 1)[0]
        out.append(f"{name}={overrides[name]}" if name in overrides and "=" in arg else arg)
    missing = [n for n in overrides if not any(a.startswith(f"{n}=") for a in out)]
    assert not missing, f"gateway.yaml lost {missing}"
    return out


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


@dataclasses.dataclass
class Stack:
    replica_address: str  # the replica's gRPC API (host:port)
    replica_metrics_url: str
    gateway_url: str
    gateway_metrics_url: str
    gateway_log: Path
    kube_api: KubeApiStandIn
    namespace: str
    selector: dict[str, str]
    model: str  # the served model name, as the gateway lists it


def _wait_gateway(proc: subprocess.Popen, url: str, log: Path) -> str:
    """The served model's name, once the gateway routes to it with its tokenizer loaded."""
    deadline = time.monotonic() + GATEWAY_READY_S
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(OSError, ValueError):
            models = [m["id"] for m in json.loads(http_get(f"{url}/v1/models"))["data"]]
            last = http_get(f"{url}/v1/tokenizers")
            if models and models[0] in last:
                return models[0]
        time.sleep(0.5)
    raise TimeoutError(f"gateway not ready ({last[:300]}):\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="session")
def discovered_stack(folio_server, tmp_path_factory):
    smg = Path(sys.executable).parent / "smg"
    if not smg.exists():
        pytest.skip("needs smg (a test extra)")
    docs = base_documents()
    workers = find(docs, "Deployment", "folio")
    gateway = container(find(docs, "Deployment", "folio-gateway"), "gateway")
    namespace = kustomization(KUBE_BASE)["namespace"]
    pod_labels = workers["spec"]["template"]["metadata"]["labels"]
    scheduler_args = container(workers, "scheduler")["args"]
    metrics_port = free_port()
    replica_args = ["--metrics-port", str(metrics_port)]
    tmp = tmp_path_factory.mktemp("deploy-stack")
    with folio_server(model=TINY_RANDOM, args=replica_args) as replica:
        grpc_port = replica.address.rsplit(":", 1)[1]
        assert flag(scheduler_args, "--port") == flag(gateway["args"], "--service-discovery-port")
        pods = [FakePod(name="folio-0", namespace=namespace, labels=pod_labels,
                        pod_ip="127.0.0.1"),
                # Same labels, another namespace; same namespace, another app.
                FakePod(name="folio-0", namespace=f"{namespace}-other", labels=pod_labels,
                        pod_ip="127.0.0.2"),
                FakePod(name="other-0", namespace=namespace,
                        labels={"app.kubernetes.io/name": "other"}, pod_ip="127.0.0.3")]
        with KubeApiStandIn(pods=pods) as kube_api:
            kubeconfig = kube_api.write_kubeconfig(tmp / "kubeconfig", namespace)
            http_port, prom_port = free_port(), free_port()
            env = {e["name"]: namespace for e in gateway["env"]
                   if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                   == "metadata.namespace"}
            argv = gateway_argv(gateway["args"], env, {
                "--host": "127.0.0.1", "--port": str(http_port),
                "--prometheus-host": "127.0.0.1", "--prometheus-port": str(prom_port),
                # Every pod of the manifest listens on one port; here it is the replica's.
                "--service-discovery-port": grpc_port,
            })
            log = tmp / "smg.log"
            run_env = {k: v for k, v in os.environ.items()
                       if not k.startswith("KUBERNETES_")}  # never a real in-cluster config
            run_env["KUBECONFIG"] = str(kubeconfig)
            with open(log, "wb") as out:
                proc = subprocess.Popen([str(smg), *argv], cwd=tmp, env=run_env,
                                        stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            try:
                url = f"http://127.0.0.1:{http_port}"
                model = _wait_gateway(proc, url, log)
                yield Stack(replica_address=replica.address,
                            replica_metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
                            gateway_url=url,
                            gateway_metrics_url=f"http://127.0.0.1:{prom_port}/metrics",
                            gateway_log=log, kube_api=kube_api, namespace=namespace,
                            selector=selector_flag(gateway["args"]), model=model)
            finally:
                stop_process_tree(proc)

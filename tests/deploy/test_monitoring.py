"""Monitoring: compose.yaml's `monitoring` profile (Prometheus + Grafana), its Prometheus
configuration and the Grafana dashboard (deploy/grafana/dashboards/folio.json).

Static: the profile leaves plain `up` unchanged, Prometheus scrapes every replica and the
gateway where compose runs them, every dashboard expression is valid PromQL (promql-parser)
on the provisioned datasource. With the real processes (tests/deploy/conftest.py's replica
and gateway): every metric a dashboard expression names is in what Folio's or smg's /metrics
exports, vLLM's names in Folio's. With the real Prometheus (Debian's `prometheus`; skipped
without it): the compose configuration, retargeted to 127.0.0.1, scrapes both, and every
dashboard expression evaluates to at least one series through its HTTP API; and the
Kubernetes scrape job's relabeling keeps exactly the annotated running pods."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from client import FolioClient
from tests.conftest import ROOT, free_port, stop_process_tree
from tests.deploy.conftest import base_documents, find, flag, http_get

COMPOSE = ROOT / "compose.yaml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "folio.json"
MONITORING = {"prometheus", "grafana"}
# Grafana's variables, as a query would see them with every model selected.
VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*"}
# What the issue asks the dashboard to show, by the metric each needs.
REQUIRED = {"vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
            "vllm:time_per_output_token_seconds_bucket", "vllm:num_requests_running",
            "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:num_preemptions_total", "vllm:spec_decode_num_accepted_tokens_total",
            "vllm:spec_decode_num_draft_tokens_total"}
PROMETHEUS_READY_S = 60.0


def parser():
    return pytest.importorskip("promql_parser", reason="needs promql-parser (a test extra)")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def expressions() -> list[str]:
    """Every PromQL expression of the dashboard's panels, Grafana's variables substituted."""
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    out = []
    for expr in exprs:
        for name, value in VARIABLES.items():
            expr = expr.replace(name, value)
        assert "$" not in expr, f"an unknown Grafana variable in {expr}"
        out.append(expr)
    return out


def metric_names(expr: str) -> set[str]:
    promql_parser = parser()
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or next((m.value for m in node.matchers.matchers
                                      if m.name == "__name__"), None)
            assert name, f"a selector without a metric name in {expr}"
            names.add(name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def dashboard_metrics() -> set[str]:
    names = set().union(*(metric_names(e) for e in expressions()))
    for variable in dashboard()["templating"]["list"]:
        query = variable["query"]["query"] if isinstance(variable["query"], dict) \
            else variable["query"]
        names.add(re.fullmatch(r"label_values\(([\w:]+),\s*\w+\)", query)[1])
    return names


def compose_services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_monitoring_is_a_profile_that_plain_up_leaves_out():
    services = compose_services()
    profiled = {n for n, s in services.items() if s.get("profiles")}
    assert profiled == MONITORING
    for name in MONITORING:
        assert services[name]["profiles"] == ["monitoring"]
        (port,) = services[name]["ports"]
        assert ":-127.0.0.1:" in port, f"{name} must publish on loopback by default"
    # Plain services never depend on a profiled one (that would pull it into `up`).
    for name, service in services.items():
        if name not in MONITORING:
            assert not set(service.get("depends_on", [])) & MONITORING, name


def test_prometheus_scrapes_every_replica_and_the_gateway():
    services = compose_services()
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {job["job_name"]: {t for sc in job["static_configs"] for t in sc["targets"]}
               for job in config["scrape_configs"]}
    schedulers = {f"{n}:{flag(s['command'], '--metrics-port')}" for n, s in services.items()
                  if (s.get("command") or [None])[0] == "scheduler"}
    assert len(schedulers) >= 2 and None not in {t.split(":")[1] for t in schedulers}
    assert targets["folio"] == schedulers
    gateway = services["gateway"]["command"]
    assert targets["gateway"] == {f"gateway:{flag(gateway, '--prometheus-port')}"}
    # The files the profile mounts are these.
    mounts = [v.split(":")[0] for v in services["prometheus"]["volumes"]]
    assert "./deploy/prometheus/prometheus.yml" in mounts
    grafana_mounts = {v.split(":")[0] for v in services["grafana"]["volumes"]}
    assert grafana_mounts == {"./deploy/grafana/provisioning", "./deploy/grafana/dashboards"}
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs promtool (Debian's prometheus package)")
    done = subprocess.run([promtool, "check", "config", "--syntax-only", str(PROMETHEUS_CONFIG)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_is_valid_promql_on_the_provisioned_datasource():
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    (source,) = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"], panel["title"]
    with pytest.raises(ValueError):  # the parser does reject a bad expression
        parser().parse("rate(vllm:generation_tokens_total[1m]")
    assert REQUIRED <= dashboard_metrics()
    # Grafana loads the dashboards from where compose mounts them.
    (provider,) = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "folio.yaml").read_text())["providers"]
    grafana = compose_services()["grafana"]
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]


def exported(url: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(http_get(url))
            for s in family.samples}


@pytest.fixture(scope="module")
def traffic(discovered_stack):
    """Chats through the gateway, streamed and not, so that every series has samples."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{discovered_stack.gateway_url}/v1", api_key="unused",
                           timeout=120, max_retries=0)
    messages = [{"role": "user", "content": "Tell me about Paris."}]
    for stream in (False, True):
        response = client.chat.completions.create(model=discovered_stack.model,
                                                  messages=messages, max_tokens=8,
                                                  temperature=0, stream=stream)
        if stream:
            assert "".join(c.choices[0].delta.content or "" for c in response if c.choices)
        else:
            assert response.choices[0].message.content
    # And one the replica refuses (a prompt over the model's context), so that the error
    # series exist too (smg creates a series at its first event).
    with FolioClient(discovered_stack.replica_address, timeout=60) as folio:
        max_model_len = folio.model_info()["max_model_len"]
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(
            model=discovered_stack.model, max_tokens=8,
            messages=[{"role": "user", "content": "Paris " * max_model_len}])
    assert 400 <= refused.value.status_code < 500
    return discovered_stack


@pytest.mark.e2e
def test_every_dashboard_metric_is_exported(traffic):
    folio = exported(traffic.replica_metrics_url)
    smg = exported(traffic.gateway_metrics_url)
    wanted = dashboard_metrics()
    missing = sorted(wanted - folio - smg)
    assert not missing, f"not exported by Folio or smg: {missing}"
    # vLLM's names come from Folio, the gateway's panels from smg.
    assert {n for n in wanted if n.startswith("vllm:")} <= folio
    assert {n for n in wanted if n.startswith("smg_")} <= smg


@contextlib.contextmanager
def run_prometheus(config: dict, tmp: Path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("needs prometheus (Debian's package: apt-get install prometheus)")
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = tmp / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            cwd=tmp, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + PROMETHEUS_READY_S
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(OSError):
                http_get(f"{url}/-/ready")
                break
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield url
    finally:
        stop_process_tree(proc)


def query(url: str, expr: str) -> list[dict]:
    body = json.loads(http_get(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"))
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


@pytest.mark.e2e
def test_real_prometheus_scrapes_folio_and_evaluates_the_dashboard(traffic, tmp_path):
    """The compose configuration with its targets moved to this machine's processes."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    local = {"folio": traffic.replica_metrics_url, "gateway": traffic.gateway_metrics_url}
    for job in config["scrape_configs"]:
        address = urllib.parse.urlsplit(local[job["job_name"]]).netloc
        job["static_configs"] = [{"targets": [address]}]
    with run_prometheus(config, tmp_path) as url:
        deadline = time.monotonic() + PROMETHEUS_READY_S
        # Three scrapes of each job: enough samples for rate() over the dashboard's window.
        while not all(len(query(url, f'count_over_time(up{{job="{job}"}}[1m])')) == 1
                      and float(query(url, f'count_over_time(up{{job="{job}"}}[1m])')[0]
                                ["value"][1]) >= 3 for job in local):
            assert time.monotonic() < deadline, "no three scrapes of each job"
            time.sleep(0.5)
        for job in local:
            (up,) = query(url, f'up{{job="{job}"}}')
            assert up["value"][1] == "1", job
        (generated,) = query(url, 'vllm:generation_tokens_total{job="folio"}')
        assert float(generated["value"][1]) >= 16  # the two chats' tokens at least
        assert generated["metric"]["model_name"] == traffic.model
        for expr in expressions():
            assert query(url, expr), f"no series for {expr}"


def _pod_target(address: str, phase: str, annotations: dict[str, str], pod: str,
                component: str) -> dict:
    """A file_sd target carrying the meta labels Prometheus' Kubernetes pod role gives a pod's
    declared port, so that the Kubernetes job's relabeling runs as it would on a cluster."""
    labels = {"__meta_kubernetes_namespace": "folio", "__meta_kubernetes_pod_name": pod,
              "__meta_kubernetes_pod_phase": phase,
              "__meta_kubernetes_pod_label_app_kubernetes_io_component": component}
    for key, value in annotations.items():
        name = re.sub(r"[^a-zA-Z0-9_]", "_", key)
        labels[f"__meta_kubernetes_pod_annotation_{name}"] = value
    return {"targets": [address], "labels": labels}


@pytest.mark.e2e
def test_real_prometheus_applies_the_kubernetes_job_relabeling(traffic, tmp_path):
    """deploy/kubernetes/prometheus.yml's relabeling, with its Kubernetes discovery replaced by
    files holding the pod meta labels (Debian's Prometheus has no Kubernetes discovery): the
    annotated running pods are scraped on their annotation's port and path, the others not."""

    config = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    (job,) = config["scrape_configs"]
    docs = base_documents()
    worker = find(docs, "Deployment", "folio")["spec"]["template"]["metadata"]["annotations"]
    gateway = find(docs, "Deployment", "folio-gateway")["spec"]["template"]["metadata"][
        "annotations"]
    replica_port = urllib.parse.urlsplit(traffic.replica_metrics_url).port
    gateway_port = urllib.parse.urlsplit(traffic.gateway_metrics_url).port
    grpc_address = traffic.replica_address  # the pod's declared gRPC port: not scraped
    # The manifests' annotations, with the port moved to where this machine serves /metrics.
    targets = [
        _pod_target(grpc_address, "Running", {**worker, "prometheus.io/port": str(replica_port)},
                    "folio-0", "worker"),
        _pod_target(urllib.parse.urlsplit(traffic.gateway_url).netloc, "Running",
                    {**gateway, "prometheus.io/port": str(gateway_port)}, "folio-gateway-0",
                    "gateway"),
        _pod_target(grpc_address, "Running", {}, "unannotated-0", "worker"),
        _pod_target(grpc_address, "Pending", {**worker, "prometheus.io/port": str(replica_port)},
                    "pending-0", "worker"),
    ]
    (tmp_path / "pods.json").write_text(json.dumps(targets))
    del job["kubernetes_sd_configs"]
    job["file_sd_configs"] = [{"files": [str(tmp_path / "pods.json")]}]
    with run_prometheus(config, tmp_path) as url:
        deadline = time.monotonic() + PROMETHEUS_READY_S
        while len(up := query(url, "up")) < 2 or any(s["value"][1] != "1" for s in up):
            assert time.monotonic() < deadline, up
            time.sleep(0.5)
        scraped = {s["metric"]["pod"]: s["metric"] for s in up}
        assert set(scraped) == {"folio-0", "folio-gateway-0"}
        assert scraped["folio-0"]["instance"] == f"127.0.0.1:{replica_port}"
        assert scraped["folio-0"]["component"] == "worker"
        assert scraped["folio-gateway-0"]["instance"] == f"127.0.0.1:{gateway_port}"
        assert scraped["folio-0"]["namespace"] == "folio"
        deadline = time.monotonic() + PROMETHEUS_READY_S
        while not (series := query(url, 'vllm:generation_tokens_total{pod="folio-0"}')):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert series[0]["metric"]["model_name"] == traffic.model

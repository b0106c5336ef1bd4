"""A stand-in for the Kubernetes API server, for the gateway's service discovery on a machine
without a cluster: it answers the two calls smg's pod watcher makes, a list of one
namespace's pods by label selector and the watch that follows it (held open, no events),
from a fixed set of pods, and records every request. Plain HTTP on 127.0.0.1; smg reaches it
through a kubeconfig (KUBECONFIG) that names it as the cluster's server.

Only equality selectors (`k=v,k2=v2`, what `--selector k=v k2=v2` sends) are understood;
anything else is answered 400, so a selector smg sent in another form fails the test."""

from __future__ import annotations

import json
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

WATCH_POLL_S = 0.2


@dataclass(frozen=True, kw_only=True)
class FakePod:
    name: str
    namespace: str
    labels: dict[str, str]
    pod_ip: str
    ready: bool = True

    def manifest(self, resource_version: str) -> dict:
        ready = "True" if self.ready else "False"
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": self.name, "namespace": self.namespace,
                             "uid": f"uid-{self.namespace}-{self.name}",
                             "resourceVersion": resource_version, "labels": self.labels},
                "spec": {"containers": [{"name": "scheduler", "image": "folio"}]},
                "status": {"phase": "Running", "podIP": self.pod_ip,
                           "podIPs": [{"ip": self.pod_ip}],
                           "conditions": [{"type": "Ready", "status": ready}]}}


def parse_selector(text: str) -> dict[str, str]:
    """`k=v,k2=v2` (or `==`) as a dict; ValueError for set-based or negated terms."""
    selector = {}
    for term in filter(None, text.split(",")):
        key, sep, value = term.replace("==", "=").partition("=")
        if not sep or key.endswith("!") or not key.strip():
            raise ValueError(f"not an equality selector term: {term!r}")
        selector[key.strip()] = value.strip()
    return selector


@dataclass
class KubeApiStandIn:
    pods: list[FakePod]
    requests: list[dict] = field(default_factory=list)  # {"path", "namespace", "query"}
    resource_version: str = "100"

    def __post_init__(self):
        self._stop = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> KubeApiStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()  # ends the held-open watches
        self._server.shutdown()
        self._server.server_close()

    def write_kubeconfig(self, path: Path, namespace: str) -> Path:
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "standin",
                  "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
                  "users": [{"name": "standin", "user": {"token": "unused"}}],
                  "contexts": [{"name": "standin", "context": {
                      "cluster": "standin", "user": "standin", "namespace": namespace}}]}
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    def pod_lists(self) -> list[dict]:
        """The list requests (not watches) received so far."""
        return [r for r in self.requests if r["query"].get("watch") != "true"]

    def _handler(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args) -> None:
                pass

            def _json(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                parts = url.path.strip("/").split("/")
                # /api/v1/namespaces/NS/pods, or /api/v1/pods (every namespace)
                if parts[:2] != ["api", "v1"] or parts[-1] != "pods":
                    return self._json(404, {"kind": "Status", "code": 404})
                namespace = parts[3] if len(parts) == 5 and parts[2] == "namespaces" else None
                api.requests.append({"path": url.path, "namespace": namespace, "query": query})
                try:
                    selector = parse_selector(query.get("labelSelector", ""))
                except ValueError as e:
                    return self._json(400, {"kind": "Status", "code": 400, "message": str(e)})
                if query.get("watch") == "true":
                    return self._watch()
                items = [p.manifest(api.resource_version) for p in api.pods
                         if namespace in (None, p.namespace)
                         and all(p.labels.get(k) == v for k, v in selector.items())]
                self._json(200, {"apiVersion": "v1", "kind": "PodList", "items": items,
                                 "metadata": {"resourceVersion": api.resource_version}})

            def _watch(self) -> None:
                # Nothing changes: an open chunked stream without events until shutdown.
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
                while not api._stop.wait(WATCH_POLL_S):
                    pass
                self.close_connection = True

        return Handler

"""The `/metrics` HTTP port (--metrics-port): prometheus_client's WSGI app for one server's
registry (content negotiation, OpenMetrics, gzip and `name[]=` filters are the library's), on
a threaded wsgiref server in a daemon thread, so the event loop never serves HTTP.

No input may stop the server: every connection is handled in its own thread with a socket
timeout, at most MAX_CONNECTIONS at once (more are closed on accept), and an error in one
(garbage, a reset mid-response, a stalled client) ends that connection only, logged at DEBUG.
The port has neither TLS nor the API key (as vLLM's /metrics): it binds the gRPC host.
"""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler

import structlog
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

log = structlog.get_logger("folio.scheduler.metrics")

MAX_CONNECTIONS = 32
CONNECTION_TIMEOUT_S = 10.0


class _Handler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT_S  # a client that stalls mid-request loses its connection

    def log_message(self, format, *args) -> None:
        pass  # a scrape every few seconds is not worth a log line


class _Server(ThreadingWSGIServer):
    """ThreadingWSGIServer (daemon threads) for an IPv4 or IPv6 address, bounded in threads."""

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily):
        self.address_family = family  # read by TCPServer.__init__ when it makes the socket
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, _Handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the limit: closed at once
            return
        try:
            super().process_request(request, client_address)  # starts its thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        # socketserver's default prints a traceback to stderr; one bad connection is no news.
        log.debug("metrics connection failed", client=str(client_address), exc_info=True)


def _keep_metric_names(app):
    """The WSGI `app` with every metric name served as written (`vllm:generation_tokens`).

    prometheus_client answers an OpenMetrics request that names no `escaping` (every
    Prometheus before 3.0 sends one) with escaping=underscores, which rewrites the colons of
    vLLM's names (`vllm_generation_tokens_total`), so dashboards and autoscalers written for
    vLLM would find nothing. Colons are valid in classic metric names, so asking for
    allow-utf-8 changes nothing else: every name here is a classic one and comes out as is."""

    def keep_names(environ, start_response):
        accept = environ.get("HTTP_ACCEPT", "")
        if "openmetrics-text" in accept and "escaping=" not in accept:
            parts = [p if "openmetrics-text" not in p else f"{p};escaping=allow-utf-8"
                     for p in accept.split(",")]
            environ = {**environ, "HTTP_ACCEPT": ",".join(parts)}
        return app(environ, start_response)

    return keep_names


class MetricsServer:
    """Binds at construction (a busy port raises OSError before anything starts); `start()`
    serves from a daemon thread, `stop()` closes the port."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        host = host.strip("[]")  # "[::1]" as in a gRPC address
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        self._httpd = _Server((sockaddr[0], port), family)
        self._httpd.set_app(_keep_metric_names(make_wsgi_app(registry)))
        self.host, self.port = host, self._httpd.server_port
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs=dict(poll_interval=0.1),
                                        name="folio-metrics-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Blocks up to the poll interval (0.1 s) while the serving loop notices."""
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()

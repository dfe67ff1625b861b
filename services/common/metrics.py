"""Prometheus metrics shared by every tier (names carry the ``llmesh_`` prefix).

Tier-specific metrics live beside each tier's core; these are the ones the shared
interceptor records for every RPC.
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, make_wsgi_app

RPC_REQUESTS = Counter(
    "llmesh_rpc_requests",
    "RPCs handled, by tier, method and final status code; a request carried by a Session "
    "counts once under the per-request method it stands for (Generate, Process), with "
    "transport=session (transport=call: an RPC of its own).",
    ["tier", "method", "code", "transport"],
)
RPC_LATENCY = Histogram(
    "llmesh_rpc_duration_seconds",
    "Server-side RPC duration by tier and method (Session-carried requests as above).",
    ["tier", "method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)

FULL_COLLECTIONS = Histogram(
    "llmesh_gc_full_collection_seconds",
    "Duration of the cyclic garbage collector's full (oldest-generation) collections, "
    "during which the tier's event loop serves nothing (services/common/gcpause.py).",
    ["tier"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)


def record_request(tier: str, method: str, code: str, seconds: float, transport: str = "session") -> None:
    """Count one request a Session carried as the per-request RPC it replaces.

    Dashboards and alerts read request rates and error codes per tier from
    ``llmesh_rpc_requests_total``; a long-lived Session is one RPC for thousands of
    requests, so without this an internal tier would look idle and its per-request errors
    would never reach the error-rate alerts. ``transport`` is ``local`` for a tier's work
    run inside another tier's process (the gateway's in-process postprocessor).
    """
    RPC_REQUESTS.labels(tier, method, code, transport).inc()
    RPC_LATENCY.labels(tier, method).observe(seconds)


class _MetricsHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not logged (one line per scrape every few seconds otherwise)."""


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


def start_metrics_server(port: int, host: str = "127.0.0.1",
                         registry: CollectorRegistry = REGISTRY) -> int:
    """Serve /metrics; returns the bound port (``port=0`` picks one), or -1 if disabled.

    The listener's thread blocks in its selector until a scrape arrives: prometheus_client's
    own server polls twice a second for a shutdown that never comes here (the thread is a
    daemon), a wakeup that costs every tier CPU on an idle mesh.
    """
    if port < 0:
        return -1
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("MetricsServer", (_MetricsServer,), {"address_family": family})
    httpd: WSGIServer = make_server(host, port, make_wsgi_app(registry), server_class,
                                    handler_class=_MetricsHandler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": None},
                     name="metrics-http", daemon=True).start()
    return int(httpd.server_port)

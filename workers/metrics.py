"""The batch service's metrics that workers keep (batch requests finished), and each worker's
own metrics server."""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client import Counter, disable_created_metrics, start_http_server

logger = logging.getLogger(__name__)

PREFIX = "pagedbatch:"

BATCH_REQUESTS = Counter(
    f"{PREFIX}batch_requests",
    "Batch requests a worker finished, by status: completed (an output line) or failed (an "
    "error line from the endpoint).",
    ["status"],
)


def serve_metrics(host: str, port: int) -> WSGIServer:
    """A worker's `/metrics` (its engine's and its batch counters) on a port of its own, served
    by a background thread; returns the server, which `shutdown()` stops."""
    # The `_created` series only clutter dashboards; vLLM drops them too.
    disable_created_metrics()
    server, _thread = start_http_server(port, addr=host)
    logger.info("metrics on http://%s:%d/metrics", host, server.server_port)
    return server

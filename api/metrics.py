"""`/metrics`: the process's Prometheus metrics, and the HTTP metrics the API keeps.

One exposition holds all this process has: prometheus_client's default registry (the engine's
metrics in the embedded deployment, the HTTP metrics, process figures) plus what is read when
Prometheus scrapes: the job store's batches, files and webhook deliveries, and the task queue's
depth. Like `/health`, it needs no API key and is not part of the OpenAPI document.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from fastapi import FastAPI, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedbatch.api.deps import Services
from pagedbatch.store.metrics import StoreCollector
from pagedbatch.workers.metrics import QueueDepthCollector

PREFIX = "pagedbatch:"
# Labels stay bounded whatever clients send: routes are templates, odd methods are "other".
UNMATCHED_ROUTE = "unmatched"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

HTTP_REQUESTS = Counter(
    f"{PREFIX}http_requests",
    "HTTP requests answered, by method, route template and status.",
    ["method", "route", "status"],
)
HTTP_DURATION = Histogram(
    f"{PREFIX}http_request_duration_seconds",
    "From receiving a request to the end of its response (a stream's last byte).",
    ["method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
)

# The `_created` series only clutter dashboards; vLLM drops them too.
disable_created_metrics()


def install_metrics(app: FastAPI, services: Services) -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_DefaultRegistry())
    registry.register(StoreCollector(services.session_factory))
    if services.queue is not None:
        registry.register(QueueDepthCollector(services.queue))
    app.state.metrics_registry = registry
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.add_middleware(HttpMetricsMiddleware)


def metrics(request: Request) -> Response:
    # A plain function: FastAPI runs it on a thread, where the store's queries may block.
    return Response(
        generate_latest(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST
    )


class _DefaultRegistry(Collector):
    """prometheus_client's default registry, inside the app's."""

    def collect(self) -> Iterable[Metric]:
        return REGISTRY.collect()

    def describe(self) -> Iterable[Metric]:
        return ()  # its names are checked for duplicates there, not again here


class HttpMetricsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        # An exception before the response starts becomes the server-error handler's 500.
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = route_template(scope)
            method = scope["method"] if scope["method"] in _METHODS else "other"
            HTTP_REQUESTS.labels(method, route, str(status)).inc()
            HTTP_DURATION.labels(method, route).observe(time.perf_counter() - started)


def route_template(scope: Scope) -> str:
    """The template of the route that served the request, such as `/v1/files/{file_id}`.

    The router leaves the route it matched in the scope. Depending on FastAPI's version, that
    route's template is the whole path's or only the part below its routers' prefixes; the
    prefixes are then the path's start, before the part the template matched. (Our prefixes are
    literal: a prefix with a parameter would put its values in the label.)
    """
    template = getattr(scope.get("route"), "path_format", None)
    if template is None:
        return UNMATCHED_ROUTE
    own_part = template.format(**scope.get("path_params", {}))
    path: str = scope["path"]
    if path.endswith(own_part):
        return path.removesuffix(own_part) + template
    return template

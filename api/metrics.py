"""`/metrics`: the process's Prometheus metrics, and the HTTP metrics the API keeps.

One exposition holds all this process has: prometheus_client's default registry (the engine's
metrics in the embedded deployment, the HTTP metrics, process figures) plus what is read when
Prometheus scrapes: the job store's batches, files and webhook deliveries (read at most every
`metrics_cache_seconds`, as they are GROUP BYs over whole tables), and the task queue's depth.

The figures are every tenant's together, so no API key opens `/metrics`: with `metrics_token`
set it needs that token as a bearer token (Prometheus's `authorization` scrape setting); without
one it is open while the API has no keys (a single tenant) and refused (403) once it has some.
It is not part of the OpenAPI document.
"""

from __future__ import annotations

import hmac
import math
import threading
import time
from collections.abc import Callable, Iterable

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
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.settings import Settings
from pagedbatch.store.metrics import StoreCollector
from pagedbatch.store.queue import QueueDepthCollector

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


def install_metrics(app: FastAPI, services: Services, settings: Settings) -> None:
    """`/metrics`, guarded as `settings` (the app's: its API keys) say."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_DefaultRegistry())
    store = StoreCollector(services.session_factory, settings.prices, settings.batch_discount)
    registry.register(CachedCollector(store, services.settings.metrics_cache_seconds))
    if services.queue is not None:
        registry.register(QueueDepthCollector(services.queue))
    app.state.metrics_registry = registry
    app.state.metrics_guard = _guard(settings.metrics_token, bool(settings.api_keys))
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.add_middleware(HttpMetricsMiddleware)


def metrics(request: Request) -> Response:
    # A plain function: FastAPI runs it on a thread, where the store's queries may block.
    request.app.state.metrics_guard(request.headers.get("authorization"))
    return Response(
        generate_latest(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST
    )


def _guard(token: str | None, has_api_keys: bool) -> Callable[[str | None], None]:
    """The check of a scrape's Authorization header."""
    expected = None if token is None else f"Bearer {token}".encode()

    def check(authorization: str | None) -> None:
        if expected is not None:
            presented = (authorization or "").encode()
            if not hmac.compare_digest(presented, expected):
                raise OpenAIError(
                    "/metrics needs the metrics token (PAGEDBATCH_METRICS_TOKEN) as a bearer "
                    "token; API keys do not open it.",
                    status_code=401,
                    code="invalid_metrics_token",
                )
        elif has_api_keys:
            raise OpenAIError(
                "/metrics shows every tenant's figures, so with API keys it needs a token of its "
                "own: set PAGEDBATCH_METRICS_TOKEN and give it to Prometheus as a bearer token.",
                status_code=403,
                code="metrics_disabled",
            )

    return check


class CachedCollector(Collector):
    """`collector`'s metrics, read at most every `seconds`; scrapes in between get the last
    reading. Concurrent scrapes wait for one reading rather than each making their own."""

    def __init__(
        self, collector: Collector, seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._collector = collector
        self._seconds = seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._families: list[Metric] = []
        self._read_at = -math.inf

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            if self._clock() - self._read_at >= self._seconds:
                self._families = list(self._collector.collect())
                self._read_at = self._clock()
            return list(self._families)

    def describe(self) -> Iterable[Metric]:
        return self._collector.describe()


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

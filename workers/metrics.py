"""The batch service's metrics that workers keep (batch requests finished) and the depth of the
task queues, and each worker's own metrics server."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import Counter, disable_created_metrics, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedbatch.workers.queue import TaskQueue

logger = logging.getLogger(__name__)

PREFIX = "pagedbatch:"

BATCH_REQUESTS = Counter(
    f"{PREFIX}batch_requests",
    "Batch requests a worker finished, by status: completed (an output line) or failed (an "
    "error line from the endpoint).",
    ["status"],
)


class QueueDepthCollector(Collector):
    """Tasks waiting in each queue, read when Prometheus scrapes."""

    def __init__(self, queue: TaskQueue):
        self.queue = queue

    def collect(self) -> Iterator[Metric]:
        try:
            depths = self.queue.depths()
        except Exception as e:  # noqa: BLE001 - an unreachable broker must not hide the rest
            logger.warning("cannot read the task queue's depth: %s", e)
            return
        family = GaugeMetricFamily(
            f"{PREFIX}queue_depth", "Tasks waiting to be picked up, per queue.", labels=["queue"]
        )
        for name, depth in sorted(depths.items()):
            family.add_metric([name], depth)
        yield family

    def describe(self) -> Iterator[Metric]:
        # Without it the registry would read the queue at registration, to learn the name.
        yield GaugeMetricFamily(f"{PREFIX}queue_depth", "", labels=["queue"])


def serve_metrics(host: str, port: int) -> WSGIServer:
    """A worker's `/metrics` (its engine's and its batch counters) on a port of its own, served
    by a background thread; returns the server, which `shutdown()` stops."""
    # The `_created` series only clutter dashboards; vLLM drops them too.
    disable_created_metrics()
    server, _thread = start_http_server(port, addr=host)
    logger.info("metrics on http://%s:%d/metrics", host, server.server_port)
    return server

"""Metrics read from the job store when Prometheus scrapes: batches by status, files and bytes
stored, webhook delivery attempts by outcome.

They describe the whole store, so only API processes export them (every replica the same
figures: dashboards take `max` across instances); workers do not. They are gauges: rows come and
go (files are deleted, webhook endpoints with their logs), so none is a counter.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.store.models import Batch, BatchStatus, File, WebhookDelivery, WebhookOutcome

PREFIX = "pagedbatch:"


class StoreCollector(Collector):
    def __init__(self, session_factory: sessionmaker[Session]):
        self.session_factory = session_factory

    def collect(self) -> Iterator[Metric]:
        with self.session_factory() as session:
            batches = dict(
                session.execute(select(Batch.status, func.count()).group_by(Batch.status)).all()
            )
            size = func.coalesce(func.sum(File.bytes), 0)
            files = session.execute(
                select(File.purpose, func.count(), size).group_by(File.purpose)
            ).all()
            deliveries = dict(
                session.execute(
                    select(WebhookDelivery.outcome, func.count()).group_by(WebhookDelivery.outcome)
                ).all()
            )
        family = GaugeMetricFamily(f"{PREFIX}batches", "Batches by status.", labels=["status"])
        for status in BatchStatus:  # every status, so a panel shows zeros, not gaps
            family.add_metric([status.value], batches.get(status.value, 0))
        yield family
        count = GaugeMetricFamily(f"{PREFIX}files", "Files stored, by purpose.", labels=["purpose"])
        size = GaugeMetricFamily(
            f"{PREFIX}file_bytes", "Bytes of the files stored, by purpose.", labels=["purpose"]
        )
        for purpose, n, total in sorted(files):
            count.add_metric([purpose], n)
            size.add_metric([purpose], total)
        yield count
        yield size
        family = GaugeMetricFamily(
            f"{PREFIX}webhook_deliveries",
            "Webhook delivery attempts on record, by outcome (delivered, failed, disabled).",
            labels=["outcome"],
        )
        for outcome in WebhookOutcome:
            family.add_metric([outcome.value], deliveries.get(outcome.value, 0))
        yield family

    def describe(self) -> Iterator[Metric]:
        # Without it the registry would query the store at registration, to learn the names.
        for name in ("batches", "files", "file_bytes", "webhook_deliveries"):
            yield GaugeMetricFamily(f"{PREFIX}{name}", "")

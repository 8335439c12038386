"""Metrics read from the job store when Prometheus scrapes: batches by status, files and bytes
stored, webhook delivery attempts by outcome, and from the usage ledger the tokens used and what
they cost, by model and by batch or realtime.

They describe the whole store, so only API processes export them (every replica the same
figures: dashboards take `max` across instances); workers do not. Most are gauges: rows come and
go (files are deleted, webhook endpoints with their logs). The ledger only grows, so its sums are
counters.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.costs import ModelPrice
from pagedbatch.ids import now
from pagedbatch.store.models import Batch, BatchStatus, File, WebhookDelivery, WebhookOutcome
from pagedbatch.store.usage import ALL_TIME, UsageQuery, UsageSums, usage_sums

PREFIX = "pagedbatch:"


class StoreCollector(Collector):
    def __init__(
        self,
        session_factory: sessionmaker[Session],
        prices: dict[str, ModelPrice] | None = None,
        batch_discount: float = 1.0,
    ):
        self.session_factory = session_factory
        self.prices = prices or {}
        self.batch_discount = batch_discount

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
            everything = UsageQuery(
                start=0, end=now() + 1, width=ALL_TIME, group_by=frozenset({"model", "batch"})
            )
            used = usage_sums(session, everything)
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
        yield from self._usage(used)

    def _usage(self, used: list[UsageSums]) -> Iterator[Metric]:
        tokens = CounterMetricFamily(
            f"{PREFIX}tokens",
            "Tokens used, by model, mode (batch or realtime) and kind (input, of which cached, "
            "and output).",
            labels=["model", "mode", "kind"],
        )
        cost = CounterMetricFamily(
            f"{PREFIX}cost_usd",
            "What the tokens used cost at the configured prices, by model and mode.",
            labels=["model", "mode"],
        )
        for sums in used:
            labels = [sums.model, "batch" if sums.batch else "realtime"]
            counts = (sums.input_tokens, sums.cached_tokens, sums.output_tokens)
            for kind, count in zip(("input", "cached", "output"), counts, strict=True):
                tokens.add_metric([*labels, kind], count)
            items = sums.line_items(self.prices, self.batch_discount)
            cost.add_metric(labels, sum(item.usd for item in items))
        yield tokens
        yield cost

    def describe(self) -> Iterator[Metric]:
        # Without it the registry would query the store at registration, to learn the names.
        for name in ("batches", "files", "file_bytes", "webhook_deliveries"):
            yield GaugeMetricFamily(f"{PREFIX}{name}", "")
        for name in ("tokens", "cost_usd"):
            yield CounterMetricFamily(f"{PREFIX}{name}", "")

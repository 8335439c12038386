"""The usage ledger (`UsageRecord`): a record per finished request, for usage and costs, and
the sums the admin API reads of it.

Batch lines are recorded by `record_results`, in the transaction that records their results.
Realtime requests are recorded here by a `LedgerWriter`, a batch of rows per transaction: a
request's record costs its handler a list append, never a commit of its own. The same
transaction settles the requests' spend reservations (store/reservations.py), so that a budget
counts a request's cost exactly when the ledger does.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.costs import LineItem, ModelPrice, line_items
from pagedbatch.ids import now
from pagedbatch.store.db import transaction
from pagedbatch.store.models import UsageRecord
from pagedbatch.store.reservations import Settlement, forget_all, settle
from pagedbatch.store.retry import is_transient

logger = logging.getLogger(__name__)

FLUSH_SECONDS = 1.0
# Records kept while the database is away; past this many the oldest are dropped (and logged):
# a long outage must not grow the server's memory without bound.
MAX_WAITING = 100_000
ALL_TIME = 2**40  # a bucket width that holds every record in one bucket
# Which of OpenAI's usage endpoints counts a record (`/v1/organization/usage/<kind>`): every
# request that runs a generating model is a completion, whatever its endpoint.
COMPLETIONS = "completions"
EMBEDDINGS = "embeddings"


def usage_kind(endpoint: str) -> str:
    """The kind of usage a request to `endpoint` (`/v1/embeddings`, ...) is counted as."""
    return EMBEDDINGS if endpoint == "/v1/embeddings" else COMPLETIONS


@dataclass(frozen=True)
class Usage:
    """One request's tokens, as its response's `usage` says them."""

    owner: str
    model: str
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    image_tokens: int = 0
    audio_tokens: int = 0
    batch_id: str | None = None
    kind: str = COMPLETIONS


class LedgerWriter:
    """Writes the records and settlements `add` is given, every FLUSH_SECONDS, all waiting in one
    transaction, on a thread of its own. A failed write (the database restarting) keeps them for
    the next one; `close` writes what waits and stops."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._session_factory = session_factory
        self._waiting: list[dict] = []
        self._settling: list[Settlement] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="usage-ledger", daemon=True)
        self._thread.start()

    def add(self, usage: Usage | None, settlement: Settlement | None = None) -> None:
        """Record `usage` (None: the request used nothing that is charged) and settle
        `settlement`, its spend reservation, with it."""
        with self._lock:
            if settlement is not None:  # as many as requests in flight: never dropped
                self._settling.append(settlement)
            if usage is None:
                return
            self._waiting.append({**asdict(usage), "finished_at": now()})
            if len(self._waiting) > MAX_WAITING:
                dropped = len(self._waiting) - MAX_WAITING
                del self._waiting[:dropped]
                logger.error("usage ledger: %d records dropped (the database is away)", dropped)

    def close(self) -> None:
        self._closed.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._closed.wait(FLUSH_SECONDS):
            self._flush()
        self._flush()

    def _flush(self) -> None:
        with self._lock:
            records, self._waiting = self._waiting, []
            settlements, self._settling = self._settling, []
        if not records and not settlements:
            return
        try:
            with transaction(self._session_factory) as session:
                if records:
                    session.execute(insert(UsageRecord), records)
                settle(session, settlements)
        except Exception as e:
            if not is_transient(e):
                logger.exception(
                    "usage ledger: %d records and %d settlements could not be written",
                    len(records),
                    len(settlements),
                )
                forget_all(settlements)  # their reservations lapse, and upkeep releases them
                return
            logger.warning(
                "usage ledger: writing %d records failed (%s); they and %d settlements wait for "
                "the next flush",
                len(records),
                e,
                len(settlements),
            )
            with self._lock:
                self._waiting[:0] = records  # before what came meanwhile
                self._settling[:0] = settlements
            return
        forget_all(settlements)


@dataclass(frozen=True)
class UsageQuery:
    """Which records to add up, and how: buckets of `width` seconds (aligned to multiples of it,
    in UTC) from `start` to `end` (exclusive), grouped by some of model, batch and api_key_id."""

    start: int
    end: int
    width: int
    group_by: frozenset[str] = frozenset()
    owners: frozenset[str] | None = None  # None: every tenant's
    models: frozenset[str] | None = None
    batch: bool | None = None  # True: batch lines only; False: realtime only
    kind: str | None = None  # COMPLETIONS or EMBEDDINGS only; None: every kind


@dataclass(frozen=True)
class UsageSums:
    bucket: int  # the bucket's start
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    image_tokens: int
    audio_tokens: int
    requests: int
    model: str | None = None
    batch: bool | None = None
    api_key_id: str | None = None

    def line_items(self, prices: dict[str, ModelPrice], discount: float) -> list[LineItem]:
        """What these tokens cost; the sums must be grouped by model and batch."""
        assert self.model is not None and self.batch is not None
        tokens = (self.input_tokens, self.cached_tokens, self.output_tokens)
        return line_items(self.model, self.batch, tokens, prices, discount)


def usage_sums(session: Session, query: UsageQuery) -> list[UsageSums]:
    """The sums of the records `query` selects, per bucket and group, in bucket order."""
    record = UsageRecord
    bucket = (record.finished_at - record.finished_at % query.width).label("bucket")
    groups = {
        "model": record.model,
        "batch": record.batch_id.is_not(None),
        "api_key_id": record.owner,
    }
    keys = [groups[name].label(name) for name in sorted(query.group_by)]
    statement = (
        select(
            bucket,
            *keys,
            func.sum(record.input_tokens),
            func.sum(record.cached_tokens),
            func.sum(record.output_tokens),
            func.sum(record.image_tokens),
            func.sum(record.audio_tokens),
            func.count(),
        )
        .where(record.finished_at >= query.start, record.finished_at < query.end)
        .group_by(bucket, *keys)
        .order_by(bucket, *keys)
    )
    if query.owners is not None:
        statement = statement.where(record.owner.in_(query.owners))
    if query.models is not None:
        statement = statement.where(record.model.in_(query.models))
    if query.batch is not None:
        statement = statement.where(groups["batch"] if query.batch else record.batch_id.is_(None))
    if query.kind is not None:
        statement = statement.where(record.kind == query.kind)
    sums = []
    for row in session.execute(statement):
        named = dict(zip(sorted(query.group_by), row[1 : 1 + len(keys)], strict=True))
        tokens = [int(value or 0) for value in row[1 + len(keys) :]]
        if "batch" in named:
            named["batch"] = bool(named["batch"])
        sums.append(UsageSums(int(row[0]), *tokens, **named))
    return sums

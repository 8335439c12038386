"""Spend limits: the service's hard monthly limit (`/v1/organization/spend_limit`) and each API
key's (`PAGEDBATCH_KEY_MONTHLY_SPEND_LIMIT_USD`). Past either, new realtime requests and new
batches get a 429 `insufficient_quota` before any engine work; batches already running finish.

What has been spent is this UTC month's usage at the configured prices, read from the usage
ledger at most every `spend_cache_seconds`, all keys in one query: a request costs no query of
its own, and a limit bites within that long of being reached (realtime usage reaches the ledger
within a flush more).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.ids import now
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.settings import Settings
from pagedbatch.store.models import SpendLimit
from pagedbatch.store.usage import ALL_TIME, UsageQuery, month_start, usage_sums

ORGANIZATION = "organization"  # the spend limit row's id


@dataclass(frozen=True)
class _Reading:
    limit_cents: int | None
    by_owner: dict[str, float] = field(default_factory=dict)  # USD this month

    @property
    def total(self) -> float:
        return sum(self.by_owner.values())


class SpendGuard:
    def __init__(
        self,
        session_factory: sessionmaker[Session],
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session_factory = session_factory
        self._settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._reading: _Reading | None = None
        self._read_at = 0.0

    def check(self, owner: str) -> None:
        """A 429 `insufficient_quota` if the service or `owner` has spent its monthly limit."""
        reading = self._current()
        if reading.limit_cents is not None and reading.total * 100 >= reading.limit_cents:
            raise _over("The service has reached its monthly spend limit.")
        key_limit = self._settings.key_monthly_spend_limit_usd
        if key_limit is not None and reading.by_owner.get(owner, 0.0) >= key_limit:
            raise _over("Your API key has reached its monthly spend limit.")

    def spent_usd(self) -> float:
        return self._current().total

    def forget(self) -> None:
        """Read again at the next check (the limit was changed)."""
        with self._lock:
            self._reading = None

    def _current(self) -> _Reading:
        with self._lock:
            stale = self._clock() - self._read_at >= self._settings.spend_cache_seconds
            if self._reading is None or stale:
                self._reading = self._read()
                self._read_at = self._clock()
            return self._reading

    def _read(self) -> _Reading:
        settings = self._settings
        query = UsageQuery(
            start=month_start(now()),
            end=now() + 1,
            width=ALL_TIME,
            group_by=frozenset({"model", "batch", "api_key_id"}),
        )
        by_owner: defaultdict[str, float] = defaultdict(float)
        with self._session_factory() as session:
            limit = session.get(SpendLimit, ORGANIZATION)
            for sums in usage_sums(session, query):
                items = sums.line_items(settings.prices, settings.batch_discount)
                by_owner[sums.api_key_id] += sum(item.usd for item in items)
        return _Reading(limit.threshold_cents if limit else None, dict(by_owner))


def _over(message: str) -> OpenAIError:
    return OpenAIError(
        f"{message} You exceeded your current quota; new requests are refused until the month "
        "ends or the limit is raised.",
        status_code=429,
        type="insufficient_quota",
        code="insufficient_quota",
    )

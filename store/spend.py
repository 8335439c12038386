"""Spend limits: the service's hard monthly limit (`/v1/organization/spend_limit`) and each API
key's (`PAGEDBATCH_KEY_MONTHLY_SPEND_LIMIT_USD`), which no number of concurrent requests, API
replicas or workers can take spend past.

Every realtime request and batch line reserves its worst case before any engine work
(`SpendGuard.reserve`): its prompts' tokens at the input price and, for each of their n choices,
max_tokens (without one, the context its prompt leaves) at the output price, at the current
prices, a batch line's at the batch discount. If its key's or the service's budget this UTC month
cannot hold that, it is refused (`SpendRefused`, which the doors answer with 429
`insufficient_quota`; a batch line gets an error line saying so). When it ends, however it ends,
it settles to its actual cost, what its usage-ledger record costs (realtime: api/spend.py's
`Account`; batch lines: their shard's result flush). A request that costs nothing at the prices
reserves nothing. The budgets, and how a reservation stays atomic across processes:
store/reservations.py.

The realtime door that admits a request reserves for it: the embedded server's, or in the
distributed deployment the worker's engine host that the API forwards it to (which tokenizes it).
A new batch is refused while either budget has nothing left; its lines reserve as they run. This
module is the API's and the workers' alike, so it speaks in tokens, not in requests.
"""

from __future__ import annotations

import os
import socket

from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.costs import NANOS_PER_USD, cost_nanos, worst_case_nanos
from pagedbatch.settings import Settings
from pagedbatch.store.reservations import (
    ORGANIZATION,
    Keeper,
    OverBudget,
    Reservation,
    budget_use,
    key_scope,
    next_month,
    service_limit_nanos,
)
from pagedbatch.store.usage import ALL_TIME, UsageQuery, usage_sums


class SpendRefused(Exception):
    """A request refused by a spend limit; its message says which and why."""


class SpendGuard:
    """The spend limits of one process's doors: reserves requests' and batch lines' worst cases
    (renewing them while they run), and tells whether a budget is spent."""

    def __init__(self, session_factory: sessionmaker[Session], settings: Settings) -> None:
        self._session_factory = session_factory
        self._settings = settings
        self._keeper = Keeper(
            session_factory,
            holder=f"{socket.gethostname()}:{os.getpid()}",
            lease_seconds=settings.spend_reservation_seconds,
            opening=self._opening,
        )

    def reserve(
        self, owner: str, model: str, batch: bool, prompt_tokens: int, output_tokens: int
    ) -> Reservation | None:
        """Hold the most a request of these tokens can cost in `owner`'s and the service's
        budgets; None if it costs nothing at the prices. SpendRefused if either cannot hold it."""
        settings = self._settings
        nanos = worst_case_nanos(
            model, batch, prompt_tokens, output_tokens, settings.prices, settings.batch_discount
        )
        if not nanos:
            return None
        try:
            return self._keeper.reserve(owner, nanos, self._key_limit())
        except OverBudget as over:
            whose = "The service's" if over.scope == ORGANIZATION else "Your API key's"
            raise SpendRefused(
                f"{whose} monthly spend limit cannot cover this request: at most it could cost "
                f"{nanos / NANOS_PER_USD:.6f} USD (its prompt, and max_tokens for each choice)."
            ) from None

    def cost(self, model: str, batch: bool, tokens: tuple[int, int, int]) -> int:
        """What `tokens` (input, of which cached, and output) cost now, in nano-dollars."""
        settings = self._settings
        return cost_nanos(model, batch, tokens, settings.prices, settings.batch_discount)

    def release(self, reservations: list[Reservation]) -> None:
        """Settle `reservations` at nothing: their requests recorded no usage."""
        self._keeper.release(reservations)

    def check(self, owner: str) -> None:
        """SpendRefused if the service's or `owner`'s budget has nothing left."""
        with self._session_factory() as session:
            limits = {
                ORGANIZATION: (service_limit_nanos(session), None),
                key_scope(owner): (self._key_limit(), owner),
            }
            for scope, (limit, whose) in limits.items():
                if limit is None:
                    continue
                if budget_use(session, scope, limit, self._opening, whose).exhausted:
                    raise SpendRefused(
                        "The service has reached its monthly spend limit."
                        if whose is None
                        else "Your API key has reached its monthly spend limit."
                    )

    def spent_usd(self) -> float:
        """The service's spend this month, what running requests hold reserved included."""
        with self._session_factory() as session:
            use = budget_use(session, ORGANIZATION, None, self._opening, None)
        return (use.spent_nanos + use.reserved_nanos) / NANOS_PER_USD

    def _key_limit(self) -> int | None:
        usd = self._settings.key_monthly_spend_limit_usd
        return None if usd is None else round(usd * NANOS_PER_USD)

    def _opening(self, session: Session, owner: str | None, month: int) -> int:
        """What the ledger holds of `month` (one key's, or with None everyone's) at the current
        prices."""
        query = UsageQuery(
            start=month,
            end=next_month(month),
            width=ALL_TIME,
            group_by=frozenset({"model", "batch"}),
            owners=None if owner is None else frozenset({owner}),
        )
        return sum(
            self.cost(
                sums.model, sums.batch, (sums.input_tokens, sums.cached_tokens, sums.output_tokens)
            )
            for sums in usage_sums(session, query)
            if sums.model is not None and sums.batch is not None
        )

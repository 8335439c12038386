"""Spend budgets (`SpendBudget`) and the reservations held in them (`SpendReservation`): what the
service and each API key have spent in a UTC month, and what their running requests may still
spend, kept so that no number of concurrent requests, API replicas or workers can take spend
past a limit.

A request reserves its worst case before it runs (`Keeper.reserve`): one transaction raises its
key's and then the service's `reserved_nanos`, each by a single UPDATE that matches only while
spent + reserved + the worst case stays within that budget's limit. Row locks (PostgreSQL, where
a waiting UPDATE checks its condition again on the row it waited for) or the single writer
(SQLite) make the check and the raise one step: two requests can never both take the last of a
budget. When the request ends it settles (`settle`): its reservation is deleted, and each budget
moves its worst case out of `reserved_nanos` and its actual cost into `spent_nanos`, in the
transaction that writes its usage-ledger record, so that the budgets and the ledger agree.

Transactions take budget rows in one order (by month, the keys' by scope, the service's last)
and reservation rows by id, so none waits on another that waits on it.

A keeper renews the expiry of its open reservations every third of its lease; a process that
dies stops renewing, and upkeep (`release_lapsed`) gives back what its reservations held. A
reservation released so (its holder cut off from the database for a whole lease) still has its
actual cost counted when it settles.

A month's budget row is made at its first reservation, opening with what the usage ledger holds
of the month so far (`Opening`: usage from before budgets existed, at the current prices). A
reservation counts in the month it was made in, even if its request ends in the next. Amounts are
nano-dollars (pagedbatch/costs.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import delete, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.costs import NANOS_PER_USD
from pagedbatch.ids import now
from pagedbatch.store.db import transaction
from pagedbatch.store.models import SpendBudget, SpendLimit, SpendReservation
from pagedbatch.store.retry import is_transient

logger = logging.getLogger(__name__)

ORGANIZATION = "organization"  # the service's budget, and its spend limit row's id
NANOS_PER_CENT = NANOS_PER_USD // 100
UNLIMITED = 2**62  # beyond any budget: a limit this high or none at all
RELEASE_BATCH = 500  # lapsed reservations released in one transaction

# What the usage ledger holds of a month (its start) so far, at the current prices, in
# nano-dollars: one key's usage, or with None every key's.
Opening = Callable[[Session, str | None, int], int]


def month_start(moment: int) -> int:
    """The Unix second the UTC month of `moment` began."""
    day = datetime.fromtimestamp(moment, UTC)
    return int(datetime(day.year, day.month, 1, tzinfo=UTC).timestamp())


def next_month(month: int) -> int:
    """The Unix second the UTC month after the one beginning at `month` begins."""
    return month_start(month + 32 * 24 * 3600)


def key_scope(owner: str) -> str:
    """The budget of the API key whose id is `owner`."""
    return f"key:{owner}"


class OverBudget(Exception):
    """A reservation would take a budget past its limit."""

    def __init__(self, scope: str) -> None:
        super().__init__(f"the {scope} budget cannot hold this reservation")
        self.scope = scope


@dataclass(frozen=True)
class Reservation:
    """A worst case held in its key's and the service's budgets of `month`."""

    id: int
    owner: str
    month: int
    nanos: int
    keeper: Keeper = field(repr=False, compare=False)

    def forget(self) -> None:
        """Stop renewing it: it has settled, or it is left to lapse."""
        self.keeper.forget(self.id)


@dataclass(frozen=True)
class Settlement:
    """A reservation's end: its request's actual cost (0 if nothing is charged)."""

    reservation: Reservation
    nanos: int


@dataclass(frozen=True)
class BudgetUse:
    """What a budget holds this month: spent and reserved, and its limit (None: none)."""

    spent_nanos: int
    reserved_nanos: int
    limit_nanos: int | None

    @property
    def exhausted(self) -> bool:
        """Nothing is left of it: a request of any cost would be refused."""
        used = self.spent_nanos + self.reserved_nanos
        return self.limit_nanos is not None and used >= self.limit_nanos


class _Unopened(Exception):
    """A budget has no row for the month yet."""


class Keeper:
    """Makes reservations for one holder (a process, a shard run) and renews them, every third of
    `lease_seconds`, until they settle; a thread does it only while some are open."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        holder: str,
        lease_seconds: float,
        opening: Opening,
    ) -> None:
        self._session_factory = session_factory
        self._holder = holder
        self._lease = lease_seconds
        self._opening = opening
        self._lock = threading.Lock()
        self._open: set[int] = set()
        self._renewer: threading.Thread | None = None

    def reserve(self, owner: str, nanos: int, key_limit_nanos: int | None) -> Reservation:
        """Hold `nanos` in `owner`'s budget (whose limit is `key_limit_nanos`) and the service's
        this month; raises OverBudget, naming the first budget that cannot hold it."""
        month = month_start(now())
        try:
            taken = self._take(owner, month, nanos, key_limit_nanos)
        except _Unopened:
            self._open_budgets(owner, month)
            taken = self._take(owner, month, nanos, key_limit_nanos)
        reservation = Reservation(taken, owner, month, nanos, self)
        with self._lock:
            self._open.add(taken)
            if self._renewer is None:
                self._renewer = threading.Thread(
                    target=self._renew_while_open, name="spend-reservations", daemon=True
                )
                self._renewer.start()
        return reservation

    def forget(self, reservation_id: int) -> None:
        with self._lock:
            self._open.discard(reservation_id)

    def release(self, reservations: Sequence[Reservation]) -> None:
        """Settle `reservations` at nothing, in a transaction of their own."""
        if not reservations:
            return
        with transaction(self._session_factory) as session:
            settle(session, [Settlement(reservation, 0) for reservation in reservations])
        for reservation in reservations:
            reservation.forget()

    def _take(self, owner: str, month: int, nanos: int, key_limit_nanos: int | None) -> int:
        with transaction(self._session_factory) as session:
            # Read before the first write: on SQLite the UPDATE below begins the transaction and
            # takes the write lock, so what the budgets hold is read under it.
            limits = {key_scope(owner): key_limit_nanos, ORGANIZATION: service_limit_nanos(session)}
            for scope, limit in limits.items():  # in the order budget rows are taken
                ceiling = UNLIMITED if limit is None else min(limit, UNLIMITED)
                budget = (SpendBudget.scope == scope, SpendBudget.month == month)
                taken = session.execute(
                    update(SpendBudget)
                    .where(
                        *budget,
                        SpendBudget.spent_nanos + SpendBudget.reserved_nanos + nanos <= ceiling,
                    )
                    .values(reserved_nanos=SpendBudget.reserved_nanos + nanos)
                ).rowcount
                if taken != 1:
                    if session.scalar(select(SpendBudget.scope).where(*budget)) is None:
                        raise _Unopened
                    raise OverBudget(scope)
            row = SpendReservation(
                owner=owner,
                month=month,
                nanos=nanos,
                holder=self._holder,
                expires_at=time.time() + self._lease,
            )
            session.add(row)
            session.flush()
            return row.id

    def _open_budgets(self, owner: str, month: int) -> None:
        """Make `owner`'s and the service's budget rows of `month` where they are missing."""
        scopes = {key_scope(owner): owner, ORGANIZATION: None}
        with transaction(self._session_factory) as session:
            present = set(
                session.scalars(
                    select(SpendBudget.scope).where(
                        SpendBudget.month == month, SpendBudget.scope.in_(scopes)
                    )
                )
            )
            rows = [
                {
                    "scope": scope,
                    "month": month,
                    "spent_nanos": self._opening(session, whose, month),
                    "reserved_nanos": 0,
                }
                for scope, whose in scopes.items()
                if scope not in present
            ]
            if rows:
                dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
                # Another process may make the same row meanwhile: its opening is as good.
                session.execute(
                    dialect.insert(SpendBudget)
                    .values(rows)
                    .on_conflict_do_nothing(index_elements=["scope", "month"])
                )

    def _renew_while_open(self) -> None:
        while True:
            time.sleep(self._lease / 3)
            with self._lock:
                ids = sorted(self._open)
                if not ids:
                    self._renewer = None
                    return
            try:
                with transaction(self._session_factory) as session:
                    session.execute(
                        update(SpendReservation)
                        .where(SpendReservation.id.in_(ids))
                        .values(expires_at=time.time() + self._lease)
                    )
            except Exception as e:  # noqa: BLE001 - the next round tries again
                if not is_transient(e):
                    logger.exception("renewing %d spend reservations failed", len(ids))
                else:
                    logger.warning("renewing %d spend reservations failed (%s)", len(ids), e)


def settle(session: Session, settlements: Sequence[Settlement]) -> None:
    """End reservations in the caller's transaction: each one's worst case leaves its budgets'
    `reserved_nanos` (unless upkeep released it already) and its actual cost joins their
    `spent_nanos`. The caller forgets them once the transaction has committed."""
    moves: defaultdict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0])
    for settlement in sorted(settlements, key=lambda s: s.reservation.id):
        reservation = settlement.reservation
        held = session.execute(
            delete(SpendReservation).where(SpendReservation.id == reservation.id)
        ).rowcount
        for scope in (key_scope(reservation.owner), ORGANIZATION):
            move = moves[(reservation.month, scope)]
            move[0] -= reservation.nanos if held else 0
            move[1] += settlement.nanos
    _move(session, moves)


def release_lapsed(session_factory: sessionmaker[Session]) -> int:
    """Give back what lapsed reservations held (their holders died): up to RELEASE_BATCH of
    them; returns how many."""
    cutoff = time.time()
    with transaction(session_factory) as session:
        lapsed = session.execute(
            select(
                SpendReservation.id,
                SpendReservation.owner,
                SpendReservation.month,
                SpendReservation.nanos,
                SpendReservation.holder,
            )
            .where(SpendReservation.expires_at < cutoff)
            .order_by(SpendReservation.id)
            .limit(RELEASE_BATCH)
        ).all()
        moves: defaultdict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0])
        released = 0
        for row in lapsed:
            # Unless its holder renewed it, or settled it, meanwhile.
            gone = session.execute(
                delete(SpendReservation).where(
                    SpendReservation.id == row.id, SpendReservation.expires_at < cutoff
                )
            ).rowcount
            if not gone:
                continue
            released += 1
            logger.warning(
                "released spend reservation %d of %s (%d nano-USD): its holder %s stopped "
                "renewing it",
                row.id,
                row.owner,
                row.nanos,
                row.holder,
            )
            for scope in (key_scope(row.owner), ORGANIZATION):
                moves[(row.month, scope)][0] -= row.nanos
        _move(session, moves)
    return released


def budget_use(
    session: Session, scope: str, limit_nanos: int | None, opening: Opening, owner: str | None
) -> BudgetUse:
    """What `scope`'s budget holds this month (`owner`: its key, None for the service's); with
    no row yet, what the ledger holds of the month."""
    month = month_start(now())
    row = session.get(SpendBudget, (scope, month))
    if row is None:
        return BudgetUse(opening(session, owner, month), 0, limit_nanos)
    return BudgetUse(row.spent_nanos, row.reserved_nanos, limit_nanos)


def service_limit_nanos(session: Session) -> int | None:
    """The service's spend limit (`/v1/organization/spend_limit`); None: none is set."""
    cents = session.scalar(select(SpendLimit.threshold_cents).where(SpendLimit.id == ORGANIZATION))
    return None if cents is None else cents * NANOS_PER_CENT


def _move(session: Session, moves: dict[tuple[int, str], list[int]]) -> None:
    """Add each (reserved, spent) change to its budget, in the one order every transaction
    takes budget rows in."""
    for month, scope in sorted(moves, key=_lock_order):
        reserved, spent = moves[(month, scope)]
        if reserved or spent:
            session.execute(
                update(SpendBudget)
                .where(SpendBudget.scope == scope, SpendBudget.month == month)
                .values(
                    reserved_nanos=SpendBudget.reserved_nanos + reserved,
                    spent_nanos=SpendBudget.spent_nanos + spent,
                )
            )


def _lock_order(budget: tuple[int, str]) -> tuple[int, bool, str]:
    month, scope = budget
    return month, scope == ORGANIZATION, scope


def forget_all(settlements: Iterable[Settlement]) -> None:
    """Stop renewing the reservations of `settlements` (settled, or left to lapse)."""
    for settlement in settlements:
        settlement.reservation.forget()

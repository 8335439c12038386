"""Background responses' runs: which worker runs one (its lease), and finding those whose run or
task was lost.

A `run_response` task claims its response: queued, or in progress with no live lease (its worker
died, lost the lease, or handed it back while shutting down). Claiming leases it to the worker
for `lease_seconds` and counts an attempt; the worker renews the lease while it runs, and ends the
response only while it still holds it (`held_by`), so a worker that lost its lease to another
writes nothing. The status stays `in_progress` from the first claim on: a client never sees a
response go back to `queued`.

Nothing here changes what a response is (store/responses.py's state machine does); a claim, a
renewal and a hand-back only move the lease and the counters.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import ColumnElement, Select, and_, func, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.store.db import transaction
from pagedbatch.store.models import ResponseStatus, StoredResponse

QUEUED = ResponseStatus.QUEUED.value
IN_PROGRESS = ResponseStatus.IN_PROGRESS.value


@dataclass(frozen=True)
class Claim:
    response_id: str
    attempts: int  # this claim included
    leased_until: float  # time.monotonic() by which the lease must be renewed


def _unleased(moment: float) -> ColumnElement[bool]:
    return or_(StoredResponse.lease_owner.is_(None), StoredResponse.lease_expires_at < moment)


def claimable(moment: float) -> ColumnElement[bool]:
    """Background responses a worker may take at `moment`: queued, or in progress unleased."""
    return and_(
        StoredResponse.background.is_(True),
        or_(
            StoredResponse.status == QUEUED,
            and_(StoredResponse.status == IN_PROGRESS, _unleased(moment)),
        ),
    )


def claim(
    factory: sessionmaker[Session], response_id: str, worker_id: str, lease_seconds: float
) -> Claim | None:
    """Lease the response to `worker_id`, in progress; None if it is not claimable (another
    worker runs it, it has ended, or it is gone)."""
    moment = time.time()
    leased_until = time.monotonic() + lease_seconds
    with transaction(factory) as session:
        attempts = session.scalar(
            update(StoredResponse)
            .where(StoredResponse.id == response_id, claimable(moment))
            .values(
                status=IN_PROGRESS,
                lease_owner=worker_id,
                lease_expires_at=moment + lease_seconds,
                attempts=StoredResponse.attempts + 1,
            )
            .returning(StoredResponse.attempts)
        )
    return None if attempts is None else Claim(response_id, attempts, leased_until)


def held_by(worker_id: str) -> ColumnElement[bool]:
    """The response is still leased to `worker_id`: the condition its end is written under."""
    return StoredResponse.lease_owner == worker_id


@dataclass(frozen=True)
class Look:
    running: bool  # still in progress: not cancelled, ended otherwise, or deleted
    renewed: bool  # the lease was renewed (only if asked to)


def look(
    factory: sessionmaker[Session],
    response_id: str,
    worker_id: str,
    lease_seconds: float | None,
) -> Look:
    """Whether the response still runs, renewing `worker_id`'s lease for `lease_seconds` if
    given. A look that renews nothing commits nothing."""
    with factory() as session:
        status = session.scalar(
            select(StoredResponse.status).where(StoredResponse.id == response_id)
        )
        running = status == IN_PROGRESS
        if lease_seconds is None or not running:
            return Look(running, False)
        renewed = session.execute(
            update(StoredResponse)
            .where(
                StoredResponse.id == response_id,
                StoredResponse.status == IN_PROGRESS,
                held_by(worker_id),
            )
            .values(lease_expires_at=time.time() + lease_seconds)
        )
        session.commit()
        return Look(True, renewed.rowcount == 1)


def hand_back(factory: sessionmaker[Session], response_id: str, worker_id: str) -> None:
    """Give up the lease of a response this process did not finish (it is shutting down): the
    next worker takes it at once. Not an attempt that failed: its count is undone."""
    with transaction(factory) as session:
        session.execute(
            update(StoredResponse)
            .where(
                StoredResponse.id == response_id,
                StoredResponse.status == IN_PROGRESS,
                held_by(worker_id),
            )
            .values(
                lease_owner=None,
                lease_expires_at=None,
                attempts=StoredResponse.attempts - 1,
                queued_at=time.time(),
            )
        )


def mark_queued(factory: sessionmaker[Session], response_ids: Sequence[str]) -> None:
    """Note that a task was queued for each response just now."""
    with transaction(factory) as session:
        session.execute(
            update(StoredResponse)
            .where(StoredResponse.id.in_(response_ids))
            .values(queued_at=time.time())
        )


def lost_runs(
    factory: sessionmaker[Session],
    queued_before: float,
    dead_workers: Select[tuple[str]] | None,
    limit: int,
) -> list[str]:
    """Background responses whose task or run was lost, oldest first, at most `limit`: queued
    with no task queued since `queued_before` (a broker that lost it), or in progress with no
    live lease (their worker died: its lease lapsed, or `dead_workers` names it; or handed back,
    with no task queued since). They are unleased here, so that a claim takes them at once, and
    noted as queued: the caller queues a task for each."""
    moment = time.time()
    stale = func.coalesce(StoredResponse.queued_at, StoredResponse.created_at) < queued_before
    # Handed back (no lease, a task queued with it), or leased past its expiry.
    abandoned = or_(
        and_(StoredResponse.lease_owner.is_(None), stale),
        StoredResponse.lease_expires_at < moment,
    )
    if dead_workers is not None:
        abandoned = or_(abandoned, StoredResponse.lease_owner.in_(dead_workers))
    lost = and_(
        StoredResponse.background.is_(True),
        or_(
            and_(StoredResponse.status == QUEUED, stale),
            and_(StoredResponse.status == IN_PROGRESS, abandoned),
        ),
    )
    with transaction(factory) as session:
        candidates = (
            select(StoredResponse.id)
            .where(lost)
            .order_by(StoredResponse.created_at, StoredResponse.id)
            .limit(limit)
        )
        return list(
            session.scalars(
                update(StoredResponse)
                .where(StoredResponse.id.in_(candidates.scalar_subquery()), lost)
                .values(queued_at=moment, lease_owner=None, lease_expires_at=None)
                .returning(StoredResponse.id)
            ).all()
        )

"""Worker heartbeats in the job store: which processes running shards are alive.

Every process that runs tasks writes its row every `worker_heartbeat_seconds`. One that has not
for MISSED_BEATS beats is dead, and upkeep re-leases its shards at once instead of waiting out
their leases. After a database outage every row is stale at once, though the workers live: so a
process judges others by their heartbeats only once its own have gone through for as long (the
others have then had as long to write theirs).
"""

from __future__ import annotations

import logging
import time

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql import Select

from pagedbatch.settings import Settings
from pagedbatch.store.db import transaction
from pagedbatch.store.models import WorkerHeartbeat
from pagedbatch.store.retry import is_transient
from pagedbatch.workers.context import WorkerContext

logger = logging.getLogger(__name__)

MISSED_BEATS = 3  # one late beat (a slow commit, a pause) must not cost a worker its shards
DEAD = 0.0  # the last_seen of a worker that said it is dying: stale to everyone at once
PRUNE_AFTER_SECONDS = 24 * 3600  # a dead worker's row, kept a while for whoever looks into it


def stale_after_seconds(settings: Settings) -> float:
    return MISSED_BEATS * settings.worker_heartbeat_seconds


def heartbeat(ctx: WorkerContext) -> None:
    """Write this worker's heartbeat; a worker one of whose engines died stops, so others take
    over."""
    if ctx.dead_engine() is not None:
        return
    try:
        _write(ctx, time.time())
    except Exception as exc:
        ctx.liveness.beating_since = None
        if not is_transient(exc):
            raise
        logger.warning("heartbeat of %s failed (%s); the next one tries again", ctx.worker_id, exc)
        return
    if ctx.liveness.beating_since is None:
        ctx.liveness.beating_since = time.monotonic()


def declare_dead(ctx: WorkerContext) -> None:
    """Mark this worker dead, so its shards are re-leased at the next reap."""
    _write(ctx, DEAD)


def _write(ctx: WorkerContext, last_seen: float) -> None:
    with transaction(ctx.session_factory) as session:
        written = session.execute(
            update(WorkerHeartbeat)
            .where(WorkerHeartbeat.worker_id == ctx.worker_id)
            .values(last_seen=last_seen)
        ).rowcount
    if written:
        return
    try:
        with transaction(ctx.session_factory) as session:
            session.add(WorkerHeartbeat(worker_id=ctx.worker_id, last_seen=last_seen))
    except IntegrityError:  # written meanwhile by this worker's previous, timed-out beat
        pass


def trusts_heartbeats(ctx: WorkerContext) -> bool:
    """Whether this process has beaten long enough to take others' silence for death."""
    since = ctx.liveness.beating_since
    return since is not None and time.monotonic() - since >= stale_after_seconds(ctx.settings)


def dead_workers(settings: Settings) -> Select[tuple[str]]:
    """The ids of workers whose heartbeats stopped; those that never wrote one are not here."""
    cutoff = time.time() - stale_after_seconds(settings)
    return select(WorkerHeartbeat.worker_id).where(WorkerHeartbeat.last_seen < cutoff)


def prune_heartbeats(ctx: WorkerContext) -> int:
    """Delete the rows of workers dead for long: their leases lapsed long ago."""
    with transaction(ctx.session_factory) as session:
        return session.execute(
            delete(WorkerHeartbeat).where(
                WorkerHeartbeat.last_seen < time.time() - PRUNE_AFTER_SECONDS
            )
        ).rowcount

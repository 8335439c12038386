"""Upkeep: the periodic jobs that keep work moving whatever died, in every process that runs
tasks, one process at a time.

Each worker (and the embedded server) fires `upkeep` every tick on a timer of its own, so upkeep
goes on as long as any of them lives; a database lock lets one of them run a round at a time.
On PostgreSQL it is a session advisory lock, released at the end of the round or as soon as
the holder's connection drops (its process died, or the database restarted); on SQLite, which
only the embedded server uses, a lock in the process. A round runs each job whose period has
passed since this process last ran it. A job that fails is logged and runs again in its next
period; a transient failure (an outage) ends the round, and the job runs at the next tick.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sqlalchemy import Connection, func, select
from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.settings import Settings
from pagedbatch.store.reservations import release_lapsed
from pagedbatch.store.retry import is_transient
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.periodic import delete_expired_files, expire_batches, reap_leases
from pagedbatch.workers.recovery import (
    redrive_finalization,
    redrive_validation,
    requeue_pending_shards,
)
from pagedbatch.workers.responses import requeue_lost_responses
from pagedbatch.workers.retention import apply_retention
from pagedbatch.workers.webhooks import sweep_webhooks

logger = logging.getLogger(__name__)

# Any constant of ours; pg_try_advisory_lock takes a bigint. Not migrations/env.py's.
UPKEEP_LOCK_ID = 0x7570_6B65_6570  # "upkeep"
RETENTION_SECONDS = 600.0  # how often retention runs: deletions are due by days, not seconds


@dataclass(frozen=True)
class Job:
    name: str
    run: Callable[[WorkerContext], None]
    period: Callable[[Settings], float]


def tick_seconds(settings: Settings) -> float:
    return min(settings.upkeep_interval_seconds, settings.reaper_interval_seconds)


JOBS = (
    Job("reap_leases", reap_leases, tick_seconds),
    Job("requeue_pending_shards", requeue_pending_shards, tick_seconds),
    Job("requeue_lost_responses", requeue_lost_responses, tick_seconds),
    # A dead process's spend reservations go back to their budgets.
    Job("release_reservations", lambda ctx: release_lapsed(ctx.session_factory), tick_seconds),
    Job("expire_batches", expire_batches, lambda s: s.reaper_interval_seconds),
    Job("redrive_finalization", redrive_finalization, lambda s: s.reaper_interval_seconds),
    Job("redrive_validation", redrive_validation, lambda s: s.validation_redrive_seconds),
    Job("sweep_webhooks", sweep_webhooks, lambda s: s.reaper_interval_seconds),
    Job("delete_expired_files", delete_expired_files, lambda s: s.reaper_interval_seconds),
    Job("apply_retention", apply_retention, lambda _: RETENTION_SECONDS),
)


def upkeep(ctx: WorkerContext) -> None:
    """One round: the jobs that are due, if no other process is running a round."""
    try:
        with upkeep_lock(ctx.session_factory) as held:
            if held:
                _run_due_jobs(ctx)
    except Exception as exc:
        if not is_transient(exc):
            raise
        logger.warning("upkeep skipped a round (%s); the next tick tries again", exc)


def _run_due_jobs(ctx: WorkerContext) -> None:
    last_runs = ctx.liveness.last_runs
    for job in JOBS:
        started = time.monotonic()
        # A little slack: a tick that fires a hair early must not skip a job for a whole period.
        if started - last_runs.get(job.name, -float("inf")) < job.period(ctx.settings) * 0.9:
            continue
        try:
            job.run(ctx)
        except Exception as exc:
            if is_transient(exc):  # the jobs after it would fail alike
                logger.warning("upkeep job %s failed (%s); retrying next tick", job.name, exc)
                return
            logger.exception("upkeep job %s failed", job.name)
        last_runs[job.name] = started


_process_locks: dict[str, threading.Lock] = {}
_process_locks_guard = threading.Lock()


@contextlib.contextmanager
def upkeep_lock(session_factory: sessionmaker[Session]) -> Iterator[bool]:
    """Yields whether this process holds the upkeep lock; if so, for the `with` block."""
    engine = session_factory.kw["bind"]
    if engine.dialect.name != "postgresql":
        with _process_locks_guard:
            lock = _process_locks.setdefault(str(engine.url), threading.Lock())
        held = lock.acquire(blocking=False)
        try:
            yield held
        finally:
            if held:
                lock.release()
        return
    conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    try:
        held = bool(conn.scalar(select(func.pg_try_advisory_lock(UPKEEP_LOCK_ID))))
        try:
            yield held
        finally:
            if held:
                _unlock(conn)
    finally:
        conn.close()


def _unlock(conn: Connection) -> None:
    try:
        conn.scalar(select(func.pg_advisory_unlock(UPKEEP_LOCK_ID)))
    except Exception:
        # A lock that cannot be released must not go back to the pool with its connection,
        # where this process would hold it for good: drop the connection, and the lock with it.
        conn.invalidate()
        raise

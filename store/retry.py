"""Riding out an outage of the services work depends on: the database, the broker and S3.

A restart of PostgreSQL, Redis or the S3 server shows up as a connection error for a few seconds.
Whatever drives work (a shard, validation, finalization, upkeep, webhook delivery) retries such
errors with exponential backoff and jitter instead of failing a batch or dying, and treats every
other exception as the bug or bad input it is.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

import sqlalchemy.exc

T = TypeVar("T")

logger = logging.getLogger(__name__)

# How long an operation keeps retrying before the error is let through: long enough for a
# database or broker restart, short enough that a real outage is reported.
DEFAULT_DEADLINE_SECONDS = 120.0
INITIAL_BACKOFF_SECONDS = 0.2
MAX_BACKOFF_SECONDS = 5.0


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` says a service could not be reached or dropped the connection, so the same
    operation may well succeed once it is back."""
    if isinstance(exc, sqlalchemy.exc.DBAPIError):
        # Lost connections and servers shutting down; not constraint or syntax errors.
        return exc.connection_invalidated or isinstance(
            exc, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError
        )
    if isinstance(exc, sqlalchemy.exc.TimeoutError):  # the connection pool is exhausted
        return True
    if isinstance(exc, ConnectionError | TimeoutError):  # OSError's, Python's own
        return True
    return _is_transient_client_error(exc)


def _is_transient_client_error(exc: BaseException) -> bool:
    # Imported here: each is a dependency of one deployment only.
    try:
        import botocore.exceptions as boto

        if isinstance(
            exc,
            boto.EndpointConnectionError
            | boto.ConnectionClosedError
            | boto.ReadTimeoutError
            | boto.ConnectTimeoutError,
        ):
            return True
        if isinstance(exc, boto.ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return status >= 500 or status == 429
    except ImportError:  # pragma: no cover - boto3 is a dependency
        pass
    try:
        import redis.exceptions

        if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
            return True
    except ImportError:  # pragma: no cover - redis is a dependency
        pass
    try:
        import kombu.exceptions

        if isinstance(exc, kombu.exceptions.OperationalError):
            return True
    except ImportError:  # pragma: no cover - celery brings kombu
        pass
    return False


def backoff(attempt: int) -> float:
    """Seconds to wait before retry number `attempt` (0 first): exponential, full jitter."""
    ceiling = min(MAX_BACKOFF_SECONDS, INITIAL_BACKOFF_SECONDS * 2**attempt)
    return random.uniform(ceiling / 2, ceiling)


def retrying(
    operation: Callable[[], T],
    what: str,
    deadline_seconds: float = DEFAULT_DEADLINE_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`operation()`, retried while it raises transient errors, for up to `deadline_seconds`.

    `operation` must be safe to run again after a failure part-way (a whole transaction, an
    idempotent write). `what` names it in the log lines.
    """
    give_up = time.monotonic() + deadline_seconds
    attempt = 0
    while True:
        try:
            return operation()
        except Exception as exc:
            if not is_transient(exc) or time.monotonic() >= give_up:
                raise
            delay = backoff(attempt)
            logger.warning("%s failed (%s); retrying in %.1f s", what, _brief(exc), delay)
            sleep(delay)
            attempt += 1


def _brief(exc: BaseException) -> str:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first_line}"[:200]

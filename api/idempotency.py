"""`Idempotency-Key` for creating POSTs.

The SDK retries a POST whose response it did not get (timeouts, connection errors, 5xx), and
OpenAI's SDK sends no idempotency header of its own, so without one a retry can create a second
resource. A client that sends a key gets, on every retry with the same key, the resource the first
attempt created. Keys are scoped by owner and route and kept for
`idempotency_key_retention_hours` (upkeep deletes them after); the request body is not
compared, so a key reused for a different request also gets the first resource.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import Header
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.store.db import transaction
from pagedbatch.store.models import IdempotencyKey

MAX_KEY_LENGTH = 256

# A route parameter: `idempotency_key: IdempotencyKeyHeader = None`.
IdempotencyKeyHeader = Annotated[str | None, Header(min_length=1, max_length=MAX_KEY_LENGTH)]


def find_resource(
    factory: sessionmaker[Session], *, owner: str, route: str, key: str
) -> str | None:
    """The id of the resource created earlier under `key`, if any."""
    with factory() as session:
        return session.scalar(
            select(IdempotencyKey.resource_id).where(
                IdempotencyKey.owner == owner,
                IdempotencyKey.route == route,
                IdempotencyKey.key == key,
            )
        )


def create_once(
    factory: sessionmaker[Session],
    *,
    owner: str,
    route: str,
    key: str | None,
    create: Callable[[Session], str],
) -> tuple[str, bool]:
    """Runs `create` (which adds the resource's rows and returns its id) in a transaction that
    also records `key`, unless a resource was created under `key` already.

    Returns the resource id and whether this call created it. When two attempts race, both may
    run `create`; the key's primary key lets only one commit, and the other gets the winner's id
    (and must undo any side effect outside the database, such as a stored blob).
    """
    if key is not None:
        earlier = find_resource(factory, owner=owner, route=route, key=key)
        if earlier is not None:
            return earlier, False
    try:
        with transaction(factory) as session:
            resource_id = create(session)
            if key is not None:
                session.add(
                    IdempotencyKey(owner=owner, route=route, key=key, resource_id=resource_id)
                )
    except IntegrityError:
        winner = None if key is None else find_resource(factory, owner=owner, route=route, key=key)
        if winner is None:
            raise
        return winner, False
    return resource_id, True

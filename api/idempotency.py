"""`Idempotency-Key` for creating POSTs.

The SDK retries a POST whose response it did not get (timeouts, connection errors, 5xx), and
OpenAI's SDK sends no idempotency header of its own, so without one a retry can create a second
resource. A client that sends a key gets, on every retry with the same key, the resource the first
attempt created. Keys are scoped by owner and route and kept for
`idempotency_key_retention_hours` (upkeep deletes them after).

Each key is stored with a fingerprint of the request that used it (its route and what its body
says: a batch's JSON, an upload's form fields, file name and file content). A retry is the same
request again: same key, same fingerprint. The same key with another fingerprint is a different
request reusing the key, a client's bug that would otherwise lose that request silently: it is
refused with a 422 `idempotency_key_reused`, as the IETF draft and payment APIs answer it. Keys
stored before fingerprints were (none recorded) match any request.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Annotated

from fastapi import Header
from sqlalchemy import Select, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.store.db import transaction
from pagedbatch.store.models import IdempotencyKey

MAX_KEY_LENGTH = 256

# A route parameter: `idempotency_key: IdempotencyKeyHeader = None`.
IdempotencyKeyHeader = Annotated[str | None, Header(min_length=1, max_length=MAX_KEY_LENGTH)]


def fingerprint(route: str, content: object) -> str:
    """The fingerprint of a request to `route` whose body says `content` (JSON-like: parsed
    JSON, or an upload's fields and its file's digest). Objects' key order does not count."""
    canonical = json.dumps([route, content], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def key_used(factory: sessionmaker[Session], *, owner: str, route: str, key: str) -> bool:
    """Whether a resource was created under `key` (for whatever request)."""
    with factory() as session:
        return session.scalar(_key_row(owner, route, key).exists().select()) or False


def _key_row(owner: str, route: str, key: str) -> Select[tuple[str, str | None]]:
    return select(IdempotencyKey.resource_id, IdempotencyKey.fingerprint).where(
        IdempotencyKey.owner == owner, IdempotencyKey.route == route, IdempotencyKey.key == key
    )


def find_resource(
    factory: sessionmaker[Session], *, owner: str, route: str, key: str, fingerprint: str
) -> str | None:
    """The id of the resource created earlier under `key`, if any; a 422 if that was for a
    request with another fingerprint."""
    with factory() as session:
        earlier = session.execute(_key_row(owner, route, key)).first()
    if earlier is None:
        return None
    resource_id, stored = earlier
    if stored is not None and stored != fingerprint:
        raise OpenAIError(
            f"The Idempotency-Key {key[:64]!r} was used for a different {route} request "
            f"(it created {resource_id}). Use a new key for a new request.",
            status_code=422,
            param="idempotency-key",
            code="idempotency_key_reused",
        )
    return resource_id


def create_once(
    factory: sessionmaker[Session],
    *,
    owner: str,
    route: str,
    key: str | None,
    fingerprint: str,
    create: Callable[[Session], str],
) -> tuple[str, bool]:
    """Runs `create` (which adds the resource's rows and returns its id) in a transaction that
    also records `key` with the request's `fingerprint`, unless a resource was created under
    `key` already (a 422 if for another request).

    Returns the resource id and whether this call created it. When two attempts race, both may
    run `create`; the key's primary key lets only one commit, and the other gets the winner's id,
    or the 422 (and must undo any side effect outside the database, such as a stored blob).
    """
    found = {"owner": owner, "route": route, "fingerprint": fingerprint}
    if key is not None:
        earlier = find_resource(factory, key=key, **found)
        if earlier is not None:
            return earlier, False
    try:
        with transaction(factory) as session:
            resource_id = create(session)
            if key is not None:
                session.add(IdempotencyKey(key=key, resource_id=resource_id, **found))
    except IntegrityError:
        winner = None if key is None else find_resource(factory, key=key, **found)
        if winner is None:
            raise
        return winner, False
    return resource_id, True

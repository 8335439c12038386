"""Stored responses: what `/v1/responses` keeps of a response created with `store` (OpenAI's
default), per tenant, until it expires; and the state machine of background responses.

Where stored responses live: a response is one row of `responses` (StoredResponse) holding three
JSON documents: the create request less its input, the input items (with the ids input_items
lists them by) and the Response object (as GET answers it). A request body may be as large as
`max_request_body_bytes` (megabytes, with images), so a document whose JSON is over
INLINE_BYTES is kept in the blob store instead (store/blobs.py: S3 or the data directory, as
batches keep their files), under `responses/<id>/<name>-<random>.json`, and the row's
`blob_keys` names it; the row holds only what lists and chains read cheaply.

Invariants:
- Each read and delete is its owner's: another tenant's response is as missing as one that never
  was. A response past its `expires_at` (its creation plus `response_retention_days`, stamped
  when it is saved; none with a retention of 0) is missing to every reader, before upkeep deletes
  it, row and blobs (workers/retention.py).
- A row never names a blob that is not there: blobs are written before the row that names them,
  and deleted after it (a crash between leaves an unnamed blob, never a broken row). A document
  rewritten (a background response's Response object, when it ends) goes to a new key, and the
  old one is deleted once the row names the new one; a rewrite that loses its race deletes its own.
- Status changes are compare-and-set (`UPDATE ... WHERE status IN (allowed sources)`), as a
  batch's (store/batches.py): queued → in_progress → completed | incomplete | failed, queued →
  failed (it could not start), queued | in_progress → cancelled. Entering an end records its
  `response.*` webhook event in the same transaction (store/webhooks.py). A response saved
  finished (not in the background) goes through no transition and has no event: OpenAI announces
  only background responses.
- The Response object's `status` is the row's: a change that brings no new object (to
  in_progress, to cancelled) changes what GET answers.
- A conversation (`previous_response_id`) is the chain of responses each names: their input items
  then output items, oldest first. The one named must be there and have ended; an earlier one
  that is gone (deleted, expired) ends the chain, which is then what remains.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import ColumnElement, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.ids import now
from pagedbatch.store.blobs import BlobStore
from pagedbatch.store.db import transaction
from pagedbatch.store.models import RESPONSE_TERMINAL, ResponseStatus, StoredResponse
from pagedbatch.store.webhooks import record_response_event

INLINE_BYTES = 64 * 1024  # a larger document goes to the blob store
DAY = 24 * 3600

S = ResponseStatus

# target -> the states it may be entered from
SOURCES: dict[ResponseStatus, set[ResponseStatus]] = {
    S.IN_PROGRESS: {S.QUEUED},
    S.COMPLETED: {S.IN_PROGRESS},
    S.INCOMPLETE: {S.IN_PROGRESS},
    S.FAILED: {S.QUEUED, S.IN_PROGRESS},
    S.CANCELLED: {S.QUEUED, S.IN_PROGRESS},
}
RUNNING = {S.QUEUED, S.IN_PROGRESS}


class ResponseNotFound(LookupError):
    """No such response of the caller's: never one, deleted, expired, or another tenant's."""

    def __init__(self, response_id: str) -> None:
        super().__init__(f"no stored response {response_id}")
        self.response_id = response_id


class ResponseNotFinished(ValueError):
    """A conversation cannot continue from a response that is still queued or running."""

    def __init__(self, response_id: str, status: str) -> None:
        super().__init__(f"response {response_id} is {status}")
        self.response_id = response_id
        self.status = status


class ItemNotFound(LookupError):
    """A pagination cursor that names no input item of the response."""

    def __init__(self, item_id: str) -> None:
        super().__init__(f"no input item {item_id}")
        self.item_id = item_id


@dataclass(frozen=True)
class ResponseRecord:
    """A response as stored: `body` is the Response object, whose `status` it is saved in."""

    id: str
    owner: str
    model: str
    created_at: int
    request: dict[str, Any]  # the create request; its input is not kept here
    input_items: list[dict[str, Any]]
    body: dict[str, Any]
    background: bool = False
    previous_response_id: str | None = None


def save_response(
    factory: sessionmaker[Session],
    blobs: BlobStore,
    record: ResponseRecord,
    retention_days: float,
) -> None:
    """Store `record` in its body's status: a finished response, or a background one `queued`
    (its body the placeholder GET answers until it ends). It expires `retention_days` after it
    was created (0: never)."""
    status = ResponseStatus(record.body["status"])
    documents = {
        "request": {name: value for name, value in record.request.items() if name != "input"},
        "input_items": record.input_items,
        "response": record.body,
    }
    inline, blob_keys = _put_documents(blobs, record.id, documents)
    try:
        with transaction(factory) as session:
            session.add(
                StoredResponse(
                    id=record.id,
                    owner=record.owner,
                    status=status.value,
                    model=record.model,
                    background=record.background,
                    previous_response_id=record.previous_response_id,
                    blob_keys=blob_keys or None,
                    error=record.body.get("error"),
                    created_at=record.created_at,
                    completed_at=now() if status in RESPONSE_TERMINAL else None,
                    expires_at=(
                        record.created_at + round(retention_days * DAY) if retention_days else None
                    ),
                    **inline,
                )
            )
    except BaseException:
        _delete_blobs(blobs, blob_keys.values())
        raise


def transition(
    session: Session,
    response_id: str,
    target: ResponseStatus,
    *conditions: ColumnElement[bool],
    **values: object,
) -> bool:
    """Move the response to `target` if its current state allows it (and `conditions` hold);
    False if it did not.

    Entering an end records its webhook event in the same transaction."""
    if target in RESPONSE_TERMINAL:
        values["completed_at"] = now()
    result = session.execute(
        update(StoredResponse)
        .where(
            StoredResponse.id == response_id,
            StoredResponse.status.in_([s.value for s in SOURCES[target]]),
            *conditions,
        )
        .values(status=target.value, **values)
    )
    moved = result.rowcount == 1
    if moved and target in RESPONSE_TERMINAL:
        record_response_event(session, response_id, target, created_at=values["completed_at"])
    return moved


def finish_response(
    factory: sessionmaker[Session],
    blobs: BlobStore,
    response_id: str,
    body: dict[str, Any],
    *conditions: ColumnElement[bool],
    then: Callable[[Session], None] | None = None,
) -> bool:
    """End a background response with its Response object `body`, in the body's status
    (completed, incomplete, failed), if `conditions` hold too (the runner still holds its
    lease); False if it had ended otherwise (cancelled, say), is gone, or they did not hold, and
    then nothing changed. `then` runs in the same transaction once it has ended so (its usage
    recorded, its spend settled)."""
    inline, blob_keys = _put_documents(blobs, response_id, {"response": body})
    replaced: list[str] = []
    moved = committed = False
    try:
        with transaction(factory) as session:
            kept = session.scalar(
                select(StoredResponse.blob_keys)
                .where(StoredResponse.id == response_id)
                .with_for_update()
            )
            kept = dict(kept or {})
            if "response" in kept:
                replaced.append(kept.pop("response"))
            moved = transition(
                session,
                response_id,
                ResponseStatus(body["status"]),
                *conditions,
                response=inline.get("response"),
                blob_keys={**kept, **blob_keys} or None,
                error=body.get("error"),
            )
            if moved and then is not None:
                then(session)
        committed = True
    finally:
        _delete_blobs(blobs, replaced if moved and committed else blob_keys.values())
    return moved


def load_response(session: Session, blobs: BlobStore, response_id: str) -> ResponseRecord | None:
    """The response whoever owns it, expired or not (for the process that runs it); None if
    it is gone. Its request is as created, its input the input items."""
    row = session.get(StoredResponse, response_id)
    if row is None:
        return None
    input_items = _document(blobs, row, "input_items")
    return ResponseRecord(
        id=row.id,
        owner=row.owner,
        model=row.model,
        created_at=row.created_at,
        request={**_document(blobs, row, "request"), "input": input_items},
        input_items=input_items,
        body=_body(blobs, row),
        background=row.background,
        previous_response_id=row.previous_response_id,
    )


def get_response(session: Session, blobs: BlobStore, owner: str, response_id: str) -> dict:
    """The owner's Response object, in its current status; ResponseNotFound if none."""
    return _body(blobs, _find(session, owner, response_id))


def delete_response(
    factory: sessionmaker[Session], blobs: BlobStore, owner: str, response_id: str
) -> None:
    """Delete the owner's response (and its webhook event, whose messages are then not sent);
    ResponseNotFound if none."""
    with transaction(factory) as session:
        row = _find(session, owner, response_id)
        blob_keys = list((row.blob_keys or {}).values())
        session.delete(row)
    _delete_blobs(blobs, blob_keys)


@dataclass(frozen=True)
class ItemPage:
    items: list[dict[str, Any]]
    has_more: bool


def list_input_items(
    session: Session,
    blobs: BlobStore,
    owner: str,
    response_id: str,
    limit: int,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> ItemPage:
    """A page of the owner's response's input items, `order` as they were given (`desc`: the
    last first), starting after the item `after` (ItemNotFound if it has none such)."""
    items = list(_document(blobs, _find(session, owner, response_id), "input_items"))
    if order == "desc":
        items.reverse()
    start = 0
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise ItemNotFound(after)
        start = ids.index(after) + 1
    return ItemPage(items[start : start + limit], has_more=len(items) > start + limit)


@dataclass
class Conversation:
    items: list[dict[str, Any]]  # each turn's input items then output items, oldest first
    whole: bool  # False: turns older than those read were left, past the bounds on reading


def conversation(
    session: Session,
    blobs: BlobStore,
    owner: str,
    previous_response_id: str,
    max_turns: int,
    max_bytes: int,
) -> Conversation:
    """The conversation up to and including the owner's response `previous_response_id` (see
    the module's invariants), or as much of it, newest first, as `max_turns` responses and
    `max_bytes` of their documents (as stored) hold: what one request may cost to read, however
    long the chain. ResponseNotFound if there is no such response, ResponseNotFinished if it
    has not ended."""
    row: StoredResponse | None = _find(session, owner, previous_response_id)
    if row.status in RUNNING:
        raise ResponseNotFinished(row.id, row.status)
    turns: list[list[dict[str, Any]]] = []
    read = 0
    while row is not None and len(turns) < max_turns:
        read += _stored_bytes(blobs, row, "input_items") + _stored_bytes(blobs, row, "response")
        if read > max_bytes:
            break
        turns.append(_document(blobs, row, "input_items") + _body(blobs, row)["output"])
        earlier = row.previous_response_id
        row = None if earlier is None else _visible(session, owner, earlier)
    items = [item for turn in reversed(turns) for item in turn]
    return Conversation(items, whole=row is None)


def expired() -> ColumnElement[bool]:
    """Which responses are past their expiry: missing to readers, due for deletion."""
    return StoredResponse.expires_at <= now()


def _visible(session: Session, owner: str, response_id: str) -> StoredResponse | None:
    return session.scalar(
        select(StoredResponse).where(
            StoredResponse.id == response_id,
            StoredResponse.owner == owner,
            or_(StoredResponse.expires_at.is_(None), ~expired()),
        )
    )


def _find(session: Session, owner: str, response_id: str) -> StoredResponse:
    row = _visible(session, owner, response_id)
    if row is None:
        raise ResponseNotFound(response_id)
    return row


def _body(blobs: BlobStore, row: StoredResponse) -> dict[str, Any]:
    return {**_document(blobs, row, "response"), "status": row.status}


def _stored_bytes(blobs: BlobStore, row: StoredResponse, name: str) -> int:
    """The size of a document as stored, without reading a blob (one in the row is small)."""
    key = (row.blob_keys or {}).get(name)
    if key is None:
        return len(json.dumps(getattr(row, name), separators=(",", ":")))
    return blobs.size(key)


def _document(blobs: BlobStore, row: StoredResponse, name: str) -> Any:
    key = (row.blob_keys or {}).get(name)
    if key is None:
        return getattr(row, name)
    with blobs.open(key) as chunks:
        return json.loads(b"".join(chunks))


def _put_documents(
    blobs: BlobStore, response_id: str, documents: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The documents small enough for the row (name -> document), and the keys of the blobs the
    others were written to (name -> key)."""
    inline: dict[str, Any] = {}
    blob_keys: dict[str, str] = {}
    try:
        for name, document in documents.items():
            data = json.dumps(document, separators=(",", ":")).encode()
            if len(data) <= INLINE_BYTES:
                inline[name] = document
                continue
            key = f"responses/{response_id}/{name}-{secrets.token_hex(4)}.json"
            blobs.put(key, [data])
            blob_keys[name] = key
    except BaseException:
        _delete_blobs(blobs, blob_keys.values())
        raise
    return inline, blob_keys


def _delete_blobs(blobs: BlobStore, keys: Iterable[str]) -> None:
    for key in keys:
        blobs.delete(key)

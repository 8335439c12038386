"""`POST /v1/files`: an upload streamed into blob storage and recorded as a File row.

The request body is parsed as it arrives (multipart.py) and handed to blob storage in 1 MiB
chunks, so nothing is spooled to a temporary file or held whole in memory: a 100 MB upload to
local storage raises the server's peak RSS by about 5 MB. Parsing and the blob write run in a
worker thread (blob stores block) that pulls request chunks from the event loop. Limits are
enforced while the bytes arrive, and a refused or broken upload leaves no blob.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import anyio
import anyio.from_thread
import anyio.to_thread
from fastapi import Request
from pydantic import ValidationError
from sqlalchemy.orm import Session
from starlette.requests import ClientDisconnect

from pagedbatch.api.deps import Services
from pagedbatch.api.files.lookup import get_file
from pagedbatch.api.files.multipart import (
    Event,
    PartStart,
    events,
    field_value,
    form_boundary,
    form_params,
    part_data,
)
from pagedbatch.api.files.schemas import FileCreateParams, FileObject
from pagedbatch.api.idempotency import create_once, find_resource, fingerprint, key_used
from pagedbatch.ids import new_id, now
from pagedbatch.protocol.errors import OpenAIError, from_validation_error
from pagedbatch.settings import DAY
from pagedbatch.store.models import File

CREATE_ROUTE = "POST /v1/files"
BATCH_FILE_EXPIRY_SECONDS = 30 * DAY
CHUNK_BYTES = 1 << 20  # what blob storage receives per write
# Form fields other than `file`: the form has three (purpose and expires_after's two), and each
# is held in memory until the upload ends, so their number is bounded too.
MAX_FORM_FIELDS = 8
MAX_FILENAME_LENGTH = 512  # File.filename's column


async def upload_file(
    request: Request, services: Services, owner: str, idempotency_key: str | None
) -> FileObject:
    """The File that `request`'s multipart body uploads for `owner`, stored and recorded; with
    `idempotency_key`, the File an earlier request with that key made, if there is one."""
    body = request.stream()

    async def next_chunk() -> bytes | None:
        try:
            return await anext(body)
        except StopAsyncIteration:
            return None

    def chunks() -> Iterator[bytes]:
        while (chunk := anyio.from_thread.run(next_chunk)) is not None:
            yield chunk

    upload = _Upload(services, owner, idempotency_key)
    try:
        boundary = form_boundary(request.headers.get("content-type"))
        # A client that leaves mid-upload raises ClientDisconnect through the blob write (which
        # then stores nothing) to the app's handler, which logs it as no error.
        return await anyio.to_thread.run_sync(
            upload.run, chunks(), boundary, limiter=services.upload_threads
        )
    finally:
        # A response sent while the client is still sending is often lost to a reset, which
        # the SDK would retry; reading the rest first lets the client see the error.
        await _drain(body)


async def _drain(body: AsyncIterator[bytes]) -> None:
    with contextlib.suppress(ClientDisconnect):
        async for _ in body:
            pass


def _in_chunks(data: Iterator[bytes], limit: int) -> Iterator[bytes]:
    """`data` regrouped into CHUNK_BYTES pieces; fails once more than `limit` bytes came."""
    size = 0
    buffer = bytearray()
    for piece in data:
        size += len(piece)
        if size > limit:
            raise _too_large(limit)
        buffer += piece
        if len(buffer) >= CHUNK_BYTES:
            yield bytes(buffer)
            buffer.clear()
    if buffer:
        yield bytes(buffer)


def _hashed(data: Iterator[bytes], digest: hashlib._Hash) -> Iterator[bytes]:
    for piece in data:
        digest.update(piece)
        yield piece


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        f"The file is too large: the limit for this purpose is {limit} bytes.",
        param="file",
        code="file_too_large",
    )


@dataclass
class _Received:
    fields: dict[str, str]
    filename: str
    size: int
    digest: str  # sha256 hex of the file's bytes

    def fingerprint(self) -> str:
        """What this upload said, for its idempotency key: fields, file name and content."""
        content = {"fields": self.fields, "filename": self.filename, "sha256": self.digest}
        return fingerprint(CREATE_ROUTE, content)


class _Upload:
    """One `POST /v1/files`, run in a worker thread: receive, store, record."""

    def __init__(self, services: Services, owner: str, idempotency_key: str | None) -> None:
        self.services = services
        self.owner = owner
        self.idempotency_key = idempotency_key
        self.file_id = new_id("file-")
        self.storage_key = f"files/{self.file_id}"

    def run(self, chunks: Iterator[bytes], boundary: bytes) -> FileObject:
        factory = self.services.session_factory
        key = self.idempotency_key
        if key is not None and key_used(factory, owner=self.owner, route=CREATE_ROUTE, key=key):
            return self._replay(key, events(chunks, boundary))
        try:
            received = self._receive(events(chunks, boundary), store=True)
            row = self._row(received)
            file_id, created = create_once(
                factory,
                owner=self.owner,
                route=CREATE_ROUTE,
                key=key,
                fingerprint=received.fingerprint(),
                create=lambda session: _add(session, row),
            )
        except BaseException:
            self.services.blobs.delete(self.storage_key)
            raise
        if not created:  # a concurrent retry with the same key won
            self.services.blobs.delete(self.storage_key)
        return self._file(file_id)

    def _replay(self, key: str, stream: Iterator[Event]) -> FileObject:
        """The File made under `key` before, if this is the same upload again (a 422 if it is
        another). The body is read to compare it, not stored again."""
        received = self._receive(stream, store=False)
        earlier = find_resource(
            self.services.session_factory,
            owner=self.owner,
            route=CREATE_ROUTE,
            key=key,
            fingerprint=received.fingerprint(),
        )
        if earlier is None:  # the key expired while the body came in; the SDK retries a 409
            raise OpenAIError(
                "The Idempotency-Key expired during the upload. Please retry.",
                status_code=409,
                param="idempotency-key",
                code="idempotency_key_expired",
            )
        return self._file(earlier)

    def _receive(self, stream: Iterator[Event], *, store: bool) -> _Received:
        """The form, with the file stored under `storage_key` if `store` (else only read)."""
        fields: dict[str, str] = {}
        stored: tuple[str, int] | None = None
        digest = hashlib.sha256()
        for event in stream:
            if not isinstance(event, PartStart):
                continue
            if event.name in fields or (event.name == "file" and stored is not None):
                raise OpenAIError(
                    f"'{event.name}' was sent twice.", param=event.name, code="invalid_value"
                )
            if event.name != "file":
                if len(fields) == MAX_FORM_FIELDS:
                    raise OpenAIError(
                        f"Too many form fields: an upload takes at most {MAX_FORM_FIELDS} besides "
                        "the file.",
                        param=event.name,
                        code="too_many_fields",
                    )
                fields[event.name] = field_value(event.name, stream)
                continue
            filename = event.filename or "file"
            # A purpose sent before the file (the SDK's order) lets its limits apply as the file
            # streams in; one sent after is checked once the file is stored.
            limit = self._check_file(fields.get("purpose"), filename, size=0)
            data = _in_chunks(_hashed(part_data(stream), digest), limit)
            if store:
                size = self.services.blobs.put(self.storage_key, data)
            else:
                size = sum(len(chunk) for chunk in data)
            stored = filename, size
        if stored is None:
            raise OpenAIError(
                "Missing required parameter: 'file'.",
                param="file",
                code="missing_required_parameter",
            )
        filename, size = stored
        return _Received(fields, filename, size, digest.hexdigest())

    def _check_file(self, purpose: str | None, filename: str, *, size: int) -> int:
        """Raises if the file breaks a limit of `purpose`; returns its byte limit."""
        settings = self.services.settings
        if len(filename) > MAX_FILENAME_LENGTH:
            raise OpenAIError("The file name is too long.", param="file")
        if "\x00" in filename:  # PostgreSQL text cannot hold it
            raise OpenAIError("The file name contains a NUL character.", param="file")
        limit = settings.max_upload_bytes
        if purpose == "batch":
            limit = min(limit, settings.max_batch_file_bytes)
            if not filename.endswith(".jsonl"):
                raise OpenAIError(
                    f"Invalid file format for Batch API: '{filename}'. Must be .jsonl",
                    param="file",
                    code="invalid_file_format",
                )
        if size > limit:
            raise _too_large(limit)
        return limit

    def _row(self, received: _Received) -> File:
        data = form_params(received.fields)
        try:
            params = FileCreateParams.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc, data) from None
        self._check_file(params.purpose, received.filename, size=received.size)
        created_at = now()
        if params.expires_after is not None:
            expires_at: int | None = created_at + params.expires_after.seconds
        elif params.purpose == "batch":
            expires_at = created_at + BATCH_FILE_EXPIRY_SECONDS
        else:
            expires_at = None
        return File(
            id=self.file_id,
            owner=self.owner,
            filename=received.filename,
            purpose=params.purpose,
            bytes=received.size,
            created_at=created_at,
            expires_at=expires_at,
            status="processed",
            storage_key=self.storage_key,
        )

    def _file(self, file_id: str) -> FileObject:
        with self.services.session_factory() as session:
            return FileObject.model_validate(get_file(session, self.owner, file_id))


def _add(session: Session, row: File) -> str:
    session.add(row)
    return row.id

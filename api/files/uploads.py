"""`POST /v1/files`: an upload streamed into blob storage and recorded as a File row.

The request body is parsed as it arrives (multipart.py) and handed to blob storage in 1 MiB
chunks, so nothing is spooled to a temporary file or held whole in memory: a 100 MB upload to
local storage raises the server's peak RSS by about 5 MB. Parsing and the blob write run in a
worker thread (blob stores block) that pulls request chunks from the event loop. Limits are
enforced while the bytes arrive, and a refused or broken upload leaves no blob.
"""

from __future__ import annotations

import contextlib
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
from pagedbatch.api.idempotency import create_once, find_resource
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
        return await anyio.to_thread.run_sync(
            upload.run, chunks(), boundary, limiter=services.upload_threads
        )
    except ClientDisconnect:
        # Nobody is left to read this; it only keeps the server from logging a failure.
        raise OpenAIError("The client disconnected during the upload.") from None
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
        if self.idempotency_key is not None:
            earlier = find_resource(
                factory, owner=self.owner, route=CREATE_ROUTE, key=self.idempotency_key
            )
            if earlier is not None:
                return self._file(earlier)
        try:
            received = self._receive(events(chunks, boundary))
            row = self._row(received)
            file_id, created = create_once(
                factory,
                owner=self.owner,
                route=CREATE_ROUTE,
                key=self.idempotency_key,
                create=lambda session: _add(session, row),
            )
        except BaseException:
            self.services.blobs.delete(self.storage_key)
            raise
        if not created:  # a concurrent retry with the same key won
            self.services.blobs.delete(self.storage_key)
        return self._file(file_id)

    def _receive(self, stream: Iterator[Event]) -> _Received:
        fields: dict[str, str] = {}
        stored: tuple[str, int] | None = None
        for event in stream:
            if not isinstance(event, PartStart):
                continue
            if event.name in fields or (event.name == "file" and stored is not None):
                raise OpenAIError(f"'{event.name}' was sent twice.", param=event.name)
            if event.name != "file":
                if len(fields) == MAX_FORM_FIELDS:
                    raise OpenAIError(
                        f"Too many form fields: an upload takes at most {MAX_FORM_FIELDS} besides "
                        "the file.",
                        param=event.name,
                    )
                fields[event.name] = field_value(event.name, stream)
                continue
            filename = event.filename or "file"
            # A purpose sent before the file (the SDK's order) lets its limits apply as the file
            # streams in; one sent after is checked once the file is stored.
            limit = self._check_file(fields.get("purpose"), filename, size=0)
            size = self.services.blobs.put(self.storage_key, _in_chunks(part_data(stream), limit))
            stored = filename, size
        if stored is None:
            raise OpenAIError(
                "Missing required parameter: 'file'.",
                param="file",
                code="missing_required_parameter",
            )
        filename, size = stored
        return _Received(fields, filename, size)

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

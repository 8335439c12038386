"""The Files API: upload, list, retrieve, download and delete files.

Uploads are parsed from the request stream with python-multipart's push parser and handed to
blob storage in 1 MiB chunks, so nothing is spooled to a temporary file or held whole in memory:
a 100 MB upload to local storage raises the server's peak RSS by about 5 MB. Parsing and the
blob write run in a worker thread (blob stores block) that pulls request chunks from the event
loop. Limits are enforced while the bytes arrive, and a refused or broken upload leaves no blob.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

import anyio
import anyio.from_thread
import anyio.to_thread
from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from sqlalchemy import ColumnElement, or_, select, tuple_
from sqlalchemy.orm import Session
from starlette.requests import ClientDisconnect

from pagedbatch.api.auth import OwnerDep
from pagedbatch.api.deps import Services, ServicesDep, SessionDep
from pagedbatch.api.files.schemas import (
    MAX_EXPIRY_SECONDS,
    MIN_EXPIRY_SECONDS,
    FileCreateParams,
    FileDeleted,
    FileObject,
    UploadPurpose,
)
from pagedbatch.api.idempotency import IdempotencyKeyHeader, create_once, find_resource
from pagedbatch.api.lists import ListPage
from pagedbatch.api.routes.openapi import error_responses
from pagedbatch.ids import new_id, now
from pagedbatch.protocol.errors import OpenAIError, from_validation_error
from pagedbatch.settings import DAY
from pagedbatch.store.models import File

router = APIRouter(prefix="/files", tags=["files"])

CREATE_ROUTE = "POST /v1/files"
BATCH_FILE_EXPIRY_SECONDS = 30 * DAY
CHUNK_BYTES = 1 << 20  # what blob storage receives per write
MAX_FIELD_BYTES = 64 << 10  # a form field other than `file`
# Form fields other than `file`: the form has three (purpose and expires_after's two), and each
# is held in memory until the upload ends, so their number is bounded too.
MAX_FORM_FIELDS = 8
MAX_FILENAME_LENGTH = 512  # File.filename's column
MAX_BOUNDARY_LENGTH = 70  # RFC 2046's bound on a multipart boundary


def get_file(session: Session, owner: str, file_id: str, *, param: str = "file_id") -> File:
    """`owner`'s file `file_id`; a 404 if there is none, it is another owner's, or it expired."""
    row = session.scalar(select(File).where(File.id == file_id, File.owner == owner, _live()))
    if row is None:
        raise OpenAIError(
            f"No such File object: {file_id}", status_code=404, param=param, code="not_found"
        )
    return row


def _live() -> ColumnElement[bool]:
    # An expired file counts as deleted even before the reaper removes it.
    return or_(File.expires_at.is_(None), File.expires_at > now())


_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    # expires_after comes whole or not at all.
                    "dependentRequired": {
                        "expires_after[anchor]": ["expires_after[seconds]"],
                        "expires_after[seconds]": ["expires_after[anchor]"],
                    },
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(get_args(UploadPurpose))},
                        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                        "expires_after[seconds]": {
                            "type": "integer",
                            "minimum": MIN_EXPIRY_SECONDS,
                            "maximum": MAX_EXPIRY_SECONDS,
                        },
                    },
                }
            }
        },
    }
}


@router.post("", openapi_extra=_UPLOAD_BODY)
async def create_file(
    request: Request,
    owner: OwnerDep,
    services: ServicesDep,
    idempotency_key: IdempotencyKeyHeader = None,
) -> FileObject:
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
        boundary = _boundary(request.headers.get("content-type"))
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


def _boundary(content_type: str | None) -> bytes:
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary", b"")
    if kind != b"multipart/form-data" or not 1 <= len(boundary) <= MAX_BOUNDARY_LENGTH:
        raise OpenAIError(
            "Expected a multipart/form-data body with a boundary of 1 to "
            f"{MAX_BOUNDARY_LENGTH} characters."
        )
    return boundary


async def _drain(body: AsyncIterator[bytes]) -> None:
    with contextlib.suppress(ClientDisconnect):
        async for _ in body:
            pass


@dataclass
class _PartStart:
    name: str
    filename: str | None


class _PartEnd:
    pass


_Event = _PartStart | bytes | _PartEnd


def _events(chunks: Iterator[bytes], boundary: bytes) -> Iterator[_Event]:
    """The multipart body as a flat stream: each part's start, its data, its end."""
    pending: list[_Event] = []
    header_name = bytearray()
    header_value = bytearray()
    disposition = bytearray()
    finished = False

    def on_header_end() -> None:
        if header_name.lower() == b"content-disposition":
            disposition[:] = header_value
        header_name.clear()
        header_value.clear()

    def on_headers_finished() -> None:
        _, options = parse_options_header(bytes(disposition))
        disposition.clear()
        if b"name" not in options:
            raise OpenAIError("A multipart part has no name in its Content-Disposition.")
        filename = options.get(b"filename")
        pending.append(
            _PartStart(
                options[b"name"].decode(errors="replace"),
                None if filename is None else filename.decode(errors="replace"),
            )
        )

    def on_end() -> None:
        nonlocal finished
        finished = True

    parser = MultipartParser(
        boundary,
        {
            "on_header_field": lambda data, start, end: header_name.extend(data[start:end]),
            "on_header_value": lambda data, start, end: header_value.extend(data[start:end]),
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": lambda data, start, end: pending.append(data[start:end]),
            "on_part_end": lambda: pending.append(_PartEnd()),
            "on_end": on_end,
        },
    )
    for chunk in chunks:
        try:
            parser.write(chunk)
        except MultipartParseError as exc:
            raise OpenAIError(f"The multipart body is malformed: {exc}") from None
        yield from pending
        pending.clear()
    if not finished:
        # Raised into the blob write too, so a truncated upload is never stored.
        raise OpenAIError("The multipart body ended before its closing boundary.")


def _part_data(events: Iterator[_Event]) -> Iterator[bytes]:
    for event in events:
        if isinstance(event, _PartEnd):
            return
        if isinstance(event, bytes):
            yield event


def _field_value(name: str, events: Iterator[_Event]) -> str:
    value = bytearray()
    for data in _part_data(events):
        value += data
        if len(value) > MAX_FIELD_BYTES:
            raise OpenAIError(f"The form field '{name}' is too long.", param=name)
    return value.decode(errors="replace")


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


def _form_params(fields: dict[str, str]) -> dict[str, Any]:
    """Form fields as the JSON-like dict they encode: `expires_after[seconds]` nests."""
    data: dict[str, Any] = {}
    for name, value in fields.items():
        outer, bracket, inner = name.partition("[")
        group = data.setdefault(outer, {}) if bracket and inner.endswith("]") else None
        if isinstance(group, dict):
            group[inner[:-1]] = value
        else:
            data[name] = value
    return data


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
            received = self._receive(_events(chunks, boundary))
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

    def _receive(self, events: Iterator[_Event]) -> _Received:
        fields: dict[str, str] = {}
        stored: tuple[str, int] | None = None
        for event in events:
            if not isinstance(event, _PartStart):
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
                fields[event.name] = _field_value(event.name, events)
                continue
            filename = event.filename or "file"
            # A purpose sent before the file (the SDK's order) lets its limits apply as the file
            # streams in; one sent after is checked once the file is stored.
            limit = self._check_file(fields.get("purpose"), filename, size=0)
            size = self.services.blobs.put(self.storage_key, _in_chunks(_part_data(events), limit))
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
        data = _form_params(received.fields)
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


@router.get("")
def list_files(
    session: SessionDep,
    owner: OwnerDep,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> ListPage[FileObject]:
    query = select(File).where(File.owner == owner, _live())
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    # Ties on created_at (one-second resolution) are broken by id, so pages never overlap.
    keys = [File.created_at, File.id]
    if order == "desc":
        keys = [key.desc() for key in keys]
    if after is not None:
        query = query.where(_beyond(session, owner, after, order))
    rows = session.scalars(query.order_by(*keys).limit(limit + 1)).all()
    return ListPage[FileObject].from_rows(rows, limit, FileObject.model_validate)


def _beyond(session: Session, owner: str, after: str, order: str) -> ColumnElement[bool]:
    """Files that come after the cursor file `after` in `order`."""
    cursor = session.scalar(select(File).where(File.id == after, File.owner == owner))
    if cursor is None:
        raise OpenAIError(f"No such File object: {after}", param="after", code="invalid_value")
    position = tuple_(File.created_at, File.id)
    if order == "asc":
        return position > tuple_(cursor.created_at, cursor.id)
    return position < tuple_(cursor.created_at, cursor.id)


@router.get("/{file_id}", responses=error_responses(404))
def retrieve_file(file_id: str, session: SessionDep, owner: OwnerDep) -> FileObject:
    return FileObject.model_validate(get_file(session, owner, file_id))


# The bytes as stored, whatever the file holds; not JSON, which FastAPI would assume.
_CONTENT_RESPONSE = {
    200: {
        "description": "The file's bytes.",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={**_CONTENT_RESPONSE, **error_responses(404)},
)
def file_content(
    file_id: str, session: SessionDep, owner: OwnerDep, services: ServicesDep
) -> StreamingResponse:
    row = get_file(session, owner, file_id)
    return StreamingResponse(
        services.blobs.open(row.storage_key),
        media_type="application/octet-stream",
        headers={"content-length": str(row.bytes)},
    )


@router.delete("/{file_id}", responses=error_responses(404))
def delete_file(
    file_id: str, session: SessionDep, owner: OwnerDep, services: ServicesDep
) -> FileDeleted:
    row = get_file(session, owner, file_id)
    session.delete(row)
    session.commit()
    # After the commit: a failure here leaves an orphaned blob, never a row without its bytes.
    services.blobs.delete(row.storage_key)
    return FileDeleted(id=file_id)

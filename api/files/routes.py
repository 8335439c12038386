"""The Files API: upload (uploads.py), list, retrieve, download and delete files."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import ColumnElement, select, tuple_
from sqlalchemy.orm import Session

from pagedbatch.api.auth import OwnerDep
from pagedbatch.api.deps import ServicesDep, SessionDep
from pagedbatch.api.files.lookup import get_file, live
from pagedbatch.api.files.schemas import (
    MAX_EXPIRY_SECONDS,
    MIN_EXPIRY_SECONDS,
    FileDeleted,
    FileObject,
    UploadPurpose,
)
from pagedbatch.api.files.uploads import upload_file
from pagedbatch.api.idempotency import IdempotencyKeyHeader
from pagedbatch.api.lists import ListPage, unknown_cursor
from pagedbatch.api.routes.openapi import error_responses
from pagedbatch.store.models import File

router = APIRouter(prefix="/files", tags=["files"])

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
    return await upload_file(request, services, owner, idempotency_key)


@router.get("")
def list_files(
    session: SessionDep,
    owner: OwnerDep,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> ListPage[FileObject]:
    query = select(File).where(File.owner == owner, live())
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
        raise unknown_cursor("File object", after)
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

"""A tenant's files as every route finds them: its own, and only while they live."""

from __future__ import annotations

from sqlalchemy import ColumnElement, or_, select
from sqlalchemy.orm import Session

from pagedbatch.ids import now
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.store.models import File


def get_file(session: Session, owner: str, file_id: str, *, param: str = "file_id") -> File:
    """`owner`'s file `file_id`; a 404 if there is none, it is another owner's, or it expired."""
    row = session.scalar(select(File).where(File.id == file_id, File.owner == owner, live()))
    if row is None:
        raise OpenAIError(
            f"No such File object: {file_id}", status_code=404, param=param, code="not_found"
        )
    return row


def live() -> ColumnElement[bool]:
    """Files not expired. An expired file counts as deleted even before the reaper removes it."""
    return or_(File.expires_at.is_(None), File.expires_at > now())

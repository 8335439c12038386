"""The list envelope OpenAI's cursor-paged endpoints share (`/v1/files`, `/v1/batches`, ...), and
their one answer to an `after` cursor that names nothing of the caller's: a 400 naming `after`
(the request is wrong; a 404 would say the list itself is missing)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, Literal, Self, TypeVar

from pydantic import BaseModel

from pagedbatch.protocol.errors import OpenAIError

Item = TypeVar("Item", bound=BaseModel)
Row = TypeVar("Row")


class ListPage(BaseModel, Generic[Item]):
    """One page. The SDK asks for the next one with `after=last_id` while `has_more` is true."""

    object: Literal["list"] = "list"
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def from_rows(cls, rows: Sequence[Row], limit: int, to_item: Callable[[Row], Item]) -> Self:
        """The page for `rows` fetched with `LIMIT limit + 1`: an extra row only says that there
        is more, which spares a COUNT query. Every item has an `id`."""
        data = [to_item(row) for row in rows[:limit]]
        return cls(
            data=data,
            first_id=getattr(data[0], "id", None) if data else None,
            last_id=getattr(data[-1], "id", None) if data else None,
            has_more=len(rows) > limit,
        )


def unknown_cursor(kind: str, after: str) -> OpenAIError:
    """The 400 for an `after` cursor that is not one of the caller's `kind` (a deleted or
    another tenant's object included)."""
    return OpenAIError(
        f"Invalid value for 'after': no such {kind}: {after}",
        param="after",
        code="invalid_value",
    )

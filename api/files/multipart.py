"""A multipart/form-data body read as it arrives, with python-multipart's push parser.

The body becomes a flat stream of events (each part's start, its data, its end), so a file part
can be passed on piece by piece and nothing is spooled or held whole; only form fields other
than the file are held, each up to MAX_FIELD_BYTES. A malformed or truncated body is an
OpenAIError (400) raised from the stream, so whoever is consuming it (a blob write) fails too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from pagedbatch.protocol.errors import OpenAIError

MAX_FIELD_BYTES = 64 << 10  # a form field other than `file`
MAX_BOUNDARY_LENGTH = 70  # RFC 2046's bound on a multipart boundary
INVALID_FORM = "invalid_multipart"  # the code of a body that is no well-formed form


def form_boundary(content_type: str | None) -> bytes:
    """The boundary a multipart/form-data `content_type` declares; a 400 for any other body."""
    kind, options = parse_options_header(content_type)
    found = options.get(b"boundary", b"")
    if kind != b"multipart/form-data" or not 1 <= len(found) <= MAX_BOUNDARY_LENGTH:
        raise OpenAIError(
            "Expected a multipart/form-data body with a boundary of 1 to "
            f"{MAX_BOUNDARY_LENGTH} characters.",
            code=INVALID_FORM,
        )
    return found


@dataclass
class PartStart:
    name: str
    filename: str | None


class PartEnd:
    pass


Event = PartStart | bytes | PartEnd


def events(chunks: Iterator[bytes], boundary: bytes) -> Iterator[Event]:
    """The multipart body as a flat stream: each part's start, its data, its end."""
    pending: list[Event] = []
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
            raise OpenAIError(
                "A multipart part has no name in its Content-Disposition.", code=INVALID_FORM
            )
        filename = options.get(b"filename")
        pending.append(
            PartStart(
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
            "on_part_end": lambda: pending.append(PartEnd()),
            "on_end": on_end,
        },
    )
    for chunk in chunks:
        try:
            parser.write(chunk)
        except MultipartParseError as exc:
            raise OpenAIError(
                f"The multipart body is malformed: {exc}", code=INVALID_FORM
            ) from None
        yield from pending
        pending.clear()
    if not finished:
        # Raised into the blob write too, so a truncated upload is never stored.
        raise OpenAIError(
            "The multipart body ended before its closing boundary.", code=INVALID_FORM
        )


def part_data(stream: Iterator[Event]) -> Iterator[bytes]:
    """The data of the part `stream` has just started, up to its end."""
    for event in stream:
        if isinstance(event, PartEnd):
            return
        if isinstance(event, bytes):
            yield event


def field_value(name: str, stream: Iterator[Event]) -> str:
    """The value of the form field `name`, the part `stream` has just started; a 400 past
    MAX_FIELD_BYTES."""
    value = bytearray()
    for data in part_data(stream):
        value += data
        if len(value) > MAX_FIELD_BYTES:
            raise OpenAIError(f"The form field '{name}' is too long.", param=name)
    return value.decode(errors="replace")


def form_params(fields: dict[str, str]) -> dict[str, Any]:
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

"""Request bodies: their size limits, and JSON decoding.

A body beyond its route's limit is a 413, found as it streams in.

A declared Content-Length beyond the limit is refused before a byte of the body is read; a body
without one (chunked) is refused as soon as it passes the limit. Either way the route never sees
more than the limit, so nothing beyond it is buffered, parsed or tokenized. JSON routes take
`max_request_body_bytes`; a transcription's form, its file's `max_audio_bytes` and a little
more. An upload (`POST /v1/files`) is bounded by its route instead, part by part as it streams
in: the file by `max_upload_bytes` (a 400 `file_too_large` naming `file`), the form fields in
number and size.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedbatch.api.errors import BodyTooLarge
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.common import TOO_DEEP
from pagedbatch.settings import Settings

UPLOAD_PATH = "/v1/files"
# A transcription's form: a file of up to `max_audio_bytes` and its few fields.
TRANSCRIPTION_PATH = "/v1/audio/transcriptions"
FORM_BYTES = 1 << 20
# What is read and thrown away after a refusal, so that the client, which sends its whole body
# before it reads the response, gets the 413 rather than a reset connection; past this the
# connection is cut.
DRAIN_BYTES = 64 << 20


def body_limit(settings: Settings) -> Callable[[Scope], int | None]:
    """The body limit of each request, by its route; None for an upload, which has its own."""
    transcription = max(settings.max_request_body_bytes, settings.max_audio_bytes + FORM_BYTES)

    def limit(scope: Scope) -> int | None:
        path = scope["path"].rstrip("/")
        if scope["method"] == "POST" and path == UPLOAD_PATH:
            return None
        if scope["method"] == "POST" and path == TRANSCRIPTION_PATH:
            return transcription
        return settings.max_request_body_bytes

    return limit


def decode_json(raw: bytes) -> object:
    """A request body as JSON (None when empty); a 400 if it is not JSON.

    NaN and Infinity, which Python's parser takes, pass: the schemas refuse them naming the field.
    """
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:  # UnicodeDecodeError is one
        problem = "it is not valid JSON"
    except RecursionError:
        problem = TOO_DEEP
    raise OpenAIError(
        f"We could not parse the JSON body of your request: {problem}.", code="invalid_json"
    )


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, limit: Callable[[Scope], int | None]) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limit(scope) if scope["type"] == "http" else None
        if limit is None:
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            error = BodyTooLarge(limit)
            await _send_error(error, send)
            await _drain(receive)
            return
        received = 0
        refused = False

        async def limited_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    refused = True
                    # An HTTPException: FastAPI's own body parsing passes those on to the
                    # app's handler (api/app.py), which answers the 413.
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)
        if refused:
            await _drain(receive)


async def _send_error(error: BodyTooLarge, send: Send) -> None:
    body = json.dumps(error.openai().body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status_code,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive) -> None:
    drained = 0
    while drained <= DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return

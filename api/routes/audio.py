"""`/v1/audio/transcriptions`: an audio file in (multipart, as OpenAI's), its text out."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request, Response

from pagedbatch.api.deps import ServicesDep
from pagedbatch.api.files.multipart import PartStart, events, field_value, form_boundary, part_data
from pagedbatch.api.realtime import answer
from pagedbatch.api.routes.openapi import error_responses, form_body
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.audio import Transcription, TranscriptionRequest
from pagedbatch.protocol.serving.common import parse_request
from pagedbatch.protocol.serving.transcription import prepare_transcription

router = APIRouter(prefix="/audio", tags=["audio"])

MAX_FIELDS = 16  # form fields besides the file: OpenAI's form has ten


def form_parser(content_type: str | None) -> Callable[[bytes], TranscriptionRequest]:
    """The parser of a transcription form whose body `content_type` describes."""
    boundary = form_boundary(content_type)

    def parse(raw: bytes) -> TranscriptionRequest:
        fields: dict[str, object] = {}
        stream = events(iter([raw]), boundary)
        for event in stream:
            if not isinstance(event, PartStart):
                continue
            if event.name == "file":
                fields["file"] = b"".join(part_data(stream))
            elif len(fields) >= MAX_FIELDS:
                raise OpenAIError(f"The form has more than {MAX_FIELDS} fields.")
            else:
                fields[event.name] = field_value(event.name, stream)
        if "file" not in fields:
            raise OpenAIError("The form has no 'file' part.", param="file")
        return parse_request(TranscriptionRequest, fields)

    return parse


@router.post(
    "/transcriptions",
    response_model=None,
    responses={
        200: {"model": Transcription, "content": {"text/plain": {"schema": {"type": "string"}}}},
        **error_responses(404),
    },
    openapi_extra=form_body(TranscriptionRequest),
)
async def create_transcription(request: Request, services: ServicesDep) -> Response:
    parse = form_parser(request.headers.get("content-type"))
    return await answer(request, services, parse, prepare_transcription)

"""A chat request's images and audio clips, decoded and made ready for the engine.

Counts are checked before anything is decoded, and a part the model cannot take is refused
before the others are; each failure is a 400 naming the part. Fetching (of http(s) image URLs,
all within one deadline) and decoding run on the caller's thread (the doors call
`prepare_chat` off the event loop and off the engine's thread).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedbatch.engine.multimodal.inputs import MediaItem, Modality, ProcessedMedia, place
from pagedbatch.protocol.audio import decode_base64_audio
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.images import decode_image_url, open_image, process_image
from pagedbatch.protocol.media_fetch import fetch_all, is_remote
from pagedbatch.protocol.schemas.chat import AudioPart, ChatMessage, ImagePart
from pagedbatch.protocol.schemas.responses import InputImagePart
from pagedbatch.protocol.serving.common import ServedModel

PART_MODALITY: dict[type, Modality] = {ImagePart: "image", AudioPart: "audio"}


def takes(served: ServedModel) -> frozenset[Modality]:
    """The modalities besides text that the served model reads."""
    processors = (served.image_processor, served.audio_processor)
    return frozenset(p.spec.modality for p in processors if p is not None)


def place_media(
    prompt: list[int], media: list[ProcessedMedia], served: ServedModel
) -> tuple[list[int], tuple[MediaItem, ...]]:
    """The prompt with the media's placeholders expanded, and the items; 400 if the messages'
    text itself holds a placeholder token."""
    processors = (served.image_processor, served.audio_processor)
    try:
        ids, items = place(prompt, media, [p.spec.token_id for p in processors if p is not None])
    except ValueError as e:
        raise OpenAIError(
            f"The messages' text may not hold the model's media placeholders ({e}).",
            param="messages",
        ) from None
    return ids, tuple(items)


def fetches_media(request: object) -> bool:
    """Whether preparing the request fetches anything: a chat request, or a Responses request's
    input, with an http(s) image URL (which the doors prepare on threads of their own, as it
    waits on other hosts). The earlier turns a `previous_response_id` continues are not seen
    here: an image URL of theirs is fetched on the ordinary preparation threads."""
    messages: Sequence[ChatMessage] = getattr(request, "messages", None) or ()
    items = getattr(request, "input", None)
    return any(
        isinstance(part, ImagePart) and is_remote(part.image_url.url)
        for message in messages
        if isinstance(message.content, list)
        for part in message.content
    ) or any(
        isinstance(part, InputImagePart) and is_remote(part.image_url or "")
        for item in (items if isinstance(items, list) else ())
        if isinstance(getattr(item, "content", None), list)
        for part in item.content
    )


def decode_media(messages: Sequence[ChatMessage], served: ServedModel) -> list[ProcessedMedia]:
    """The messages' images and clips, decoded and processed, images first, each modality in
    message order (the order `multimodal.place` fills each modality's placeholders in)."""
    parts: dict[Modality, list[tuple[str, Any]]] = {"image": [], "audio": []}
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                modality = PART_MODALITY.get(type(part))
                if modality is not None:
                    parts[modality].append((f"messages[{i}].content[{j}]", part))
    images, clips = parts["image"], parts["audio"]
    image_processor, audio_processor = served.image_processor, served.audio_processor
    _check_count(images, image_processor, "images", "too_many_images")
    _check_count(clips, audio_processor, "audio clips", "too_many_audio_clips")
    processed: list[ProcessedMedia] = []
    if images:
        limits = image_processor.limits
        urls = [(f"{where}.image_url", part.image_url.url) for where, part in images]
        # One deadline for all of them, however many parts name a slow host.
        fetched = fetch_all([(param, url) for param, url in urls if is_remote(url)], limits)
        processed = [
            process_image(
                image_processor,
                open_image(fetched[param], param, limits)
                if param in fetched
                else decode_image_url(url, param, limits),
                param,
            )
            for param, url in urls
        ]
    for where, part in clips:
        param = f"{where}.input_audio"
        waveform, rate = decode_base64_audio(part.input_audio.data, param, audio_processor.limits)
        processed.append(process_audio(audio_processor, waveform, rate, param))
    return processed


def process_audio(
    processor: Callable[..., ProcessedMedia], waveform: Any, rate: int, param: str
) -> ProcessedMedia:
    """A decoded clip made ready for the engine; 400 naming `param` if the model cannot hear it
    (too short for one embedding)."""
    try:
        return processor(waveform, rate)
    except ValueError as e:
        raise OpenAIError(
            f"The audio cannot be heard by this model: {e}.",
            param=param,
            code="invalid_audio_format",
        ) from None


def _check_count(parts: list[tuple[str, Any]], processor: Any, what: str, too_many: str) -> None:
    if not parts:
        return
    if processor is None:
        raise OpenAIError(
            f"This model takes no {what}.", param=parts[0][0], code="unsupported_content_type"
        )
    limit = processor.limits.per_request
    if len(parts) > limit:
        raise OpenAIError(
            f"Too many {what}: {len(parts)}, more than the {limit} a request may hold.",
            param="messages",
            code=too_many,
        )

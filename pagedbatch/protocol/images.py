"""A chat request's `image_url` parts, decoded into pictures within the engine's limits.

An http(s) URL's body is fetched first (protocol/media_fetch.py: allowed hosts only, within one
deadline for all of a request's fetches) and opened here. Every check runs before the costly
step it guards: the base64 text's length before decoding it, the byte count before opening the
image, the pixel count (read from the header) before decoding the pixels, the shape (aspect
ratio, and the size the model's processor would resize to) before processing. So a hostile part
costs at most what the limits allow, and each failure is a 400 naming the part
(`messages[2].content[1].image_url`).
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

from pagedbatch.engine.multimodal.images import ImageLimits, ImageProcessor, ImageRefused
from pagedbatch.engine.multimodal.inputs import ProcessedMedia
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.inline_data import decode_base64

# What Pillow calls the formats OpenAI accepts; a GIF's first frame is the image.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


def decode_image_url(url: str, param: str, limits: ImageLimits) -> Image.Image:
    """The RGB image a `data:image/...;base64,` URL holds; OpenAIError 400 naming `param`.
    (An http(s) URL's body is fetched first, by protocol/media_fetch.py, and opened here.)"""
    header, comma, data = url.partition(",")
    if not (comma and header.startswith("data:image/") and header.endswith(";base64")):
        raise OpenAIError(
            "Invalid image URL: expected a base64 data URL, data:image/<type>;base64,<data>.",
            param=param,
            code="invalid_image_url",
        )
    raw = decode_base64(data, param, limits.bytes, "image", "image_too_large")
    return open_image(raw, param, limits)


def open_image(raw: bytes, param: str, limits: ImageLimits) -> Image.Image:
    """The RGB image of an image file's bytes; OpenAIError 400 naming `param`."""
    with warnings.catch_warnings():
        # Pillow warns of large images itself; the pixel limit below is ours.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(raw), formats=FORMATS)
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
            raise OpenAIError(
                f"The image is not a {', '.join(FORMATS)} image, or it is damaged.",
                param=param,
                code="invalid_image_format",
            ) from None
        width, height = image.size
        if width * height > limits.pixels:
            raise _too_large(
                f"{width}x{height} pixels, more than the {limits.pixels} allowed", param
            )
        try:
            image.seek(0)
            return _rgb(image)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
            raise OpenAIError(
                "The image could not be decoded: it is damaged or cut short.",
                param=param,
                code="invalid_image_format",
            ) from None


def process_image(processor: ImageProcessor, image: Image.Image, param: str) -> ProcessedMedia:
    """A decoded image made ready for the model; a 400 naming `param` if the model's processor
    cannot take it (its shape, checked before the processor runs, or a failure in it)."""
    try:
        return processor(image)
    except ImageRefused as e:
        raise OpenAIError(f"{e}.", param=param, code=e.code) from None


def _rgb(image: Image.Image) -> Image.Image:
    """The image in RGB; transparency over white, as transformers' processors composite it."""
    if image.mode == "RGB":
        return image.copy()  # decoded now, while a damaged file can still be told apart
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba)
    return image.convert("RGB")


def _too_large(what: str, param: str) -> OpenAIError:
    return OpenAIError(f"The image is too large: {what}.", param=param, code="image_too_large")

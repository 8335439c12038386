"""Media sent inline in a request: base64 text, decoded within a byte limit."""

from __future__ import annotations

import base64
import binascii

from pagedbatch.protocol.errors import OpenAIError


def decode_base64(data: str, param: str, limit: int, noun: str, too_large: str) -> bytes:
    """The bytes `data` holds, at most `limit` of them; a 400 naming `param`: `invalid_base64`,
    or the code `too_large` (the text's length is checked before it is decoded)."""
    # Four base64 characters carry three bytes: a longer text holds too many bytes.
    if len(data) > 4 * (limit // 3 + 1):
        raise OpenAIError(
            f"The {noun} is too large: more than the {limit} bytes allowed.",
            param=param,
            code=too_large,
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise OpenAIError(
            f"The {noun}'s data is not valid base64.", param=param, code="invalid_base64"
        ) from None
    if len(raw) > limit:
        raise OpenAIError(
            f"The {noun} is too large: {len(raw)} bytes, more than the {limit} allowed.",
            param=param,
            code=too_large,
        )
    return raw

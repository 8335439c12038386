"""A chat request's `image_url` parts, decoded into pictures within the engine's limits.

An http(s) URL is fetched only from a host the operator allows (`media_allowed_hosts`), through
the webhooks' egress check (public addresses only, unless the list names the address itself),
following redirects only among allowed hosts. Every check runs
before the costly step it guards: the base64 text's length before decoding it,
the byte count before opening the image, the pixel count (read from the header) before
decoding the pixels. So a hostile part costs at most what the limits allow, and each failure is
a 400 naming the part (`messages[2].content[1].image_url`).
"""

from __future__ import annotations

import io
import time
import warnings

import httpx
from PIL import Image, UnidentifiedImageError

from pagedbatch.egress import Destination, ForbiddenDestination, check_url
from pagedbatch.engine.images import ImageLimits
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.inline_data import decode_base64

# What Pillow calls the formats OpenAI accepts; a GIF's first frame is the image.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# Fetching an http(s) image URL: the whole exchange, redirects included, and the hops.
FETCH_SECONDS = 10.0
MAX_REDIRECTS = 3
REDIRECTS = (301, 302, 303, 307, 308)


def decode_image_url(url: str, param: str, limits: ImageLimits) -> Image.Image:
    """The RGB image a `data:image/...;base64,` URL holds, or an http(s) URL of an allowed host
    serves; OpenAIError 400 naming `param`."""
    if url.startswith(("http://", "https://")):
        return _open(fetch(url, param, limits), param, limits)
    header, comma, data = url.partition(",")
    if not (comma and header.startswith("data:image/") and header.endswith(";base64")):
        raise OpenAIError(
            "Invalid image URL: expected a base64 data URL, data:image/<type>;base64,<data>.",
            param=param,
            code="invalid_image_url",
        )
    raw = decode_base64(data, param, limits.bytes, "image", "image_too_large")
    return _open(raw, param, limits)


def fetch(url: str, param: str, limits: ImageLimits) -> bytes:
    """The body at `url`, if its host (and every redirect's) is on the allow-list: fetched from
    the address the egress check resolved, within the byte limit and FETCH_SECONDS."""
    deadline = time.monotonic() + FETCH_SECONDS
    for _ in range(MAX_REDIRECTS + 1):
        try:
            host = httpx.URL(url).host.lower() if url.startswith(("http://", "https://")) else ""
        except httpx.InvalidURL:
            host = ""
        if not host or host not in limits.allowed_hosts:
            allowed = ", ".join(limits.allowed_hosts) or "none; send images as data: URLs"
            raise OpenAIError(
                f"Image URLs may name only the hosts this server fetches from ({allowed}).",
                param=param,
                code="invalid_image_url",
            )
        try:
            # As for webhooks, only public addresses, unless the list names the address itself:
            # an allowed name that resolves to a private address is refused.
            destination = check_url(url, limits.allowed_hosts, trust_names=False)
        except ForbiddenDestination:
            raise OpenAIError(
                f"The image could not be fetched: {host} is not at a public address.",
                param=param,
                code="invalid_image_url",
            ) from None
        try:
            status, location, body = _get(destination, deadline, limits.bytes)
        except (httpx.HTTPError, TimeoutError) as e:
            raise OpenAIError(
                f"The image could not be fetched: {str(e) or type(e).__name__}.",
                param=param,
                code="invalid_image_url",
            ) from None
        if status in REDIRECTS and location:
            url = str(destination.url.join(location))
            continue
        if status != 200:
            raise OpenAIError(
                f"The image could not be fetched: HTTP {status}.",
                param=param,
                code="invalid_image_url",
            )
        if body is None:
            raise _too_large(f"more than the {limits.bytes} bytes an image may have", param)
        return body
    raise OpenAIError(
        f"The image could not be fetched: more than {MAX_REDIRECTS} redirects.",
        param=param,
        code="invalid_image_url",
    )


def _get(
    destination: Destination, deadline: float, limit: int
) -> tuple[int, str | None, bytes | None]:
    """(status, Location, body), the body None if longer than `limit` bytes (decompressed)."""
    url = destination.url
    extensions = {"sni_hostname": destination.host} if url.scheme == "https" else {}
    request = httpx.Request(
        "GET",
        url.copy_with(host=str(destination.address)),
        headers={"host": url.netloc.decode("ascii"), "accept": "image/*"},
        extensions=extensions,
    )
    remaining = deadline - time.monotonic()  # what earlier hops left of FETCH_SECONDS
    if remaining <= 0:
        raise TimeoutError(f"not received within {FETCH_SECONDS:g} s")
    with httpx.Client(timeout=remaining, follow_redirects=False, trust_env=False) as client:
        response = client.send(request, stream=True)
        try:
            if response.status_code != 200:
                return response.status_code, response.headers.get("location"), b""
            body = bytearray()
            # Each read is bounded by the client's timeout; a trickle is cut off by the deadline.
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > limit:
                    return 200, None, None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not received within {FETCH_SECONDS:g} s")
            return 200, None, bytes(body)
        finally:
            response.close()


def _open(raw: bytes, param: str, limits: ImageLimits) -> Image.Image:
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

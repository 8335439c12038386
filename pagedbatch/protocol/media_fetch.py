"""A chat request's http(s) image URLs, fetched from the hosts the operator allows within one
deadline for them all.

A URL is fetched only from a host on the allow-list (`media_allowed_hosts`), through the
webhooks' egress check (public addresses only, unless the list names the address itself),
following redirects only among allowed hosts, and from the very address that was checked. All of
a request's fetches share one deadline (`media_fetch_deadline_seconds`), which bounds every step:
name lookups, connecting, headers and a body however slowly it trickles. So a request of many
slow images holds its preparing thread no longer than one. Each failure is a 400 naming the
part (`messages[2].content[1].image_url`).

The fetches run in an event loop of the preparing thread's own, where the deadline cancels
whatever step is under way; name lookups block, so each runs on a thread of its own that the
deadline stops waiting for.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import httpx

from pagedbatch.egress import Destination, ForbiddenDestination, check_url
from pagedbatch.engine.multimodal.images import ImageLimits
from pagedbatch.protocol.errors import OpenAIError

MAX_REDIRECTS = 3
REDIRECTS = (301, 302, 303, 307, 308)

T = TypeVar("T")


def is_remote(url: str) -> bool:
    """Whether the URL is one to fetch (http or https), rather than inline data."""
    return url.startswith(("http://", "https://"))


def fetch_all(urls: Sequence[tuple[str, str]], limits: ImageLimits) -> dict[str, bytes]:
    """The bodies of `urls` ((param, url) pairs) by param, fetched one after another within
    `limits.fetch_seconds` for them all; OpenAIError 400 naming the part that failed, or the
    one under way when the deadline passed. Called on a thread with no event loop (the
    preparing threads of the doors and the batch shards)."""
    if not urls:
        return {}
    return asyncio.run(_fetch_all(urls, limits))


async def _fetch_all(urls: Sequence[tuple[str, str]], limits: ImageLimits) -> dict[str, bytes]:
    fetched: dict[str, bytes] = {}
    param = urls[0][0]
    try:
        async with asyncio.timeout(limits.fetch_seconds):
            async with httpx.AsyncClient(
                timeout=None, follow_redirects=False, trust_env=False
            ) as client:
                for param, url in urls:
                    fetched[param] = await _fetch(client, url, param, limits)
    except TimeoutError:
        raise OpenAIError(
            f"The image could not be fetched: all of a request's images must arrive within "
            f"{limits.fetch_seconds:g} s (media_fetch_deadline_seconds), and this one had not.",
            param=param,
            code="invalid_image_url",
        ) from None
    return fetched


async def _fetch(client: httpx.AsyncClient, url: str, param: str, limits: ImageLimits) -> bytes:
    """The body at `url`, if its host (and every redirect's) is on the allow-list, within the
    byte limit."""
    for _ in range(MAX_REDIRECTS + 1):
        try:
            host = httpx.URL(url).host.lower() if is_remote(url) else ""
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
            destination = await _on_own_thread(
                lambda url=url: check_url(url, limits.allowed_hosts, trust_names=False)
            )
        except ForbiddenDestination:
            raise OpenAIError(
                f"The image could not be fetched: {host} is not at a public address.",
                param=param,
                code="invalid_image_url",
            ) from None
        try:
            status, location, body = await _get(client, destination, limits.bytes)
        except httpx.HTTPError as e:
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
            raise OpenAIError(
                f"The image is too large: more than the {limits.bytes} bytes an image may have.",
                param=param,
                code="image_too_large",
            )
        return body
    raise OpenAIError(
        f"The image could not be fetched: more than {MAX_REDIRECTS} redirects.",
        param=param,
        code="invalid_image_url",
    )


async def _get(
    client: httpx.AsyncClient, destination: Destination, limit: int
) -> tuple[int, str | None, bytes | None]:
    """(status, Location, body), the body None if longer than `limit` bytes (decompressed)."""
    url = destination.url
    extensions = {"sni_hostname": destination.host} if url.scheme == "https" else {}
    request = client.build_request(
        "GET",
        url.copy_with(host=str(destination.address)),
        headers={"host": url.netloc.decode("ascii"), "accept": "image/*"},
        extensions=extensions,
    )
    response = await client.send(request, stream=True)
    try:
        if response.status_code != 200:
            return response.status_code, response.headers.get("location"), b""
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > limit:
                return 200, None, None
        return 200, None, bytes(body)
    finally:
        await response.aclose()


async def _on_own_thread(work: Callable[[], T]) -> T:
    """`work()` on a daemon thread of its own. Unlike the loop's executor, which the loop's end
    waits for, a lookup that hangs is then left behind when the deadline passes."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():  # the deadline passed meanwhile
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            outcome: tuple[T | None, BaseException | None] = (work(), None)
        except BaseException as e:
            outcome = (None, e)
        with contextlib.suppress(RuntimeError):  # the loop has closed: no one waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="media-fetch-lookup", daemon=True).start()
    return await done

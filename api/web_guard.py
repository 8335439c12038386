"""What a web page in the user's browser may not make the API do.

Without API keys (`make serve`'s default) whoever reaches the port is the one tenant, and every
page the user visits can reach 127.0.0.1. Three rules keep those pages out, keys or not:

- Host: a request must name this server in its `Host` header: the address it is bound to,
  localhost (any loopback address, any port), or a name in `allowed_hosts`. Else a 400
  `invalid_host`. A DNS-rebinding page, whose requests are same-origin to the browser, sends its
  own name. `/health` and `/metrics` take any Host: probes and scrapers call them by service name,
  they change nothing, and `/metrics` has its own token once the API has keys.
- Origin: a request with an `Origin` header (a browser's, from a page) must come from this server
  itself (`/ui`) or an origin in `cors_origins`; else a 403 `origin_not_allowed`. Allowed origins
  get CORS headers and preflight answers; nothing else does, so a browser lets no other page read
  an answer.
- Content type: a body sent to a JSON route must say `application/json` (or `application/*+json`),
  and one sent to a form route (`POST /v1/files`, `/v1/audio/transcriptions`)
  `multipart/form-data`; else a 415 `unsupported_media_type`. A `text/plain` body is what a
  cross-site form or `no-cors` fetch can send without asking; JSON needs a preflight.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse, Response
from python_multipart.multipart import parse_options_header
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedbatch.addresses import is_loopback
from pagedbatch.api.request_body import TRANSCRIPTION_PATH, UPLOAD_PATH
from pagedbatch.protocol.errors import OpenAIError

# Called by name from inside a deployment (health checks, Prometheus): any Host.
ANY_HOST_PATHS = frozenset({"/health", "/metrics"})
FORM_PATHS = frozenset({UPLOAD_PATH, TRANSCRIPTION_PATH})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Binding to these means every interface: no name a client would use.
WILDCARD_ADDRESSES = frozenset({"", "0.0.0.0", "::"})
ANY_ORIGIN = "*"
ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
# What a page's script may read of an answer beyond the CORS-safelisted headers.
EXPOSED_HEADERS = "x-request-id, retry-after, retry-after-ms"
PREFLIGHT_MAX_AGE_SECONDS = 600


class WebGuardMiddleware:
    """The three rules above, before a request reaches any route."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        bound_host: str,
        allowed_hosts: Iterable[str],
        cors_origins: Iterable[str],
    ) -> None:
        self.app = app
        names = {_bare(name) for name in allowed_hosts}
        if _bare(bound_host) not in WILDCARD_ADDRESSES:
            names.add(_bare(bound_host))
        self.allowed_hosts = frozenset(names)
        self.cors_origins = frozenset(origin.strip().lower().rstrip("/") for origin in cors_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path = scope["path"].rstrip("/") or "/"
        host = headers.get("host")
        if path not in ANY_HOST_PATHS and host is not None and not self._host_allowed(host):
            await _refuse(scope, receive, send, _invalid_host(host))
            return
        origin = headers.get("origin")
        cross_origin = origin is not None and not _same_origin(origin, host)
        if cross_origin and not self._origin_allowed(origin):
            await _refuse(scope, receive, send, _origin_not_allowed(origin))
            return
        if scope["method"] == "OPTIONS" and origin and "access-control-request-method" in headers:
            await _preflight(origin, headers)(scope, receive, send)
            return
        problem = _content_type_problem(scope["method"], path, headers)
        if problem is not None:
            await _refuse(scope, receive, send, problem)
            return
        if not cross_origin:
            await self.app(scope, receive, send)
            return
        assert origin is not None

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                response_headers = MutableHeaders(scope=message)
                _add_cors(response_headers, origin)
                response_headers["access-control-expose-headers"] = EXPOSED_HEADERS
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _host_allowed(self, host: str) -> bool:
        name = _host_name(host)
        return name is not None and (is_loopback(name) or name in self.allowed_hosts)

    def _origin_allowed(self, origin: str) -> bool:
        return ANY_ORIGIN in self.cors_origins or origin.lower().rstrip("/") in self.cors_origins


def _bare(name: str) -> str:
    """A host name as Host headers are compared: lower case, no brackets, no trailing dot."""
    return name.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")


def _host_name(host: str) -> str | None:
    """The name a Host header (`name`, `name:port`, `[v6]:port`) gives; None if malformed."""
    value = host.strip().lower()
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return name
    name, colon, port = value.rpartition(":")
    if not colon:
        return _bare(value)
    if not port.isdigit() or ":" in name:
        return None
    return _bare(name)


def _same_origin(origin: str, host: str | None) -> bool:
    """Whether a page at `origin` is this server's own (the `/ui` page): the same host and port
    as the request's Host header. The scheme is not compared: behind a proxy that ends TLS, the
    page is https and the request reaches us as http."""
    if host is None or origin == "null":
        return False
    return urlsplit(origin).netloc.lower() == host.strip().lower()


def _content_type_problem(method: str, path: str, headers: Headers) -> OpenAIError | None:
    if method not in BODY_METHODS:
        return None
    content_type = headers.get("content-type")
    if content_type is None:
        has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
        if not has_body:
            return None  # a bodiless POST (a cancel): nothing to mistake for JSON
        content_type = ""
    kind = parse_options_header(content_type)[0].decode("latin-1").lower()
    if method == "POST" and path in FORM_PATHS:
        if kind == "multipart/form-data":
            return None
        expected = "multipart/form-data"
    else:
        if kind == "application/json" or (
            kind.startswith("application/") and kind.endswith("+json")
        ):
            return None
        expected = "application/json"
    return OpenAIError(
        f"Unsupported Content-Type {content_type or '(none)'!r} for {method} {path}: send "
        f"{expected}.",
        status_code=415,
        code="unsupported_media_type",
    )


def _preflight(origin: str, headers: Headers) -> Response:
    """The answer to a browser's CORS preflight from an allowed origin: the methods, and the
    headers it asked for (names only; whether a request may do something is up to the API's
    keys and checks, not its header names)."""
    response = Response(status_code=204)
    _add_cors(response.headers, origin)
    response.headers["access-control-allow-methods"] = ALLOWED_METHODS
    requested = headers.get("access-control-request-headers")
    if requested:
        response.headers["access-control-allow-headers"] = requested
    response.headers["access-control-max-age"] = str(PREFLIGHT_MAX_AGE_SECONDS)
    return response


def _add_cors(headers: MutableHeaders, origin: str) -> None:
    headers["access-control-allow-origin"] = origin
    headers.add_vary_header("origin")


def _invalid_host(host: str) -> OpenAIError:
    return OpenAIError(
        f"This server does not answer to the host {host[:256]!r}: use its address, localhost, "
        "or a name in PAGEDBATCH_ALLOWED_HOSTS.",
        code="invalid_host",
    )


def _origin_not_allowed(origin: str) -> OpenAIError:
    return OpenAIError(
        f"Requests from the web origin {origin[:256]!r} are not allowed: add it to "
        "PAGEDBATCH_CORS_ORIGINS to let its pages call this API.",
        status_code=403,
        code="origin_not_allowed",
    )


async def _refuse(scope: Scope, receive: Receive, send: Send, error: OpenAIError) -> None:
    await JSONResponse(error.body(), status_code=error.status_code)(scope, receive, send)

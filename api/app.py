"""The FastAPI application: routers, OpenAI-shaped errors and request ids.

Every failure a client can see is `{"error": {"message", "type", "param", "code"}}`, and none that
retrying cannot fix is a 409 or 5xx, which the `openai` SDK retries.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedbatch.api.auth import KeyRing
from pagedbatch.api.deps import Services
from pagedbatch.api.errors import BodyTooLarge
from pagedbatch.api.metrics import install_metrics
from pagedbatch.api.realtime import CLIENT_CLOSED_REQUEST
from pagedbatch.api.request_body import BodyLimitMiddleware, body_limit
from pagedbatch.api.routes import admin_router, api_router, ui
from pagedbatch.api.web_guard import WebGuardMiddleware
from pagedbatch.logs import request_id as current_request_id
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.settings import Settings
from pagedbatch.store.retry import is_transient
from pagedbatch.store.spend import SpendGuard

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
_HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
# A client's own id is logged only if it is short and printable.
_CLIENT_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


def create_app(settings: Settings, services: Services) -> FastAPI:
    """The app for `services`; `settings` configure the app itself (its API keys). Routes read
    their limits from `services.settings`, normally the same object."""
    app = FastAPI(title="pagedbatch", version="0.1.0")
    app.state.keys = KeyRing(settings.api_keys)
    app.state.admin_keys = KeyRing(settings.admin_keys)
    app.state.spend = SpendGuard(services.session_factory, settings)
    app.state.services = services
    app.include_router(api_router)
    app.include_router(admin_router)
    app.include_router(ui.router)
    app.add_api_route("/health", health, methods=["GET"], tags=["health"])
    # Innermost of the middleware, so that its 413s carry request ids and are counted.
    app.add_middleware(BodyLimitMiddleware, limit=body_limit(services.settings))
    # Around the routes and the body limit, inside the request ids and metrics (api/web_guard.py).
    app.add_middleware(
        WebGuardMiddleware,
        bound_host=settings.host,
        allowed_hosts=settings.allowed_hosts,
        cors_origins=settings.cors_origins,
    )
    install_error_handling(app)
    install_metrics(app, services, settings)  # `/metrics`, and HTTP metrics around the rest
    return app


def install_error_handling(app: FastAPI, *, adopt_request_ids: bool = False) -> None:
    """OpenAI-shaped errors and request ids: for this app and for the workers' engine hosts,
    which serve the realtime routes too. `adopt_request_ids` is for an app that only the API
    calls (an engine host): it takes the API's id as its own, so both log under one id."""
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_disconnected)
    app.add_exception_handler(Exception, _unexpected_error)
    app.add_middleware(RequestIdMiddleware, adopt=adopt_request_ids)


def health(request: Request) -> JSONResponse:
    """200 while this process can serve; 503 once one of its embedded engines (the main one,
    the moderation or the embedding model's) has died (a failed step, a lost rank), saying which
    and why, so that an orchestrator restarts it."""
    dead = request.app.state.services.dead_engine()
    if dead is not None:
        error = OpenAIError(
            f"The engine has stopped: {dead.engine.model_name}'s engine died of {dead.dead_error}",
            status_code=503,
            type="server_error",
            code="engine_dead",
        )
        return JSONResponse({"status": "unavailable", **error.body()}, status_code=503)
    return JSONResponse({"status": "ok"})


class RequestIdMiddleware:
    """Gives each request an id of ours (`req_...`), which the SDK reports as `request_id`, and
    sends it back on the response. A client's own `x-request-id` is not taken: ids of ours are
    unique, and one that a client picks could pass for another request's in the logs. It is
    logged beside ours instead, so a client's report that quotes it leads to our lines. With
    `adopt`, the sender's id (the API's) is this request's id."""

    def __init__(self, app: ASGIApp, *, adopt: bool = False) -> None:
        self.app = app
        self.adopt = adopt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = Request(scope).headers.get(REQUEST_ID_HEADER)
        if sent is not None and not _CLIENT_REQUEST_ID.fullmatch(sent):
            sent = None
        request_id = sent if self.adopt and sent is not None else _request_id()
        # The state dict is shared with the server-error handler, which runs outside this
        # middleware and so must set the header on its 500 itself.
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (name, value)
                    for name, value in message.get("headers", [])
                    if name.lower() != REQUEST_ID_HEADER.encode()
                ]
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        # Log lines written while the request is served carry its id (in the JSON log format).
        # Not reset on the way out: the server-error handler and the server's traceback of a 500
        # are logged after this returns, and the server runs each request in a task of its own,
        # whose context ends with it.
        current_request_id.set(request_id)
        if sent is not None and sent != request_id:
            logger.info("request %s: the client's x-request-id is %s", request_id, sent)
        await self.app(scope, receive, send_with_id)


def _request_id() -> str:
    return f"req_{secrets.token_hex(16)}"


def _error_response(error: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=headers)


async def _openai_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return _error_response(exc)


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 for a bad query, header or path parameter becomes OpenAI's 400."""
    assert isinstance(exc, RequestValidationError)
    return _error_response(_first_problem(exc.errors()))


def _first_problem(errors: Sequence[Any]) -> OpenAIError:
    error = errors[0]
    # loc starts with where the value came from ("query", "header", "body", ...).
    param = _param(error["loc"][1:])
    if error["type"] == "missing":
        return OpenAIError(
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    if param is None:
        return OpenAIError(error["msg"], code="invalid_value")
    return OpenAIError(
        f"Invalid value for '{param}': {error['msg']}.", param=param, code="invalid_value"
    )


def _param(loc: Sequence[int | str]) -> str | None:
    param: str | None = None
    for step in loc:
        if isinstance(step, int):
            param = f"{param or ''}[{step}]"
        else:
            param = step if param is None else f"{param}.{step}"
    return param


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors: unknown routes (404), wrong methods (405) and the like."""
    assert isinstance(exc, HTTPException)
    if isinstance(exc.__cause__, ClientDisconnect):  # FastAPI's "error parsing the body"
        return await _client_disconnected(request, exc.__cause__)
    headers = exc.headers
    if isinstance(exc, BodyTooLarge):
        error = exc.openai()
    elif exc.status_code == 404:
        error = OpenAIError(
            f"Invalid URL ({request.method} {request.url.path})",
            status_code=404,
            code="unknown_url",
        )
    elif exc.status_code == 405:
        error = OpenAIError(
            f"Method {request.method} is not allowed for {request.url.path}",
            status_code=405,
            code="method_not_allowed",
        )
        headers = {"allow": ", ".join(_allowed_methods(request))}
    else:
        error = OpenAIError(
            str(exc.detail),
            status_code=exc.status_code,
            type="server_error" if exc.status_code >= 500 else "invalid_request_error",
        )
    return _error_response(error, headers=headers)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path. Starlette's 405 names only the
    methods of the first route there, and FastAPI makes a route per method (GET and POST
    /v1/files). Each method is tried through the routes' own matching, which also sees into
    included routers."""
    routes = request.app.router.routes
    return [
        method
        for method in _HTTP_METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] is Match.FULL for route in routes
        )
    ]


async def _client_disconnected(request: Request, _exc: Exception) -> Response:
    """A client that left before its body was read: nothing failed on our side, so no error and
    no traceback (a crowd of them would bury real errors), only a line. Handled here, the server
    never sees the exception."""
    logger.info(
        "request %s: the client disconnected before its body was read (%s %s)",
        getattr(request.state, "request_id", None),
        request.method,
        request.url.path,
    )
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    request_id = getattr(request.state, "request_id", None) or _request_id()
    # Starlette re-raises after this handler, so the server logs the traceback; this line ties
    # it to the id the client saw.
    logger.error("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
    headers = {REQUEST_ID_HEADER: request_id}
    if is_transient(exc):
        # The database, broker or S3 is restarting: nothing is wrong with the request, and the
        # same call will work in a moment (the SDK retries a 503 by itself).
        error = OpenAIError(
            "The service is briefly unavailable. Please retry shortly.",
            status_code=503,
            type="server_error",
            code="service_unavailable",
        )
        headers["Retry-After"] = "1"
    else:
        error = OpenAIError(
            "The server had an error while processing your request.",
            status_code=500,
            type="server_error",
        )
    return _error_response(error, headers=headers)

"""The realtime door's side of the engine: admission, running a request, answering it.

At most `max_realtime_queue` realtime requests are in the engine at once (waiting or running);
beyond that a client gets a 429 with Retry-After at once, so a burst costs neither memory nor an
ever longer queue. Admitted requests run at REALTIME_PRIORITY, ahead of batch lines. A client
that goes away, streaming or not, aborts its engine requests at once, which frees their KV blocks.

The distributed API runs no engine: it checks the request and forwards it to a worker's engine
host (api/engine_proxy.py), which answers it with this same code, and so admits per engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedbatch.api.deps import Services, get_services
from pagedbatch.api.errors import OpenAIError
from pagedbatch.api.schemas.common import SamplingRequest
from pagedbatch.api.serving.common import (
    REALTIME_PRIORITY,
    EngineInput,
    Prepared,
    ServedModel,
    model_not_found,
    parse_request,
)
from pagedbatch.api.serving.streaming import ChunkWriter, StreamEncoder
from pagedbatch.engine import AsyncLLM
from pagedbatch.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")
Body = TypeVar("Body", bound=SamplingRequest)
P = TypeVar("P", bound=Prepared)

RETRY_AFTER_SECONDS = 1  # admitted requests finish in seconds, so their slots free up quickly
CLIENT_CLOSED_REQUEST = 499  # nginx's status for it: the client never sees it, logs do


class Admission:
    """Counts the realtime requests in the engine against a bound.

    Routes run on one event loop, so a plain counter is exact.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.admitted = 0

    def try_enter(self) -> bool:
        if self.admitted >= self.limit:
            return False
        self.admitted += 1
        return True

    def leave(self) -> None:
        self.admitted -= 1


def _engine_for(services: Services, model: str) -> AsyncLLM:
    """The engine that serves `model` in this process."""
    if model not in services.served_models:
        raise model_not_found(model)
    if services.engine is None:
        # An app given neither an engine nor a way to the workers' (a Files-only app).
        raise OpenAIError(
            f"No engine serves model '{model}' right now. Please try again later.",
            status_code=503,
            type="server_error",
            param="model",
            code="engine_unavailable",
        )
    return services.engine


async def answer(
    request: Request,
    services: Services,
    body: Any,
    schema: type[Body],
    prepare: Callable[[Body, ServedModel], P],
    chunks: Callable[[P], ChunkWriter],
) -> Response:
    """An endpoint's answer to `body`: the whole response, or its events if streamed.

    The request is checked in full before it comes near the engine, then runs if admitted.
    """
    params = parse_request(schema, body)
    if services.engines is not None:  # the distributed API: a worker's engine host answers
        return await services.engines.forward(request, params.model, body, services.served_models)
    engine = _engine_for(services, params.model)
    prepared = prepare(params, engine.engine)
    admission = _admission(request)
    if not admission.try_enter():
        return _queue_full(admission.limit)
    if params.stream:
        events = _events(engine, prepared.inputs, StreamEncoder(chunks(prepared), params))
        return EventStreamResponse(events, admission.leave)
    try:
        outputs = await unless_disconnected(request, _final_outputs(engine, prepared.inputs))
    finally:
        admission.leave()
    if outputs is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(prepared.response(outputs).model_dump(mode="json"))


class EventStreamResponse(StreamingResponse):
    """Server-sent events that, however the response ends, are closed and then `on_close` runs.

    Starlette cancels the sending of a stream whose client has gone, but leaves its generator
    suspended for the garbage collector; closing it here aborts the engine requests at once.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with contextlib.aclosing(self._events):
                await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _admission(request: Request) -> Admission:
    state = request.app.state
    if not hasattr(state, "realtime_admission"):  # made on first use: one per app
        state.realtime_admission = Admission(get_services(request).settings.max_realtime_queue)
    return state.realtime_admission


def _queue_full(limit: int) -> JSONResponse:
    error = OpenAIError(
        f"The server is at its limit of {limit} realtime requests at once. "
        f"Please retry after {RETRY_AFTER_SECONDS} s.",
        status_code=429,
        type="requests",
        code="rate_limit_exceeded",
    )
    return JSONResponse(
        error.body(), status_code=429, headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
    )


async def _run(
    engine: AsyncLLM, inputs: Sequence[EngineInput]
) -> AsyncGenerator[list[RequestOutput | None], None]:
    """Runs `inputs` at realtime priority and yields the latest output of each (None before its
    first) whenever one moves, until all have finished. Closing it aborts what still runs.

    A caller slower than the engine gets the steps it missed folded into one: it holds one output
    per engine request, never a backlog of them.
    """
    latest: list[RequestOutput | None] = [None] * len(inputs)
    moved = asyncio.Event()
    failures: list[Exception] = []

    async def follow(position: int, engine_input: EngineInput) -> None:
        try:
            async for output in engine.generate(
                engine_input.prompt_token_ids,
                engine_input.params,
                request_id=engine_input.request_id,
                priority=REALTIME_PRIORITY,
            ):
                latest[position] = output
                moved.set()
        except ValueError as exc:  # the engine's own checks, e.g. the KV cache is too small
            failures.append(OpenAIError(str(exc)))
        except Exception as exc:
            failures.append(exc)
        finally:
            moved.set()  # a failure must wake the caller too

    followers = [asyncio.create_task(follow(i, x)) for i, x in enumerate(inputs)]
    try:
        while True:
            await moved.wait()
            moved.clear()
            if failures:
                raise failures[0]
            outputs = list(latest)
            yield outputs
            if all(output is not None and output.finished for output in outputs):
                return
    finally:
        for follower in followers:
            follower.cancel()  # leaving `generate` early aborts its request
        await asyncio.gather(*followers, return_exceptions=True)


async def _final_outputs(engine: AsyncLLM, inputs: Sequence[EngineInput]) -> list[RequestOutput]:
    final: list[RequestOutput | None] = []
    async with contextlib.aclosing(_run(engine, inputs)) as running:
        async for outputs in running:
            final = outputs
    return cast("list[RequestOutput]", final)  # the last ones, all finished


async def _events(
    engine: AsyncLLM, inputs: Sequence[EngineInput], stream: StreamEncoder
) -> AsyncGenerator[bytes, None]:
    outputs: list[RequestOutput | None] = []
    try:
        async with contextlib.aclosing(_run(engine, inputs)) as running:
            async for outputs in running:
                if events := stream.events(outputs):
                    yield events
        yield stream.end(cast("list[RequestOutput]", outputs))  # the last ones, all finished
    except OpenAIError as exc:
        yield stream.error(exc)
    except Exception:
        # The status line has gone out, so the failure can only be told in the stream.
        logger.exception("a realtime stream failed")
        yield stream.error(
            OpenAIError(
                "The server had an error while processing your request.",
                status_code=500,
                type="server_error",
            )
        )


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """What `work` returns, or None if the client goes away first, which cancels `work`."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


async def _disconnect(request: Request) -> None:
    # The body has been read, so the next message the server has for us is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass

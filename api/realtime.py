"""The realtime door's side of the engine: admission, running a request, answering it.

A request is read (at most `max_request_body_bytes`, api/request_body.py), parsed and prepared
(templated, tokenized) on worker threads, so a large body never stalls the event loop. Its
worst case is then reserved against the spend limits, or it is refused with 429
`insufficient_quota` (store/spend.py); it settles to what it used however it ends. It is then
admitted or refused at once: the engine holds at most `max_realtime_queue` realtime
sequences (each request's prompts × n), shared fairly among tenants (`Admission`), and beyond
that a client gets a 429 with Retry-After (when the room it needs is expected, which is kept for
it meanwhile), so a burst costs neither memory nor an ever longer queue. Admitted requests
run at REALTIME_PRIORITY, ahead of batch lines, with the tenant's prefix-cache salt. A
request's sequences leave the count when the engine is done with them, however slowly its
client reads; a client that goes away, or that leaves a stream unread for
`stream_send_timeout_seconds`, aborts its engine requests at once, which frees their KV blocks.

The distributed API runs no engine: it checks the request and forwards it, with its tenant, to
a worker's engine host (api/engine_proxy.py), which answers it with this same code, and so admits
per engine and reserves its spend. The API's part stops at reading and validating the body: the
request's pipeline (protocol/pipeline.py: screening, the engine, usage) runs once, on the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Message, Receive, Scope, Send

from pagedbatch.api.deps import Services, get_services
from pagedbatch.api.preparation import preparing_for
from pagedbatch.api.request_body import decode_json
from pagedbatch.api.spend import Account, open_account
from pagedbatch.engine import AsyncLLM
from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.logs import request_id as current_request_id
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.pipeline import RequestContext, RequestPipeline, final_outputs, unless
from pagedbatch.protocol.schemas.common import SamplingRequest, Usage
from pagedbatch.protocol.schemas.embeddings import MAX_EMBEDDING_INPUTS
from pagedbatch.protocol.serving.common import (
    Prepared,
    ServedModel,
    model_not_found,
    parse_request,
)
from pagedbatch.protocol.serving.media import fetches_media
from pagedbatch.protocol.serving.streaming import EventStream
from pagedbatch.settings import Settings
from pagedbatch.store.models import DEFAULT_OWNER
from pagedbatch.store.usage import usage_kind

logger = logging.getLogger(__name__)


class RealtimeBody(Protocol):
    """What the door reads of a parsed request, whatever its endpoint."""

    model: str
    stream: bool


T = TypeVar("T")
Body = TypeVar("Body", bound=RealtimeBody)
P = TypeVar("P", bound=Prepared)
# What an endpoint does with a request's final response object before the client gets it.
Answered = Callable[[P, BaseModel], Awaitable[None]]

# Retry-After before the engine has finished a request, and so has no run time to go by.
RETRY_AFTER_SECONDS = 1
CLIENT_CLOSED_REQUEST = 499  # nginx's status for it: the client never sees it, logs do
# The tenant of a request the API forwards to an engine host, which has no API keys of its own
# and trusts the API (it answers only bearers of the engine secret).
OWNER_HEADER = "x-pagedbatch-owner"
# A refused tenant's place in line is kept this long past its Retry-After: time for its client
# to send the request again (and for the door to parse and prepare it) before the room kept
# for it goes back to the others.
DEMAND_GRACE_SECONDS = 2.0
RUN_SECONDS_WEIGHT = 0.2  # of each finished request in the run time that Retry-After goes by


@dataclass(eq=False)
class Ticket:
    """One admitted request's sequences; `release` gives them back, once however often called."""

    admission: Admission
    tenant: str
    sequences: int
    started: float
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.leave(self)


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted, and in how many seconds room is expected for it."""

    reason: str
    retry_after: int


@dataclass
class _Demand:
    """A refused tenant's claim on the room that frees next, until it comes back for it."""

    sequences: int
    since: float  # when it was first refused since it last got in
    until: float  # when the claim lapses, unless a retry renews it


class Admission:
    """Counts the realtime sequences in the engine against `limit`, shared fairly by tenants.

    Tenants are served in turn, best placed first: the one holding the fewest sequences, then
    the one admitted least lately (a tenant never admitted before any other), then the one
    refused first. A request is admitted if the engine then holds at most `limit`, its tenant
    at most `max_request` (`limit × tenant_share`), and the room left still holds what every
    refused tenant placed before it asked for. A refused tenant keeps that claim until its
    Retry-After has passed and DEMAND_GRACE_SECONDS more: so the room that frees next is kept
    for it, however often others ask, and a tenant holding nothing gets in as soon as the
    requests running when it asked have ended (within one request's run time), its Retry-After
    being when they are expected to end. A tenant over `max_request` claims nothing: it waits
    for its own sequences. Any request of at most `max_request` sequences gets in eventually; a
    larger one never can, and is a 400. Nothing admitted is taken back, and the cost of keeping
    room is an engine that idles on it until the claimant's retry comes, at most its
    Retry-After and the grace.

    Routes run on one event loop, so plain counters are exact.
    """

    def __init__(
        self, limit: int, tenant_share: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit = limit
        self.max_request = max(1, int(limit * tenant_share))  # a tenant's most
        self.held: Counter[str] = Counter()  # tenant -> sequences admitted
        self._clock = clock
        self._running: set[Ticket] = set()
        self._demands: dict[str, _Demand] = {}  # refused tenants' claims on the room
        self._last_in: dict[str, int] = {}  # tenant -> the number of its latest admission
        self._admissions = 0
        self.run_seconds: float | None = None  # recent requests' run time, weighted

    @property
    def admitted(self) -> int:
        return sum(self.held.values())

    def enter(self, tenant: str, sequences: int) -> Ticket | Refusal:
        """The request's ticket, or why not and when to try again (which keeps its place)."""
        now = self._clock()
        self._demands = {t: d for t, d in self._demands.items() if d.until > now}
        held = self.held[tenant]
        if held + sequences > self.max_request:
            retry = self._seconds_until_freed(
                held + sequences - self.max_request, self._tickets_of(tenant), now
            )
            return Refusal(
                f"You hold {held} of the {self.max_request} realtime sequences one client may "
                "hold at once.",
                retry,
            )
        needed = sequences + self._kept_for_others(tenant, now)
        if self.admitted + needed <= self.limit:
            self._demands.pop(tenant, None)
            self.held[tenant] = held + sequences
            self._admissions += 1
            self._last_in[tenant] = self._admissions
            ticket = Ticket(self, tenant, sequences, now)
            self._running.add(ticket)
            return ticket
        retry = self._seconds_until_freed(self.admitted + needed - self.limit, self._running, now)
        demand = self._demands.get(tenant)
        since = now if demand is None else demand.since
        self._demands[tenant] = _Demand(sequences, since, now + retry + DEMAND_GRACE_SECONDS)
        return Refusal(
            f"The server is at its limit of {self.limit} realtime sequences at once, or what "
            "is left of it is kept for clients that asked before you.",
            retry,
        )

    def leave(self, ticket: Ticket) -> None:
        self.held[ticket.tenant] -= ticket.sequences
        if self.held[ticket.tenant] <= 0:
            del self.held[ticket.tenant]
        self._running.discard(ticket)
        ran = self._clock() - ticket.started
        last = self.run_seconds
        self.run_seconds = ran if last is None else last + RUN_SECONDS_WEIGHT * (ran - last)

    def _place(self, tenant: str, now: float) -> tuple[int, int, float]:
        demand = self._demands.get(tenant)
        return (
            self.held[tenant],
            self._last_in.get(tenant, -1),
            now if demand is None else demand.since,
        )

    def _kept_for_others(self, tenant: str, now: float) -> int:
        """The sequences claimed by refused tenants placed before `tenant` (those their own
        limit lets in)."""
        place = self._place(tenant, now)
        return sum(
            demand.sequences
            for other, demand in self._demands.items()
            if other != tenant
            and self.held[other] + demand.sequences <= self.max_request
            and self._place(other, now) < place
        )

    def _tickets_of(self, tenant: str) -> list[Ticket]:
        return [ticket for ticket in self._running if ticket.tenant == tenant]

    def _seconds_until_freed(self, count: int, tickets: Iterable[Ticket], now: float) -> int:
        """When `count` of `tickets`' sequences are expected back, in whole seconds (at least
        one), if each runs as long as recent requests ran; beyond what they hold (room kept for
        others, who then run), one run time after they have all ended."""
        if self.run_seconds is None:
            return RETRY_AFTER_SECONDS
        freed, end = 0, now
        for ticket in sorted(tickets, key=lambda ticket: ticket.started):
            freed += ticket.sequences
            end = max(end, ticket.started + self.run_seconds)
            if freed >= count:
                break
        else:
            end += self.run_seconds
        return max(RETRY_AFTER_SECONDS, math.ceil(end - now))


def _engine_for(services: Services, model: str) -> AsyncLLM:
    """The engine that serves `model` in this process: the embedding model's, or the main one.
    Each endpoint's `prepare` refuses a model of the wrong kind (an embedding model asked to
    generate, or a generating one for embeddings) with a 400."""
    if services.embedder is not None and model == services.embedding_model:
        return services.embedder
    if model not in services.served_models and model not in services.adapters():
        raise model_not_found(model)
    if services.engine is None:
        # An app given neither an engine nor a way to the workers' (a Files-only app).
        raise engine_unavailable(
            f"No engine serves model '{model}' right now. Please try again later."
        )
    return services.engine


async def answer(
    request: Request,
    services: Services,
    parse: Callable[[bytes], Body],
    prepare: Callable[[Body, ServedModel], P],
    stream: Callable[[P, Body], EventStream] | None = None,
    engine_of: Callable[[Services, str], AsyncLLM] | None = None,
    on_answered: Answered[P] | None = None,
) -> Response:
    """An endpoint's answer to the request: the whole response, or its events if streamed (for
    an endpoint with `stream`; `prepare` refuses a stream for one without). `engine_of` finds
    the engine for the request's model (default: the main engine, for the models it serves).
    `on_answered` gets the prepared request and its final response object before the client
    does (the body, or the object a stream's last event tells in full), to keep it.

    The request is checked in full before it comes near the engine, then runs if admitted.
    """
    raw = await request.body()
    tenant = tenant_of(request)
    preparing_for.set(tenant)  # each step on a thread counts against its share of them
    params = await _off_loop(services, parse, raw)
    send_timeout = services.settings.stream_send_timeout_seconds
    if services.engines is not None:  # the distributed API: a worker's engine host runs it
        if params.model == services.embedding_model:  # every worker runs it beside its own
            return await forward_to_any_host(request, services)
        return await services.engines.forward(
            request, params.model, raw, services.served_models, tenant, send_timeout
        )
    engine = (engine_of or _engine_for)(services, params.model)
    prepared = await _off_loop(
        services, prepare, params, engine.engine, fetching=fetches_media(params)
    )
    account = await _open_account(request, services, tenant, engine, prepared)
    try:
        response = await _admit_and_run(
            request, services, params, prepared, engine, stream, tenant, account, on_answered
        )
    except BaseException:
        if account is not None:
            account.close()
        raise
    if account is not None and not isinstance(response, EventStreamResponse):
        account.close()  # recorded already if it ran; else it used nothing that is charged
    return response


async def _open_account(
    request: Request, services: Services, tenant: str, engine: AsyncLLM, prepared: Prepared
) -> Account | None:
    """The request's account in the usage ledger, its worst case reserved against the spend
    limits (store/spend.py): a 429 `insufficient_quota`, before any engine work, if they cannot
    cover it. None where nothing is recorded: no ledger, or the moderation model (free). Its
    usage counts as its endpoint says (an embedding's as embeddings, store/usage.py)."""
    if services.ledger is None or engine is services.guard:
        return None
    return await _off_loop(
        services,
        open_account,
        request.app.state.spend,
        services.ledger,
        tenant,
        engine.engine,
        prepared,
        usage_kind(request.url.path),
    )


async def _admit_and_run(
    request: Request,
    services: Services,
    params: RealtimeBody,
    prepared: P,
    engine: AsyncLLM,
    stream: Callable[[P, Body], EventStream] | None,
    tenant: str,
    account: Account | None,
    on_answered: Answered[P] | None = None,
) -> Response:
    """The answer of a prepared request if it passes the content filter and is admitted; its
    usage goes to `account` (the stream's closes it)."""
    send_timeout = services.settings.stream_send_timeout_seconds
    context = RequestContext.of(
        services.settings,
        tenant,
        door="realtime",
        guard=services.guard,
        moderation=engine is services.guard,  # its scores are free, and not screened
        request_id=current_request_id.get(),
    )
    pipeline = RequestPipeline(engine, prepared, context)
    await pipeline.screen_input()
    admission = _admission(request, engine)
    sequences = sum(engine_input.params.n for engine_input in prepared.inputs)
    _check_size(sequences, params, admission.max_request)
    ticket = admission.enter(tenant, sequences)
    if isinstance(ticket, Refusal):
        return too_busy(ticket.reason, ticket.retry_after)
    running = pipeline.outputs(engine_done=ticket.release)

    record = account.record if account is not None else None
    if stream is not None and params.stream:
        answered = None if on_answered is None else partial(on_answered, prepared)
        events = _events(running, stream(prepared, params), record, answered)

        def closed() -> None:
            ticket.release()
            if account is not None:
                account.close()  # recorded already, unless the stream never began

        return EventStreamResponse(events, closed, send_timeout)
    try:
        outputs = await unless_disconnected(request, final_outputs(running))
    finally:
        ticket.release()
    if outputs is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    used = pipeline.usage(outputs)
    if record is not None and used is not None:
        record(used)
    body = await _off_loop(services, prepared.response, outputs)
    if on_answered is not None and isinstance(body, BaseModel):
        await on_answered(prepared, body)
    content, media_type = await _off_loop(services, _rendered, body)
    return Response(content, media_type=media_type)


async def forward_to_any_host(request: Request, services: Services) -> Response:
    """The distributed API's answer to a request for an engine every worker runs whatever its
    main model (the moderation and embedding models): the least loaded host of a live model
    answers it."""
    assert services.engines is not None
    models = await services.engines.models()
    if not models:
        raise engine_unavailable("No engine can be reached right now. Please try again later.")
    return await services.engines.forward(
        request,
        models[0],
        await request.body(),
        services.served_models,
        tenant_of(request),
        services.settings.stream_send_timeout_seconds,
    )


def json_of(schema: type[Body]) -> Callable[[bytes], Body]:
    """The parser of a JSON body that `schema` validates."""
    return lambda raw: parse_request(schema, decode_json(raw))


def _rendered(body: BaseModel | str) -> tuple[str, str]:
    if isinstance(body, str):
        return body, "text/plain; charset=utf-8"
    return body.model_dump_json(), "application/json"


async def _off_loop(
    services: Services, work: Callable[..., T], *args: Any, fetching: bool = False
) -> T:
    """`work(*args)` on a preparation thread, within the tenant's share of them: parsing,
    templating and tokenizing a large request takes seconds of CPU, which on the event loop
    would stall every other client. `fetching`: it fetches media, and so waits on other hosts
    on a lane of threads of its own (api/preparation.py)."""
    preparation = services.preparation
    return await (preparation.fetching if fetching else preparation.work).run(work, *args)


def tenant_of(request: Request) -> str:
    """Whose request it is: the owner of its API key, or on an engine host (which has no keys)
    the tenant the API named."""
    keys = getattr(request.app.state, "keys", None)
    if keys is None:
        return request.headers.get(OWNER_HEADER) or DEFAULT_OWNER
    return keys.owner(request.headers.get("authorization"))


def _check_size(sequences: int, params: SamplingRequest, most: int) -> None:
    """A 400 for a request too large ever to be admitted, rather than 429s for ever."""
    if sequences <= most:
        return
    if hasattr(params, "input"):  # an embedding request: a sequence per input
        param, counted, fewer = "input", "one per input", "inputs"
    else:
        param = "n" if getattr(params, "n", 1) > most else "prompt"
        counted, fewer = "its prompts times n", "prompts or choices"
    raise OpenAIError(
        f"This request needs {sequences} sequences ({counted}), and the realtime endpoints run "
        f"at most {most} of one client's at once. Send fewer {fewer}, or use the Batch API.",
        param=param,
        code="too_many_sequences",
    )


class SlowReader(Exception):
    """The client did not take the next piece of its response within the send timeout."""


def send_within(send: Send, seconds: float) -> Send:
    """`send`, failing with SlowReader when the client keeps it waiting over `seconds`."""

    async def timed(message: Message) -> None:
        try:
            async with asyncio.timeout(seconds):
                await send(message)
        except TimeoutError:
            raise SlowReader from None

    return timed


class EventStreamResponse(StreamingResponse):
    """Server-sent events that, however the response ends, are closed and then `on_close` runs.

    Starlette cancels the sending of a stream whose client has gone, but leaves its generator
    suspended for the garbage collector; closing it here aborts the engine requests at once. A
    client that leaves a piece unread for `send_timeout` seconds is dropped the same way.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        on_close: Callable[[], None],
        send_timeout: float,
    ) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self._events = events
        self._on_close = on_close
        self._send_timeout = send_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with contextlib.aclosing(self._events):
                await super().__call__(scope, receive, send_within(send, self._send_timeout))
        except SlowReader:
            # The server closes the connection of a response left unfinished.
            logger.warning("a stream's client read nothing for %s s: dropped", self._send_timeout)
        finally:
            self._on_close()


def _admission(request: Request, engine: AsyncLLM) -> Admission:
    """The admission of `engine` (the main one, a guard or the embedder)."""
    state = request.app.state
    model = engine.engine.model_name
    if not hasattr(state, "realtime_admissions"):
        state.realtime_admissions = {}
    if model not in state.realtime_admissions:  # made on first use: one per engine and app
        settings = get_services(request).settings
        state.realtime_admissions[model] = Admission(
            realtime_limit(settings, engine.engine), settings.realtime_tenant_share
        )
    return state.realtime_admissions[model]


def realtime_limit(settings: Settings, served: ServedModel) -> int:
    """The realtime sequences `served`'s engine holds at once: `max_realtime_queue`, and for an
    embedding model at least one request of as many inputs as OpenAI allows, which must not
    be a 400 however the queue is set. Its sequences hold no KV blocks past their one step (an
    encoder's none at all), so a queued input costs its token ids, which the body bound bounds."""
    if served.pooling is None:
        return settings.max_realtime_queue
    return max(settings.max_realtime_queue, MAX_EMBEDDING_INPUTS)


def engine_unavailable(message: str, param: str | None = "model") -> OpenAIError:
    """The 503 of a realtime request no engine can take, embedded or distributed."""
    return OpenAIError(
        message,
        status_code=503,
        type="server_error",
        param=param,
        code="engine_unavailable",
    )


def too_busy(reason: str, retry_after: int = RETRY_AFTER_SECONDS) -> JSONResponse:
    """The 429 of a realtime request refused for want of room, embedded or distributed."""
    error = OpenAIError(
        f"{reason} Please retry after {retry_after} s.",
        status_code=429,
        type="requests",
        code="rate_limit_exceeded",
    )
    return JSONResponse(error.body(), status_code=429, headers={"Retry-After": str(retry_after)})


async def _events(
    running: AsyncGenerator[list[RequestOutput | None], None],
    stream: EventStream,
    account: Callable[[Usage], None] | None = None,
    answered: Callable[[BaseModel], Awaitable[None]] | None = None,
) -> AsyncGenerator[bytes, None]:
    """The stream's events; however it ends, `account` gets the usage of what was streamed. A
    stream that ends, well or failed, with a whole response object (`stream.final`) gives it to
    `answered` before its last event goes out."""
    try:
        try:
            if begun := stream.begin():
                yield begun
            async with contextlib.aclosing(running):
                async for outputs in running:
                    if events := stream.events(outputs):
                        yield events
            last = stream.end()
        except OpenAIError as exc:
            last = stream.error(exc)
        except Exception:
            # The status line has gone out, so the failure can only be told in the stream.
            logger.exception("a realtime stream failed")
            last = stream.error(
                OpenAIError(
                    "The server had an error while processing your request.",
                    status_code=500,
                    type="server_error",
                )
            )
        if answered is not None and stream.final is not None:
            await answered(stream.final)
        yield last
    finally:
        if account is not None:
            account(stream.usage())


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """What `work` returns, or None if the client goes away first, which cancels `work`."""
    return await unless(work, _disconnect(request))


async def _disconnect(request: Request) -> None:
    # The body has been read, so the next message the server has for us is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass

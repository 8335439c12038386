"""The distributed API's realtime door: each request forwarded to a worker's engine host.

The API runs no engine. Having checked the request, it picks the least loaded live engine host
serving the model (from their heartbeats in Redis: store/engine_registry.py), sends it the body
and streams its answer back as it comes: status, headers and bytes. The host answers with the
embedded server's own code (api/realtime.py), so errors, 429s with Retry-After and server-sent
events are one implementation; the request's tenant goes along (OWNER_HEADER), so each host
shares its realtime capacity and its prefix cache by tenant as the embedded server does. A host
that cannot be reached, or is full, is passed over for the next; with none left the client gets a
503 (or a 429 if they were all full). A client that goes away, or leaves its response unread for
`stream_send_timeout_seconds`, closes the upstream connection, and the engine host then aborts
its engine requests.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncGenerator, Sequence

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.types import Receive, Scope, Send

from pagedbatch.api.realtime import (
    CLIENT_CLOSED_REQUEST,
    OWNER_HEADER,
    SlowReader,
    engine_unavailable,
    send_within,
    too_busy,
    unless_disconnected,
)
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.serving.common import model_not_found
from pagedbatch.protocol.serving.streaming import StreamEncoder
from pagedbatch.store.engine_registry import EngineRecord, live_engines, record_ttl_seconds

logger = logging.getLogger(__name__)

CACHE_SECONDS = 0.5  # how stale the list of live hosts may be; heartbeats come every second
CONNECT_TIMEOUT_SECONDS = 2.0
# What of the engine host's response headers the client gets; the rest is the connection's.
PASSED_HEADERS = ("content-type", "cache-control", "retry-after")
EVENT_STREAM = "text/event-stream"


def rank(
    records: Sequence[EngineRecord], model: str, sent: Counter[str] | None = None
) -> list[EngineRecord]:
    """The hosts serving `model`, least loaded first.

    A host's load is the requests in its engine at its last heartbeat plus `sent[id]`, those
    routed to it since (the heartbeat cannot know of them yet); ties go to the emptier KV cache.
    """
    sent = sent or Counter()
    serving = [r for r in records if r.serves(model)]
    return sorted(serving, key=lambda r: (r.running + r.waiting + sent[r.id], r.kv_usage, r.id))


class EngineProxy:
    def __init__(self, redis_url: str, secret: str | None, heartbeat_seconds: float) -> None:
        self._redis = Redis.from_url(redis_url)
        self._client = httpx.AsyncClient(
            # A generation takes as long as it takes; a host that is gone refuses at once.
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_SECONDS),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self._auth = {"authorization": f"Bearer {secret}"} if secret else {}
        # A host that failed is passed over until its record, no longer renewed, has expired.
        self._skip_seconds = record_ttl_seconds(heartbeat_seconds)
        self._records: list[EngineRecord] = []
        self._read_at = -math.inf
        self._unreachable: dict[str, float] = {}  # host id -> until when it is passed over
        self._sent: Counter[str] = Counter()  # host id -> requests sent since its last beat

    async def live(self) -> list[EngineRecord]:
        """The live hosts' latest records (at most CACHE_SECONDS old), less unreachable ones."""
        now = time.monotonic()
        if now - self._read_at > CACHE_SECONDS:
            try:
                records = await live_engines(self._redis)
            except RedisError:
                logger.warning("cannot read the engine hosts from Redis", exc_info=True)
                records = []
            beats = {r.id: r.beat for r in self._records}
            for record in records:
                if beats.get(record.id) != record.beat:
                    self._sent.pop(record.id, None)  # counted in its new figures
            self._records, self._read_at = records, now
            self._unreachable = {h: until for h, until in self._unreachable.items() if until > now}
        return [r for r in self._records if self._unreachable.get(r.id, -math.inf) <= now]

    async def models(self) -> list[str]:
        return sorted({record.model for record in await self.live()})

    async def adapters(self) -> dict[str, str]:
        """The LoRA adapters the live hosts serve, each with the model it adapts."""
        return {name: r.model for r in await self.live() for name in r.adapters}

    async def forward(
        self,
        request: Request,
        model: str,
        body: bytes,
        configured: Sequence[str],
        tenant: str,
        send_timeout: float,
    ) -> Response:
        """The answer of the least loaded engine host serving `model` to `body` (JSON, or a
        transcription's form), sent for `tenant`; `send_timeout` bounds how long the client may
        leave a piece of it unread."""
        live = await self.live()
        hosts = rank(live, model, self._sent)
        if not hosts:
            if model in configured or any(r.serves(model) for r in self._records):
                raise _none_reachable(model)
            raise model_not_found(model)
        headers = {
            **self._auth,
            "content-type": request.headers.get("content-type", "application/json"),
            # The host's log lines then carry the id the client sees.
            "x-request-id": request.state.request_id,
            OWNER_HEADER: tenant,
        }
        full = False
        for host in hosts:
            self._sent[host.id] += 1
            upstream_request = self._client.build_request(
                "POST", host.address + request.url.path, content=body, headers=headers
            )
            try:
                # A non-streamed answer's headers come only once it is complete: a client that
                # leaves meanwhile must close the upstream request too.
                upstream = await unless_disconnected(
                    request, self._client.send(upstream_request, stream=True)
                )
            except httpx.TransportError as exc:
                logger.warning("engine host %s at %s failed: %r", host.id, host.address, exc)
                self._pass_over(host)
                continue
            if upstream is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            if upstream.status_code == 401:
                await upstream.aclose()
                logger.error(
                    "engine host %s refused this API's secret: PAGEDBATCH_ENGINE_SECRET must be "
                    "the same on the API and the workers",
                    host.id,
                )
                self._pass_over(host)
                continue
            # Full (a 429 with Retry-After): another host may have room. A spend limit's 429
            # (insufficient_quota) is the same on every host, which share the budgets.
            full_here = upstream.status_code == 429 and "retry-after" in upstream.headers
            if full_here and host is not hosts[-1]:
                await upstream.aclose()
                full = True
                continue
            return UpstreamResponse(upstream, send_timeout)
        if full:  # and the rest could not be reached
            return all_engines_full(model)
        raise _none_reachable(model)

    def _pass_over(self, host: EngineRecord) -> None:
        self._unreachable[host.id] = time.monotonic() + self._skip_seconds


def _none_reachable(model: str) -> OpenAIError:
    return engine_unavailable(
        f"No engine serving model '{model}' can be reached right now: its workers are down or "
        "starting. Please try again later."
    )


def all_engines_full(model: str) -> JSONResponse:
    return too_busy(
        f"Every engine serving model '{model}' is at its limit of realtime sequences at once, "
        "or you hold your share of them."
    )


class UpstreamResponse(StreamingResponse):
    """An engine host's response, passed on as its bytes arrive. However the client's response
    ends, the upstream one is closed then, which ends the engine requests if they still run."""

    def __init__(self, upstream: httpx.Response, send_timeout: float) -> None:
        headers = {
            name: upstream.headers[name] for name in PASSED_HEADERS if name in upstream.headers
        }
        self._upstream = upstream
        self._relay = _relay(upstream)
        self._send_timeout = send_timeout
        super().__init__(self._relay, status_code=upstream.status_code, headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with contextlib.aclosing(self._relay):
                await super().__call__(scope, receive, send_within(send, self._send_timeout))
        except SlowReader:
            logger.warning("a client read nothing for %s s: dropped", self._send_timeout)
        finally:
            await self._upstream.aclose()


async def _relay(upstream: httpx.Response) -> AsyncGenerator[bytes, None]:
    event_stream = upstream.headers.get("content-type", "").startswith(EVENT_STREAM)
    tail = b"\n\n"
    try:
        async for chunk in upstream.aiter_raw():
            if chunk:
                tail = (tail + chunk)[-2:]
                yield chunk
    except httpx.TransportError as exc:
        logger.warning("an engine host's response broke off: %r", exc)
        if not (event_stream and tail == b"\n\n"):
            raise  # the client's connection is cut short too: the truth, as far as it goes
        # Between two events: the client can be told properly.
        yield StreamEncoder.error(
            engine_unavailable("The engine serving this request stopped. Please try again.", None)
        )

"""A worker's engine host: its engine's realtime endpoints over HTTP, for the distributed API.

It serves `/v1/chat/completions`, `/v1/completions`, `/v1/audio/transcriptions`,
`/v1/embeddings` and `/v1/moderations` with the embedded server's own code (api/realtime.py), so
checks, admission (429 with Retry-After), spend reservations (store/spend.py), streaming and the
abort of a request whose client left behave alike in both deployments; the API forwards requests
here and passes the answers back unchanged (api/engine_proxy.py). `GET /internal/load` tells this
engine's load. Every heartbeat the host writes its address and load into Redis
(store/engine_registry.py), where the API finds it; the record lapses within seconds of the
worker dying, and is deleted at the first heartbeat after its engine died.

uvicorn runs it on an event loop of its own, in a thread of the worker process. When
`engine_secret` is set, every request must bear it (`Authorization: Bearer <secret>`); a host
bound beyond loopback refuses to start without one, as it would otherwise open the engine to
anyone who can reach the port, past the API's keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from redis.asyncio import Redis
from redis.exceptions import RedisError

from pagedbatch.addresses import is_loopback
from pagedbatch.api.app import install_error_handling
from pagedbatch.api.deps import Services
from pagedbatch.api.realtime import Admission, realtime_limit
from pagedbatch.api.responses import routes as responses
from pagedbatch.api.routes import audio, chat, completions, embeddings, moderations
from pagedbatch.api.routes.engine import settings_in_force
from pagedbatch.api.token_rate import TokenRate
from pagedbatch.api.web_guard import WebGuardMiddleware
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.settings import Settings
from pagedbatch.store.engine_registry import EngineRecord, publish, withdraw
from pagedbatch.store.spend import SpendGuard

logger = logging.getLogger(__name__)

START_SECONDS = 30.0
# Streams still running when the worker stops get this long to end; the API then tries another.
GRACEFUL_STOP_SECONDS = 5


class EngineHost:
    """The engine host of one worker: `start()` binds and serves, `stop()` withdraws and ends."""

    def __init__(self, services: Services, engine_id: str) -> None:
        """`services` are the worker's own, with its engine; `engine_id` names the host in the
        registry (the worker's id)."""
        if services.engine is None:
            raise RuntimeError("an engine host needs a worker with an engine")
        settings = services.settings
        if settings.broker_url is None:
            raise ValueError("an engine host registers in the broker's Redis: set a broker URL")
        if settings.engine_secret is None and not is_loopback(settings.engine_host):
            raise ValueError(
                f"the engine host would listen on {settings.engine_host}, beyond loopback, "
                "without a secret: set PAGEDBATCH_ENGINE_SECRET (the same on the API)"
            )
        self.sock = _bind(settings.engine_host, settings.engine_port)
        port = self.sock.getsockname()[1]
        self.address = settings.engine_address or (
            f"http://{_url_host(_advertised_host(settings.engine_host))}:{port}"
        )
        self.engine_id = engine_id
        self.services = services
        self.app = engine_host_app(settings, services, self.engine_id, self.address)
        config = uvicorn.Config(
            self.app,
            log_config=None,
            lifespan="on",
            timeout_graceful_shutdown=GRACEFUL_STOP_SECONDS,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
            name="pagedbatch-engine-host",
            daemon=True,
        )

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + START_SECONDS
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the engine host did not start")
            time.sleep(0.01)
        logger.info("engine host %s serving at %s", self.engine_id, self.address)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(GRACEFUL_STOP_SECONDS + START_SECONDS)
        if self.services.ledger is not None:
            self.services.ledger.close()  # what the last requests used


def engine_host_app(
    settings: Settings, services: Services, engine_id: str, address: str
) -> FastAPI:
    """The host's app; while it runs, it heartbeats its record into the broker's Redis."""
    assert services.engine is not None and settings.broker_url is not None
    admission = Admission(
        realtime_limit(settings, services.engine.engine), settings.realtime_tenant_share
    )
    engine = services.engine
    model = engine.engine.model_name
    figures: dict[str, Any] = {"running": 0, "waiting": 0, "kv_usage": 0.0}
    engine_settings = settings_in_force(engine.engine)
    resident = engine.engine.resident.as_dict()
    rate = TokenRate()
    beats = 0

    async def record(beat: bool = False) -> EngineRecord:
        nonlocal beats
        try:
            # Answered between two steps; during a long prefill step the last figures serve.
            async with asyncio.timeout(settings.engine_heartbeat_seconds):
                stats = await engine.get_stats()
            figures.update({name: stats[name] for name in ("running", "waiting", "kv_usage")})
            if beat:
                at = time.monotonic()
                figures["tokens_per_second"] = rate.update(stats["generation_tokens"], at)
        except TimeoutError:
            pass
        beats += beat
        return EngineRecord(
            id=engine_id,
            address=address,
            model=model,
            admitted=admission.admitted,
            max_admitted=admission.limit,
            beat=beats,
            settings=engine_settings,
            resident=resident,
            # Read as it stands (adapters are loaded and unloaded while serving).
            adapters=list(engine.engine.lora_names),
            **figures,
        )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        redis = Redis.from_url(settings.broker_url)
        stopping = asyncio.Event()
        heartbeat = asyncio.create_task(
            _heartbeat(
                redis,
                lambda: record(beat=True),
                settings.engine_heartbeat_seconds,
                lambda: services.dead_engine() is not None,
                engine_id,
                stopping,
            )
        )
        try:
            yield
        finally:
            # The event ends the loop even if a client library swallows the cancellation.
            stopping.set()
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
            with contextlib.suppress(RedisError):
                await withdraw(redis, engine_id)  # the API stops routing here at once
            await redis.aclose()

    app = FastAPI(title="pagedbatch engine host", lifespan=lifespan)
    app.state.services = services
    # Requests are tokenized here, so their spend is reserved here (the API reserves none).
    app.state.spend = SpendGuard(services.session_factory, settings)
    # The one api/realtime.py would make for the main engine.
    app.state.realtime_admissions = {services.engine.engine.model_name: admission}
    guarded = [Depends(_secret_check(settings.engine_secret))]
    v1 = APIRouter(prefix="/v1", dependencies=guarded)
    v1.include_router(audio.router)
    v1.include_router(chat.router)
    v1.include_router(completions.router)
    v1.include_router(embeddings.router)  # on the worker's embedding model, or its own
    v1.include_router(moderations.router)  # on the worker's moderation model, where it has one
    v1.include_router(responses.router)  # kept in the job store here, which the API reads
    app.include_router(v1)

    @app.get("/internal/load", dependencies=guarded)
    async def load() -> EngineRecord:
        return await record()

    # Only the API calls a host, by its address: a web page reaching it on loopback (DNS
    # rebinding, a cross-site form) names another Host or sends an Origin, and gets nothing.
    app.add_middleware(
        WebGuardMiddleware,
        bound_host=settings.engine_host,
        allowed_hosts=[urlsplit(address).hostname or "", *settings.allowed_hosts],
        cors_origins=[],
    )
    install_error_handling(app, adopt_request_ids=True)  # the API's ids, whose lines match
    return app


async def _heartbeat(
    redis: Redis,
    record: Callable[[], Awaitable[EngineRecord]],
    interval: float,
    engine_died: Callable[[], bool],
    engine_id: str,
    stopping: asyncio.Event,
) -> None:
    """Publish this host's record every `interval` seconds until `stopping` is set."""
    while not stopping.is_set():
        started = time.monotonic()
        try:
            if engine_died():
                # Its stats would never come, and requests routed here would fail: the API must
                # stop sending any at once, not when the last record lapses.
                logger.error("engine host %s withdraws: its engine died", engine_id)
                await withdraw(redis, engine_id)
                return
            await publish(redis, await record(), interval)
        except RedisError as e:
            # The API cannot see this host until Redis is back; the next beat tries again.
            logger.warning("engine host heartbeat failed (%s); the next beat tries again", e)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, interval - (time.monotonic() - started))):
                await stopping.wait()


def _secret_check(secret: str | None) -> Callable[[Request], None]:
    expected = f"Bearer {secret}".encode() if secret is not None else None

    def check(request: Request) -> None:
        if expected is None:
            return
        presented = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(presented, expected):
            raise OpenAIError(
                "This is a pagedbatch engine host: only the pagedbatch API may call it.",
                status_code=401,
                code="invalid_api_key",
            )

    return check


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _advertised_host(bind_host: str) -> str:
    """Where others reach a host bound to `bind_host`: the machine's address for a wildcard
    (in a container, its address on the container network)."""
    if bind_host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return bind_host


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

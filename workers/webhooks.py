"""Delivering webhook messages: signed POSTs, retried with backoff until a receiver takes them.

At least once, never in parallel: a message is claimed in the job store before each attempt, so
copies of its task (a retry's countdown and the sweep, or a Celery task delivered twice) never
send it at once, and a claim whose process died lapses for the sweep to find. Every attempt is
logged. A 2xx delivers; 410 Gone disables the endpoint; anything else (3xx included: redirects
are not followed) is retried until `webhook_max_attempts`.

Slow receivers are contained: an attempt ends at `webhook_attempt_deadline_seconds` however its
receiver trickles, and a tenant has at most `webhook_tenant_concurrency` attempts in flight, its
other messages waiting a moment, so one tenant's endpoints cannot hold every delivery thread.

A pending message's `next_attempt_at` is when its queued task is due: each enqueue sets it. The
sweep queues again only a message due for `webhook_requeue_after_seconds` with no attempt, whose
task was lost, so messages waiting in a busy queue are not queued twice over.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass

import httpx
from sqlalchemy import Select, func, or_, select, update
from sqlalchemy.orm import Session, aliased

from pagedbatch.egress import ForbiddenDestination, check_url
from pagedbatch.ids import new_id, now
from pagedbatch.protocol.webhook_signing import signed_headers
from pagedbatch.settings import Settings
from pagedbatch.store.db import transaction
from pagedbatch.store.models import (
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    WebhookMessage,
    WebhookMessageStatus,
    WebhookOutcome,
)
from pagedbatch.store.webhooks import new_messages
from pagedbatch.workers.context import WorkerContext

logger = logging.getLogger(__name__)

USER_AGENT = "pagedbatch-webhooks/1.0"
DELIVERY_THREADS = 4  # embedded: deliveries at once, on threads batch work does not use
MAX_RESPONSE_BYTES = 4096  # read of a response, for the log; the rest is never read
MAX_ERROR_CHARS = 500
CLOCK_SLACK_SECONDS = 1.0  # a retry whose timer fires a little early still finds its message due
SWEEP_LIMIT = 1000
# A claim outlives its attempt (bounded by the deadline) by this much, for recording the result.
CLAIM_MARGIN_SECONDS = 30.0
# A message whose tenant has its fill of attempts in flight tries again after this long, times
# 1 to 2 so deferred messages do not come back in step.
TENANT_BUSY_DELAY_SECONDS = 1.0
THROTTLED = {429, 503}  # statuses whose Retry-After is honoured


@dataclass(frozen=True)
class _Attempt:
    message_id: str
    number: int  # 1 for the first
    endpoint_id: str
    url: str
    signing_secrets: list[str]
    body: bytes


@dataclass(frozen=True)
class _Deferred:
    delay: float  # seconds until the message's task runs again


@dataclass(frozen=True)
class _Result:
    outcome: WebhookOutcome
    status_code: int | None = None
    latency_ms: int | None = None
    error: str | None = None
    retry_after: float | None = None


def event_body(event: WebhookEvent) -> bytes:
    """OpenAI's thin payload: the receiver fetches the batch (or the response) itself."""
    payload = {
        "id": event.id,
        "object": "event",
        "type": event.type,
        "created_at": event.created_at,
        "data": {"id": event.batch_id or event.response_id},
    }
    return json.dumps(payload, separators=(",", ":")).encode()


def queue_batch_webhooks(ctx: WorkerContext, batch_id: str) -> None:
    """Queue the first attempt of each message the batch's end created; call it once that
    transaction has committed. Anything missed here is found by `sweep_webhooks`."""
    with ctx.session_factory() as session:
        message_ids = new_messages(session, batch_id=batch_id)
    for message_id in message_ids:
        ctx.queue.enqueue("deliver_webhook", message_id)


def queue_response_webhooks(ctx: WorkerContext, response_id: str) -> None:
    """As `queue_batch_webhooks`, for a background response's end."""
    with ctx.session_factory() as session:
        message_ids = new_messages(session, response_id=response_id)
    for message_id in message_ids:
        ctx.queue.enqueue("deliver_webhook", message_id)


def sweep_webhooks(ctx: WorkerContext) -> None:
    """Queue the messages whose task was lost: due for `webhook_requeue_after_seconds` and not
    being attempted. A lost task, a crashed attempt or a restart loses no delivery; a message
    whose task waits in the queue is left alone."""
    moment = time.time()
    lost_since = moment - ctx.settings.webhook_requeue_after_seconds
    lost = (
        WebhookMessage.status == WebhookMessageStatus.PENDING,
        WebhookMessage.next_attempt_at <= lost_since,
        or_(WebhookMessage.claimed_until.is_(None), WebhookMessage.claimed_until < moment),
    )
    with transaction(ctx.session_factory) as session:
        candidates = (
            select(WebhookMessage.id)
            .where(*lost)
            .order_by(WebhookMessage.next_attempt_at)
            .limit(SWEEP_LIMIT)
        )
        # Due now, as the task queued below is: a sweep running at the same time, or the next
        # one, finds the message in the queue and leaves it.
        message_ids = session.scalars(
            update(WebhookMessage)
            .where(WebhookMessage.id.in_(candidates.scalar_subquery()), *lost)
            .values(next_attempt_at=moment)
            .returning(WebhookMessage.id)
        ).all()
    for message_id in message_ids:
        ctx.queue.enqueue("deliver_webhook", message_id)


def deliver_webhook(ctx: WorkerContext, message_id: str) -> None:
    """One attempt at the message, if it is due and nobody else is attempting it."""
    attempt = _claim(ctx, message_id)
    if isinstance(attempt, _Deferred):
        ctx.queue.enqueue("deliver_webhook", message_id, delay=attempt.delay)
        return
    if attempt is None:
        return
    result = _send(ctx.settings, attempt)
    retry_in = _record(ctx, attempt, result)
    if retry_in is not None:
        ctx.queue.enqueue("deliver_webhook", message_id, delay=retry_in)


def backoff(settings: Settings, failed_attempts: int, retry_after: float | None = None) -> float:
    """Seconds to wait after `failed_attempts` failures: doubling from the initial backoff, with
    ±25% jitter so receivers coming back up are not hit by every sender at once, capped."""
    base = settings.webhook_initial_backoff_seconds * 2.0 ** min(failed_attempts - 1, 64)
    delay = min(settings.webhook_max_backoff_seconds, base * random.uniform(0.75, 1.25))
    if retry_after is not None:
        delay = max(delay, min(retry_after, settings.webhook_max_backoff_seconds))
    return delay


def _claim(ctx: WorkerContext, message_id: str) -> _Attempt | _Deferred | None:
    """The attempt to make now; or, when the message's tenant has its fill of attempts in
    flight, how long to wait; None when the message is not due or someone else attempts it."""
    settings = ctx.settings
    moment = time.time()
    # Longer than any attempt can take: the deadline bounds it.
    hold = settings.webhook_attempt_deadline_seconds + CLAIM_MARGIN_SECONDS
    free = (
        WebhookMessage.id == message_id,
        WebhookMessage.status == WebhookMessageStatus.PENDING,
        WebhookMessage.next_attempt_at <= moment + CLOCK_SLACK_SECONDS,
        or_(WebhookMessage.claimed_until.is_(None), WebhookMessage.claimed_until < moment),
    )
    with transaction(ctx.session_factory) as session:
        owner = session.scalar(
            select(WebhookEndpoint.owner)
            .join(WebhookMessage, WebhookMessage.endpoint_id == WebhookEndpoint.id)
            .where(WebhookMessage.id == message_id)
        )
        if owner is None:
            return None  # its endpoint was deleted, and its messages with it
        _lock_tenant(session, owner)
        claimed = session.execute(
            update(WebhookMessage)
            .where(
                *free,
                _in_flight(owner, moment).scalar_subquery() < settings.webhook_tenant_concurrency,
            )
            .values(claimed_until=moment + hold)
        )
        if claimed.rowcount != 1:
            # Free but not claimed: its tenant is busy. Due later, as its task will be.
            delay = TENANT_BUSY_DELAY_SECONDS * random.uniform(1.0, 2.0)
            deferred = session.execute(
                update(WebhookMessage).where(*free).values(next_attempt_at=moment + delay)
            )
            return _Deferred(delay) if deferred.rowcount == 1 else None
        message = session.get(WebhookMessage, message_id)
        endpoint = session.get(WebhookEndpoint, message.endpoint_id)
        if endpoint.disabled_at is not None:
            message.status = WebhookMessageStatus.FAILED
            message.claimed_until = None
            return None
        signing_secrets = [endpoint.secret]
        if endpoint.previous_secret and (endpoint.previous_secret_expires_at or 0) > now():
            signing_secrets.append(endpoint.previous_secret)
        event = session.get(WebhookEvent, message.event_id)
        return _Attempt(
            message_id=message.id,
            number=message.attempts + 1,
            endpoint_id=endpoint.id,
            url=endpoint.url,
            signing_secrets=signing_secrets,
            body=event_body(event),
        )


def _lock_tenant(session: Session, owner: str) -> None:
    """Claims of one tenant's messages take turns, so two workers cannot both take its last free
    slot: PostgreSQL locks the tenant's endpoint rows, in id order, before any message row (as
    everything that locks both does). NO KEY UPDATE, so inserting a delivery-log row, whose
    foreign key share-locks its endpoint, does not wait on it. SQLite needs nothing: it writes
    one transaction at a time, and the claim's count and update are one statement."""
    session.execute(
        select(WebhookEndpoint.id)
        .where(WebhookEndpoint.owner == owner)
        .order_by(WebhookEndpoint.id)
        .with_for_update(key_share=True)
    )


def _in_flight(owner: str, moment: float) -> Select[tuple[int]]:
    """The tenant's messages being attempted at `moment`: those with a live claim."""
    other = aliased(WebhookMessage)
    return (
        select(func.count())
        .select_from(other)
        .join(WebhookEndpoint, WebhookEndpoint.id == other.endpoint_id)
        .where(
            WebhookEndpoint.owner == owner,
            other.status == WebhookMessageStatus.PENDING,
            other.claimed_until >= moment,
        )
    )


def _send(settings: Settings, attempt: _Attempt) -> _Result:
    try:
        destination = check_url(attempt.url, settings.webhook_allowed_hosts)
    except ForbiddenDestination as e:
        return _Result(WebhookOutcome.FAILED, error=f"refused: {e}"[:MAX_ERROR_CHARS])
    url = destination.url
    headers = {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        # The connection goes to the address that was checked; the receiver still sees its name.
        "host": url.netloc.decode("ascii"),
        **signed_headers(attempt.signing_secrets, attempt.message_id, now(), attempt.body),
    }
    extensions = {"sni_hostname": destination.host} if url.scheme == "https" else {}
    request = httpx.Request(
        "POST",
        url.copy_with(host=str(destination.address)),
        content=attempt.body,
        headers=headers,
        extensions=extensions,
    )
    started = time.monotonic()
    deadline = settings.webhook_attempt_deadline_seconds
    try:
        response, latency_ms, excerpt = asyncio.run(
            _post(request, settings.webhook_timeout_seconds, deadline, started)
        )
    except TimeoutError:
        error = f"timed out: the receiver did not answer within the {deadline:g} s deadline"
        return _Result(WebhookOutcome.FAILED, latency_ms=_since(started), error=error)
    except httpx.HTTPError as e:
        return _Result(WebhookOutcome.FAILED, latency_ms=_since(started), error=_describe(e))
    code = response.status_code
    if 200 <= code < 300:
        return _Result(WebhookOutcome.DELIVERED, code, latency_ms)
    if code == 410:
        return _Result(WebhookOutcome.DISABLED, code, latency_ms, "410 Gone: endpoint disabled")
    error = f"HTTP {code}"
    if 300 <= code < 400:
        error += ": redirects are not followed"
    elif text := excerpt.decode(errors="replace").strip():
        error += f": {text}"
    retry_after = _retry_after(response) if code in THROTTLED else None
    return _Result(WebhookOutcome.FAILED, code, latency_ms, error[:MAX_ERROR_CHARS], retry_after)


def _record(ctx: WorkerContext, attempt: _Attempt, result: _Result) -> float | None:
    """Log the attempt and move the message on; returns the delay before a retry, if any."""
    settings = ctx.settings
    values: dict[str, object] = {"attempts": attempt.number, "claimed_until": None}
    retry_in = None
    out_of_attempts = attempt.number >= settings.webhook_max_attempts
    if result.outcome == WebhookOutcome.DELIVERED:
        values["status"] = WebhookMessageStatus.DELIVERED
    elif result.outcome == WebhookOutcome.DISABLED or out_of_attempts:
        values["status"] = WebhookMessageStatus.FAILED
    else:
        retry_in = backoff(settings, attempt.number, result.retry_after)
        values["next_attempt_at"] = time.time() + retry_in
    with transaction(ctx.session_factory) as session:
        if result.outcome == WebhookOutcome.DISABLED:
            # The endpoint's row before the message's, the order claims lock them in.
            session.execute(
                update(WebhookEndpoint)
                .where(WebhookEndpoint.id == attempt.endpoint_id)
                .values(disabled_at=now(), disabled_reason="The receiver answered 410 Gone.")
            )
        moved = session.execute(
            update(WebhookMessage).where(WebhookMessage.id == attempt.message_id).values(**values)
        )
        if moved.rowcount != 1:
            return None  # the endpoint was deleted meanwhile, and its messages and log with it
        session.add(
            WebhookDelivery(
                id=new_id("whd_"),
                message_id=attempt.message_id,
                endpoint_id=attempt.endpoint_id,
                attempt=attempt.number,
                outcome=result.outcome,
                status_code=result.status_code,
                latency_ms=result.latency_ms,
                error=result.error,
                created_at=now(),
            )
        )
    if result.outcome != WebhookOutcome.DELIVERED:
        logger.info("webhook %s attempt %d: %s", attempt.message_id, attempt.number, result.error)
    return retry_in


async def _post(
    request: httpx.Request, timeout: float, deadline: float, started: float
) -> tuple[httpx.Response, int, bytes]:
    """Send `request`; returns the response, the milliseconds until its headers, and the start
    of its body. httpx's timeouts bound each connect, write and read, which a receiver sending a
    byte at a time never trips, so the whole exchange is cut off at `deadline` seconds too
    (raising TimeoutError): cancelling a coroutine stops it wherever it waits."""
    async with (
        asyncio.timeout(deadline),
        httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False) as client,
    ):
        response = await client.send(request, stream=True)
        try:
            latency_ms = _since(started)
            return response, latency_ms, await _read_some(response)
        finally:
            await response.aclose()


async def _read_some(response: httpx.Response) -> bytes:
    """The start of the body, raw (never decompressed): a receiver cannot make us read much."""
    excerpt = bytearray()
    async for chunk in response.aiter_raw():
        excerpt += chunk
        if len(excerpt) >= MAX_RESPONSE_BYTES:
            break
    return bytes(excerpt[:MAX_RESPONSE_BYTES])


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(0, int(response.headers.get("retry-after", "")))
    except ValueError:
        return None  # absent, or an HTTP date: the backoff alone decides


def _describe(error: httpx.HTTPError) -> str:
    if isinstance(error, httpx.TimeoutException):
        text = f"timed out ({type(error).__name__})"
    elif isinstance(error, httpx.ConnectError):
        text = f"connection failed: {error}"
    else:
        text = f"{type(error).__name__}: {error}"
    return text[:MAX_ERROR_CHARS]


def _since(started: float) -> int:
    return round((time.monotonic() - started) * 1000)

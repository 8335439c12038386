"""Delivering webhook messages: signed POSTs, retried with backoff until a receiver takes them.

At least once, never in parallel: a message is claimed in the job store before each attempt, so
copies of its task (a retry's countdown and the sweep, or a Celery task delivered twice) never
send it at once, and a claim whose process died lapses for the sweep to find. Every attempt is
logged. A 2xx delivers; 410 Gone disables the endpoint; anything else (3xx included: redirects
are not followed) is retried until `webhook_max_attempts`.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass

import httpx
from sqlalchemy import or_, select, update

from pagedbatch.ids import new_id, now
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
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.egress import ForbiddenDestination, check_url
from pagedbatch.workers.webhook_signing import signed_headers

logger = logging.getLogger(__name__)

USER_AGENT = "pagedbatch-webhooks/1.0"
DELIVERY_THREADS = 4  # embedded: deliveries at once, on threads batch work does not use
MAX_RESPONSE_BYTES = 4096  # read of a response, for the log; the rest is never read
MAX_ERROR_CHARS = 500
CLOCK_SLACK_SECONDS = 1.0  # a retry whose timer fires a little early still finds its message due
SWEEP_LIMIT = 1000
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
class _Result:
    outcome: WebhookOutcome
    status_code: int | None = None
    latency_ms: int | None = None
    error: str | None = None
    retry_after: float | None = None


def event_body(event: WebhookEvent) -> bytes:
    """OpenAI's thin payload: the receiver fetches the batch itself."""
    payload = {
        "id": event.id,
        "object": "event",
        "type": event.type,
        "created_at": event.created_at,
        "data": {"id": event.batch_id},
    }
    return json.dumps(payload, separators=(",", ":")).encode()


def queue_batch_webhooks(ctx: WorkerContext, batch_id: str) -> None:
    """Queue the first attempt of each message the batch's end created; call it once that
    transaction has committed. Anything missed here is found by `sweep_webhooks`."""
    with ctx.session_factory() as session:
        message_ids = session.scalars(
            select(WebhookMessage.id)
            .join(WebhookEvent, WebhookEvent.id == WebhookMessage.event_id)
            .where(
                WebhookEvent.batch_id == batch_id,
                WebhookMessage.status == WebhookMessageStatus.PENDING,
                WebhookMessage.attempts == 0,
            )
        ).all()
    for message_id in message_ids:
        ctx.queue.enqueue("deliver_webhook", message_id)


def sweep_webhooks(ctx: WorkerContext) -> None:
    """Queue the messages that are due and not being attempted: a lost task, a crashed attempt
    or a restart loses no delivery."""
    moment = time.time()
    with ctx.session_factory() as session:
        message_ids = session.scalars(
            select(WebhookMessage.id)
            .where(
                WebhookMessage.status == WebhookMessageStatus.PENDING,
                WebhookMessage.next_attempt_at <= moment,
                or_(WebhookMessage.claimed_until.is_(None), WebhookMessage.claimed_until < moment),
            )
            .order_by(WebhookMessage.next_attempt_at)
            .limit(SWEEP_LIMIT)
        ).all()
    for message_id in message_ids:
        ctx.queue.enqueue("deliver_webhook", message_id)


def deliver_webhook(ctx: WorkerContext, message_id: str) -> None:
    """One attempt at the message, if it is due and nobody else is attempting it."""
    attempt = _claim(ctx, message_id)
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


def _claim(ctx: WorkerContext, message_id: str) -> _Attempt | None:
    moment = time.time()
    # Longer than any attempt can take (connect, send, read, each bounded by the timeout).
    hold = 4 * ctx.settings.webhook_timeout_seconds + 30
    with transaction(ctx.session_factory) as session:
        claimed = session.execute(
            update(WebhookMessage)
            .where(
                WebhookMessage.id == message_id,
                WebhookMessage.status == WebhookMessageStatus.PENDING,
                WebhookMessage.next_attempt_at <= moment + CLOCK_SLACK_SECONDS,
                or_(WebhookMessage.claimed_until.is_(None), WebhookMessage.claimed_until < moment),
            )
            .values(claimed_until=moment + hold)
        )
        if claimed.rowcount != 1:
            return None
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
    started = time.monotonic()
    try:
        with (
            httpx.Client(
                timeout=settings.webhook_timeout_seconds, follow_redirects=False, trust_env=False
            ) as client,
            client.stream(
                "POST",
                url.copy_with(host=str(destination.address)),
                content=attempt.body,
                headers=headers,
                extensions=extensions,
            ) as response,
        ):
            latency_ms = _since(started)
            excerpt = _read_some(response)
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
        if result.outcome == WebhookOutcome.DISABLED:
            session.execute(
                update(WebhookEndpoint)
                .where(WebhookEndpoint.id == attempt.endpoint_id)
                .values(disabled_at=now(), disabled_reason="The receiver answered 410 Gone.")
            )
    if result.outcome != WebhookOutcome.DELIVERED:
        logger.info("webhook %s attempt %d: %s", attempt.message_id, attempt.number, result.error)
    return retry_in


def _read_some(response: httpx.Response) -> bytes:
    """The start of the body, raw (never decompressed): a receiver cannot make us read much."""
    excerpt = bytearray()
    for chunk in response.iter_raw():
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

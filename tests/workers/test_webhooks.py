"""Webhook delivery on a real job store, to a real receiver, through the in-process task queue:
what each kind of answer does, signatures across a secret rotation, and recovery by the sweep.

Events come from the batch state machine itself (a batch failing validation); the end-to-end
tests with the whole service are in tests/api/test_webhook_events.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import openai
import pytest
from services import postgres_schema
from sqlalchemy import select
from webhook_receiver import Receiver

from pagedbatch.ids import new_id, now
from pagedbatch.protocol.webhook_signing import new_secret
from pagedbatch.service import open_store
from pagedbatch.settings import Settings
from pagedbatch.store.batches import transition
from pagedbatch.store.db import transaction
from pagedbatch.store.models import (
    Batch,
    BatchStatus,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookMessage,
)
from pagedbatch.store.queue import InProcessQueue
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.tasks import run_task
from pagedbatch.workers.webhooks import backoff, queue_batch_webhooks, sweep_webhooks

FAST = {
    "webhook_initial_backoff_seconds": 0.05,
    "webhook_max_backoff_seconds": 0.1,
    "webhook_timeout_seconds": 5.0,
    "webhook_allowed_hosts": ["127.0.0.1"],
}


@pytest.fixture
def make_context(tmp_path, request) -> Iterator[Any]:
    """`make_context(storage="sqlite", **settings)`: a worker context on SQLite or PostgreSQL
    whose queue runs the real tasks."""
    with ExitStack() as cleanup:

        def make(storage: str = "sqlite", **settings: Any) -> WorkerContext:
            if storage == "postgresql":
                url = request.getfixturevalue("postgres_url")
                settings["database_url"] = cleanup.enter_context(postgres_schema(url))
            config = Settings(data_dir=tmp_path / "data", **{**FAST, **settings})
            session_factory, blobs = open_store(config)
            cleanup.callback(session_factory.kw["bind"].dispose)
            ctx = WorkerContext(config, session_factory, blobs, queue=None)
            ctx.queue = InProcessQueue(lambda name, args: run_task(ctx, name, args))
            cleanup.callback(lambda: ctx.queue.shutdown())  # the queue a test left in place
            return ctx

        yield make


def add_endpoint(ctx: WorkerContext, url: str, **values: Any) -> WebhookEndpoint:
    fields = {"id": new_id("whep_"), "owner": "default", "url": url, "secret": new_secret()}
    endpoint = WebhookEndpoint(**{**fields, **values})
    with transaction(ctx.session_factory) as session:
        session.add(endpoint)
    return endpoint


def fail_a_batch(ctx: WorkerContext, owner: str = "default") -> str:
    """A batch that fails validation, as the validator ends one; returns its id."""
    batch_id = new_id("batch_")
    with transaction(ctx.session_factory) as session:
        session.add(
            Batch(
                id=batch_id,
                owner=owner,
                endpoint="/v1/chat/completions",
                input_file_id="file-x",
                completion_window="24h",
                status=BatchStatus.VALIDATING,
            )
        )
        session.flush()
        assert transition(session, batch_id, BatchStatus.FAILED)
    return batch_id


def attempts(ctx: WorkerContext, endpoint_id: str) -> list[WebhookDelivery]:
    with ctx.session_factory() as session:
        return list(
            session.scalars(
                select(WebhookDelivery)
                .where(WebhookDelivery.endpoint_id == endpoint_id)
                .order_by(WebhookDelivery.attempt)
            )
        )


def settled(ctx: WorkerContext, endpoint_id: str, timeout: float = 20.0) -> list[WebhookMessage]:
    """The endpoint's messages once none is pending."""
    deadline = time.monotonic() + timeout
    while True:
        with ctx.session_factory() as session:
            messages = list(
                session.scalars(
                    select(WebhookMessage).where(WebhookMessage.endpoint_id == endpoint_id)
                )
            )
        if messages and all(message.status != "pending" for message in messages):
            return messages
        assert time.monotonic() < deadline, f"still pending: {messages}"
        time.sleep(0.05)


def test_a_2xx_delivers_once_signed_with_the_thin_event(make_context):
    ctx = make_context()
    with Receiver(statuses=[204]) as receiver:
        endpoint = add_endpoint(ctx, receiver.url())
        batch_id = fail_a_batch(ctx)
        queue_batch_webhooks(ctx, batch_id)
        [message] = settled(ctx, endpoint.id)
        [request] = receiver.received

    assert message.status == "delivered" and message.attempts == 1
    assert request.headers["webhook-id"] == message.id and message.id.startswith("wh_")
    assert request.headers["content-type"] == "application/json"
    event = openai.OpenAI(api_key="unused").webhooks.unwrap(
        request.body, request.headers, secret=endpoint.secret
    )
    assert event.type == "batch.failed" and event.data.id == batch_id
    assert event.id.startswith("evt_") and abs(event.created_at - now()) < 60
    [attempt] = attempts(ctx, endpoint.id)
    assert (attempt.outcome, attempt.status_code, attempt.error) == ("delivered", 204, None)
    assert attempt.latency_ms is not None and attempt.latency_ms >= 0


def test_410_disables_the_endpoint_and_later_events_skip_it(make_context):
    ctx = make_context()
    with Receiver(statuses=[410]) as receiver:
        endpoint = add_endpoint(ctx, receiver.url())
        queue_batch_webhooks(ctx, fail_a_batch(ctx))
        [message] = settled(ctx, endpoint.id)
        later = fail_a_batch(ctx)
        queue_batch_webhooks(ctx, later)
        time.sleep(0.3)
        assert len(receiver.received) == 1

    assert message.status == "failed"
    [attempt] = attempts(ctx, endpoint.id)
    assert (attempt.outcome, attempt.status_code) == ("disabled", 410)
    with ctx.session_factory() as session:
        row = session.get(WebhookEndpoint, endpoint.id)
        assert row.disabled_at is not None and "410" in row.disabled_reason
        assert session.scalars(select(WebhookMessage.id)).all() == [message.id]


def test_redirects_are_failures_not_followed_and_retries_stop_at_max_attempts(make_context):
    ctx = make_context(webhook_max_attempts=3)
    with Receiver(then=307) as receiver:
        endpoint = add_endpoint(ctx, receiver.url())
        queue_batch_webhooks(ctx, fail_a_batch(ctx))
        [message] = settled(ctx, endpoint.id)
        time.sleep(0.3)  # nothing more comes

        assert message.status == "failed" and message.attempts == 3
        assert [r.path for r in receiver.received] == ["/hook"] * 3  # never /redirected
        assert len({r.headers["webhook-id"] for r in receiver.received}) == 1
    log = attempts(ctx, endpoint.id)
    assert [(a.attempt, a.outcome, a.status_code) for a in log] == [
        (1, "failed", 307),
        (2, "failed", 307),
        (3, "failed", 307),
    ]
    assert all("redirects are not followed" in a.error for a in log)


def test_500s_are_retried_with_backoff_until_delivered(make_context):
    ctx = make_context(webhook_initial_backoff_seconds=0.2, webhook_max_backoff_seconds=0.2)
    with Receiver(statuses=[500, 503]) as receiver:
        endpoint = add_endpoint(ctx, receiver.url())
        queue_batch_webhooks(ctx, fail_a_batch(ctx))
        [message] = settled(ctx, endpoint.id)
        arrivals = [r.status for r in receiver.received]

    assert message.status == "delivered" and arrivals == [500, 503, 200]
    log = attempts(ctx, endpoint.id)
    assert [(a.outcome, a.status_code) for a in log] == [
        ("failed", 500),
        ("failed", 503),
        ("delivered", 200),
    ]
    assert log[0].error == "HTTP 500: status 500"  # the start of the receiver's answer


def test_the_address_is_checked_again_at_delivery(make_context):
    ctx = make_context(webhook_allowed_hosts=[], webhook_max_attempts=1)
    with Receiver() as receiver:
        # Registered while the operator allowed loopback; no longer allowed.
        endpoint = add_endpoint(ctx, receiver.url())
        queue_batch_webhooks(ctx, fail_a_batch(ctx))
        settled(ctx, endpoint.id)
        assert receiver.received == []
    [attempt] = attempts(ctx, endpoint.id)
    assert attempt.outcome == "failed" and attempt.status_code is None
    assert attempt.error.startswith("refused: 127.0.0.1 is a loopback address")


def test_the_sweep_delivers_what_a_crash_left_unqueued(make_context):
    ctx = make_context(webhook_requeue_after_seconds=0.2)
    with Receiver() as receiver:
        endpoint = add_endpoint(ctx, receiver.url())
        fail_a_batch(ctx)  # the process died before queueing the delivery
        sweep_webhooks(ctx)
        time.sleep(0.3)
        assert receiver.received == []  # not yet: it may be waiting in a busy queue
        sweep_webhooks(ctx)
        [message] = settled(ctx, endpoint.id)
    assert message.status == "delivered"


def test_a_message_in_flight_is_neither_swept_nor_sent_twice(make_context):
    ctx = make_context()
    with Receiver() as receiver:
        endpoint = add_endpoint(ctx, receiver.url())
        fail_a_batch(ctx)
        with transaction(ctx.session_factory) as session:
            [message] = session.scalars(select(WebhookMessage)).all()
            message.claimed_until = time.time() + 60  # another worker is attempting it
        sweep_webhooks(ctx)
        ctx.queue.enqueue("deliver_webhook", message.id)
        time.sleep(0.3)
        assert receiver.received == []
        assert attempts(ctx, endpoint.id) == []


def test_after_a_rotation_both_secrets_sign_until_the_old_one_expires(make_context):
    ctx = make_context()
    old, new = new_secret(), new_secret()
    client = openai.OpenAI(api_key="unused")
    with Receiver() as receiver:
        for path, expires_at in [("/rotated", now() + 60), ("/expired", now() - 1)]:
            add_endpoint(
                ctx,
                receiver.url(path),
                secret=new,
                previous_secret=old,
                previous_secret_expires_at=expires_at,
            )
        queue_batch_webhooks(ctx, fail_a_batch(ctx))
        receiver.wait_for(lambda received: len(received) == 2)
        [during] = receiver.at("/rotated")
        [after] = receiver.at("/expired")

    for secret in (old, new):
        client.webhooks.unwrap(during.body, during.headers, secret=secret)
    client.webhooks.unwrap(after.body, after.headers, secret=new)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(after.body, after.headers, secret=old)


def test_backoff_doubles_with_jitter_up_to_the_cap_and_honours_retry_after():
    settings = Settings(webhook_initial_backoff_seconds=10, webhook_max_backoff_seconds=300)
    for failed, nominal in [(1, 10), (2, 20), (3, 40), (5, 160)]:
        delays = [backoff(settings, failed) for _ in range(200)]
        assert all(0.75 * nominal <= d <= 1.25 * nominal for d in delays)
        assert max(delays) - min(delays) > 0.1 * nominal  # jittered, not fixed
    assert all(backoff(settings, 40) <= 300 for _ in range(100))
    assert backoff(settings, 1, retry_after=120) == 120
    assert backoff(settings, 1, retry_after=10_000) == 300


def test_an_attempt_ends_at_its_deadline_however_the_receiver_trickles(make_context):
    # Each byte comes well within the per-read timeout; the whole answer would take ~20 s.
    ctx = make_context(
        webhook_attempt_deadline_seconds=1.0, webhook_timeout_seconds=5.0, webhook_max_attempts=1
    )
    with Receiver(trickle=0.3) as receiver:
        endpoint = add_endpoint(ctx, receiver.url())
        started = time.monotonic()
        queue_batch_webhooks(ctx, fail_a_batch(ctx))
        [message] = settled(ctx, endpoint.id, timeout=4.0)
        took = time.monotonic() - started
        assert len(receiver.received) == 1

    assert message.status == "failed" and took < 3.0
    [attempt] = attempts(ctx, endpoint.id)
    assert attempt.outcome == "failed" and attempt.status_code is None
    assert attempt.error == "timed out: the receiver did not answer within the 1 s deadline"
    assert 1000 <= attempt.latency_ms < 2000


@pytest.mark.parametrize("storage", ["sqlite", "postgresql"])
def test_a_tenants_slow_endpoints_take_at_most_its_share_of_delivery_threads(make_context, storage):
    # Four delivery threads (the queue's pool); tenant "slow" has four trickling endpoints.
    ctx = make_context(
        storage,
        webhook_attempt_deadline_seconds=1.5,
        webhook_tenant_concurrency=2,
        webhook_max_attempts=1,
    )
    with Receiver(trickle=0.3) as slow, Receiver() as fast:
        slow_endpoints = [add_endpoint(ctx, slow.url(f"/{i}"), owner="slow") for i in range(4)]
        fast_endpoint = add_endpoint(ctx, fast.url(), owner="fast")
        queue_batch_webhooks(ctx, fail_a_batch(ctx, owner="slow"))
        slow.wait_for(lambda received: len(received) == 2, timeout=5.0)
        started = time.monotonic()
        queue_batch_webhooks(ctx, fail_a_batch(ctx, owner="fast"))
        [delivered] = settled(ctx, fast_endpoint.id, timeout=5.0)
        waited = time.monotonic() - started
        for endpoint in slow_endpoints:  # the other two had their turn once a slot was free
            settled(ctx, endpoint.id, timeout=10.0)
        assert len(slow.received) == 4

    assert delivered.status == "delivered" and waited < 1.0
    assert slow.peak_in_flight == 2
    for endpoint in slow_endpoints:
        [attempt] = attempts(ctx, endpoint.id)  # deferring is not an attempt
        assert attempt.error.startswith("timed out")


@pytest.mark.parametrize("storage", ["sqlite", "postgresql"])
def test_the_sweep_leaves_a_message_waiting_in_the_queue_alone(make_context, storage):
    ctx = make_context(storage, webhook_attempt_deadline_seconds=2.0, webhook_max_attempts=1)
    ctx.queue.shutdown()  # one delivery thread, so a second message waits for it
    ctx.queue = InProcessQueue(
        lambda name, args: run_task(ctx, name, args), lanes={"deliver_webhook": 1}
    )
    with Receiver(trickle=0.3) as slow, Receiver() as fast:
        add_endpoint(ctx, slow.url(), owner="slow")
        queue_batch_webhooks(ctx, fail_a_batch(ctx, owner="slow"))
        slow.wait_for(lambda received: len(received) == 1, timeout=5.0)
        waiting = add_endpoint(ctx, fast.url(), owner="fast")
        queue_batch_webhooks(ctx, fail_a_batch(ctx, owner="fast"))
        for _ in range(3):
            sweep_webhooks(ctx)
            assert ctx.queue.depths()["deliver_webhook"] == 1
        [message] = settled(ctx, waiting.id, timeout=5.0)
        assert message.status == "delivered" and len(fast.received) == 1

"""Background responses on a worker: `run_response` runs a queued response to its end on the
worker's engine (as the same request in the foreground would answer), a cancel stops it and
aborts its engine requests, a run whose worker died is taken over, a response that keeps failing
fails, the spend limits hold, and a worker shutting down hands its response back."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

from batch_worker import Worker
from servers import eventually
from sqlalchemy import select, update

from pagedbatch.api.responses.stored import response_record
from pagedbatch.ids import now
from pagedbatch.protocol.pipeline import RequestContext, RequestPipeline
from pagedbatch.protocol.schemas.responses import ResponseCreateRequest
from pagedbatch.protocol.serving.responses import prepare_response
from pagedbatch.store.db import transaction
from pagedbatch.store.models import (
    ResponseStatus,
    SpendReservation,
    StoredResponse,
    UsageRecord,
    WebhookEndpoint,
    WebhookEvent,
)
from pagedbatch.store.response_runs import claim
from pagedbatch.store.responses import load_response, save_response, transition
from pagedbatch.workers.recovery import resume_work
from pagedbatch.workers.responses import requeue_lost_responses, run_response

GREEDY = {"model": "tiny", "input": "Question?", "temperature": 0, "max_output_tokens": 16}
LONG = 1500  # output tokens: many seconds on the tiny model, which never ends before its limit


def submit(
    worker: Worker, owner: str = "default", history: Sequence[dict[str, Any]] = (), **body: Any
) -> str:
    """A background response saved queued, as the API saves it (continuing `history`, the
    conversation a previous_response_id names); its id."""
    body = {**GREEDY, **body}
    params = ResponseCreateRequest.model_validate({**body, "background": True})
    prepared = prepare_response(params, worker.ctx.engine.engine, history)
    queued = prepared.placeholder("queued").model_dump(mode="json")
    record = response_record(owner, prepared, queued)
    save_response(worker.ctx.session_factory, worker.ctx.blobs, record, retention_days=30)
    return prepared.id


def stored(worker: Worker, response_id: str) -> dict[str, Any]:
    with worker.ctx.session_factory() as session:
        return load_response(session, worker.ctx.blobs, response_id).body


def row(worker: Worker, response_id: str) -> StoredResponse:
    with worker.ctx.session_factory() as session:
        return session.get(StoredResponse, response_id)


def events(worker: Worker) -> list[tuple[str, str]]:
    with worker.ctx.session_factory() as session:
        return list(session.execute(select(WebhookEvent.type, WebhookEvent.response_id)).all())


def in_foreground(worker: Worker, **body: Any) -> str:
    """The output text of the same request answered at once, at the realtime door's priority."""
    body = {**GREEDY, **body}
    engine = worker.ctx.engine
    prepared = prepare_response(ResponseCreateRequest.model_validate(body), engine.engine)
    context = RequestContext.of(
        worker.ctx.settings, "default", door="realtime", guard=None, moderation=False
    )
    outputs = asyncio.run(RequestPipeline(engine, prepared, context).final_outputs())
    [message] = prepared.response(outputs).output
    return message.content[0].text


def engine_holds(worker: Worker) -> int:
    stats = worker.ctx.engine.engine.get_stats()
    return stats["running"] + stats["waiting"]


def queued_now(worker: Worker) -> list[tuple[str, tuple[Any, ...]]]:
    """What the worker has queued, once what it just asked for has reached the queue (whose
    threads record it)."""
    time.sleep(0.2)
    return worker.queued


def run_in_thread(worker: Worker, response_id: str) -> threading.Thread:
    thread = threading.Thread(target=run_response, args=(worker.ctx, response_id))
    thread.start()
    return thread


def test_a_background_response_ends_as_the_same_request_in_the_foreground(make_batch_worker):
    worker = make_batch_worker()
    with transaction(worker.ctx.session_factory) as session:
        session.add(
            WebhookEndpoint(id="whep_1", owner="default", url="https://x.test/", secret="s")
        )
    response_id = submit(worker, instructions="Be brief.")

    run_response(worker.ctx, response_id)

    body = stored(worker, response_id)
    assert body["status"] == "incomplete"  # the tiny model runs to max_output_tokens
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["background"] is True and body["id"] == response_id
    [message] = body["output"]
    assert message["content"][0]["text"] == in_foreground(worker, instructions="Be brief.")
    assert body["usage"]["output_tokens"] == 16
    # Its usage at the standard rate (no batch), recorded once, with its event.
    with worker.ctx.session_factory() as session:
        [usage] = session.scalars(select(UsageRecord)).all()
    assert (usage.batch_id, usage.output_tokens) == (None, 16)
    assert usage.input_tokens == body["usage"]["input_tokens"]
    assert events(worker) == [("response.incomplete", response_id)]
    eventually(lambda: [name for name, _ in worker.queued] == ["deliver_webhook"])

    # A second delivery of its task finds nothing to do.
    run_response(worker.ctx, response_id)
    assert row(worker, response_id).attempts == 1 and len(events(worker)) == 1


def test_a_response_whose_previous_response_is_gone_or_running_fails_as_create_answers(
    make_batch_worker,
):
    worker = make_batch_worker()
    queued = submit(worker)  # never run here
    for previous, message in [
        ("resp_gone", "Previous response with id 'resp_gone' not found."),
        (queued, f"Previous response with id '{queued}' is still queued: "),
    ]:
        # Created while its previous response had ended, which the run finds otherwise.
        earlier = [{"type": "message", "role": "user", "content": "Hi"}]
        response_id = submit(worker, history=earlier, previous_response_id=previous)
        run_response(worker.ctx, response_id)
        body = stored(worker, response_id)
        assert (body["status"], body["error"]["code"]) == ("failed", "invalid_prompt")
        assert body["error"]["message"].startswith(message)


def test_a_cancel_stops_the_run_at_once_and_aborts_its_engine_requests(make_batch_worker):
    worker = make_batch_worker()
    response_id = submit(worker, max_output_tokens=LONG)
    running = run_in_thread(worker, response_id)
    eventually(lambda: engine_holds(worker) == 1, timeout=10)

    with transaction(worker.ctx.session_factory) as session:
        assert transition(session, response_id, ResponseStatus.CANCELLED)
    cancelled_at = time.monotonic()
    running.join(timeout=10)

    assert not running.is_alive()
    assert time.monotonic() - cancelled_at < 3
    eventually(lambda: engine_holds(worker) == 0, timeout=1)  # aborted, not left to run on
    assert stored(worker, response_id)["status"] == "cancelled"
    assert events(worker) == [("response.cancelled", response_id)]
    with worker.ctx.session_factory() as session:
        assert session.scalars(select(UsageRecord)).all() == []


def test_a_response_whose_worker_died_is_queued_again_and_taken_over(make_batch_worker):
    worker = make_batch_worker(lease_seconds=30)
    response_id = submit(worker)
    # A worker took it and died: its lease lapses, with nothing written.
    assert claim(worker.ctx.session_factory, response_id, "dead:1", 30) is not None
    requeue_lost_responses(worker.ctx)
    assert queued_now(worker) == []  # still leased
    with transaction(worker.ctx.session_factory) as session:
        session.execute(update(StoredResponse).values(lease_expires_at=time.time() - 1))

    requeue_lost_responses(worker.ctx)
    eventually(lambda: worker.queued == [("run_response", (response_id,))])
    run_response(worker.ctx, *worker.queued.pop()[1])

    assert stored(worker, response_id)["status"] == "incomplete"
    assert row(worker, response_id).attempts == 2
    requeue_lost_responses(worker.ctx)
    assert queued_now(worker) == [] and len(events(worker)) == 1


def test_a_queued_response_whose_task_was_lost_is_queued_again(make_batch_worker):
    worker = make_batch_worker(lease_seconds=30)
    response_id = submit(worker)  # its task never reaches a worker: a broker restart lost it
    requeue_lost_responses(worker.ctx)
    assert queued_now(worker) == []  # queued just now: its task may be on its way
    with transaction(worker.ctx.session_factory) as session:
        session.execute(update(StoredResponse).values(created_at=now() - 31))

    requeue_lost_responses(worker.ctx)
    requeue_lost_responses(worker.ctx)  # once a lease: the next round leaves it to that task
    eventually(lambda: worker.queued == [("run_response", (response_id,))])
    run_response(worker.ctx, response_id)
    assert stored(worker, response_id)["status"] == "incomplete"

    # A process that starts queues every queued response at once: an embedded server's queue
    # kept its tasks in memory.
    restarted = submit(worker)
    resume_work(worker.ctx)
    eventually(lambda: ("run_response", (restarted,)) in worker.queued)


def test_a_response_claimed_too_often_fails_rather_than_run_again(make_batch_worker):
    worker = make_batch_worker(max_shard_attempts=2)
    response_id = submit(worker)
    with transaction(worker.ctx.session_factory) as session:
        session.execute(update(StoredResponse).values(attempts=2, status="in_progress"))

    run_response(worker.ctx, response_id)

    body = stored(worker, response_id)
    assert body["status"] == "failed"
    assert body["error"]["code"] == "server_error"
    assert "tried 2 times" in body["error"]["message"]
    assert events(worker) == [("response.failed", response_id)]


def test_a_response_past_the_spend_limit_fails_and_holds_nothing(make_batch_worker):
    prices = {"tiny": {"input": 1.0, "output": 1.0}}
    worker = make_batch_worker(prices=prices, key_monthly_spend_limit_usd=0.0001)
    response_id = submit(worker, max_output_tokens=LONG)  # its worst case is past the limit

    run_response(worker.ctx, response_id)

    body = stored(worker, response_id)
    assert body["status"] == "failed"
    assert "monthly spend limit" in body["error"]["message"]
    with worker.ctx.session_factory() as session:
        assert session.scalars(select(SpendReservation)).all() == []
        assert session.scalars(select(UsageRecord)).all() == []

    # Within the limit, its cost is what it used, settled with its end.
    cheap = submit(worker)
    run_response(worker.ctx, cheap)
    assert stored(worker, cheap)["status"] == "incomplete"
    with worker.ctx.session_factory() as session:
        assert session.scalars(select(SpendReservation)).all() == []
        assert len(session.scalars(select(UsageRecord)).all()) == 1


def test_a_worker_shutting_down_hands_its_response_back(make_batch_worker):
    worker = make_batch_worker()
    response_id = submit(worker, max_output_tokens=LONG)
    running = run_in_thread(worker, response_id)
    eventually(lambda: engine_holds(worker) == 1, timeout=10)

    worker.ctx.stopping.set()
    running.join(timeout=10)

    assert not running.is_alive()
    eventually(lambda: engine_holds(worker) == 0, timeout=1)
    handed_back = row(worker, response_id)
    assert (handed_back.status, handed_back.lease_owner, handed_back.attempts) == (
        "in_progress",
        None,
        0,
    )
    eventually(lambda: worker.queued == [("run_response", (response_id,))])
    assert handed_back.queued_at is not None and handed_back.queued_at > now() - 60

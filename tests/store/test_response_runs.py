"""Background responses' runs on SQLite and PostgreSQL: one worker at a time holds a response, its
end is written only under its lease, and responses whose task or run was lost are found again."""

from __future__ import annotations

import time

from sqlalchemy import select, update

from pagedbatch.ids import now
from pagedbatch.store.db import transaction
from pagedbatch.store.models import ResponseStatus, StoredResponse, WebhookEvent
from pagedbatch.store.response_runs import (
    claim,
    hand_back,
    held_by,
    look,
    lost_runs,
    mark_queued,
)
from pagedbatch.store.responses import ResponseRecord, finish_response, save_response, transition

LEASE = 30.0


def queued(sessions, blobs, response_id: str, background: bool = True, created_at=None) -> None:
    body = {"id": response_id, "object": "response", "status": "queued", "output": []}
    items = [{"id": "msg_1", "type": "message", "role": "user", "content": "Hi"}]
    record = ResponseRecord(
        id=response_id,
        owner="default",
        model="tiny",
        created_at=now() if created_at is None else created_at,
        request={"model": "tiny", "input": items, "background": background},
        input_items=items,
        body=body,
        background=background,
    )
    save_response(sessions, blobs, record, retention_days=30)


def row(sessions, response_id: str) -> StoredResponse:
    with sessions() as session:
        return session.get(StoredResponse, response_id)


def completed(response_id: str) -> dict:
    return {"id": response_id, "object": "response", "status": "completed", "output": []}


def test_one_worker_at_a_time_holds_a_response_and_only_it_ends_it(sessions, blobs):
    queued(sessions, blobs, "resp_a")

    first = claim(sessions, "resp_a", "w1", LEASE)
    assert first is not None and first.attempts == 1
    assert claim(sessions, "resp_a", "w2", LEASE) is None  # leased to w1
    assert row(sessions, "resp_a").status == "in_progress"
    assert look(sessions, "resp_a", "w1", LEASE).renewed
    assert not look(sessions, "resp_a", "w2", LEASE).renewed

    # w2 cannot end it; w1 does, once, with its event.
    assert not finish_response(sessions, blobs, "resp_a", completed("resp_a"), held_by("w2"))
    assert row(sessions, "resp_a").status == "in_progress"
    assert finish_response(sessions, blobs, "resp_a", completed("resp_a"), held_by("w1"))
    assert row(sessions, "resp_a").status == "completed"
    assert claim(sessions, "resp_a", "w2", LEASE) is None  # ended: nothing to run
    with sessions() as session:
        events = session.scalars(select(WebhookEvent.type)).all()
    assert events == ["response.completed"]


def test_a_lapsed_lease_lets_another_worker_take_over(sessions, blobs):
    queued(sessions, blobs, "resp_a")
    assert claim(sessions, "resp_a", "w1", LEASE) is not None
    with transaction(sessions) as session:
        session.execute(update(StoredResponse).values(lease_expires_at=time.time() - 1))

    taken = claim(sessions, "resp_a", "w2", LEASE)
    assert taken is not None and taken.attempts == 2
    assert not look(sessions, "resp_a", "w1", LEASE).renewed  # w1 sees it lost the lease
    assert not finish_response(sessions, blobs, "resp_a", completed("resp_a"), held_by("w1"))
    assert finish_response(sessions, blobs, "resp_a", completed("resp_a"), held_by("w2"))


def test_a_cancelled_response_is_seen_stopped_and_never_claimed(sessions, blobs):
    queued(sessions, blobs, "resp_a")
    assert claim(sessions, "resp_a", "w1", LEASE) is not None
    with transaction(sessions) as session:
        assert transition(session, "resp_a", ResponseStatus.CANCELLED)

    assert look(sessions, "resp_a", "w1", None).running is False
    assert not finish_response(sessions, blobs, "resp_a", completed("resp_a"), held_by("w1"))
    assert row(sessions, "resp_a").status == "cancelled"


def test_a_handed_back_response_is_claimed_again_without_counting_an_attempt(sessions, blobs):
    queued(sessions, blobs, "resp_a")
    assert claim(sessions, "resp_a", "w1", LEASE) is not None
    hand_back(sessions, "resp_a", "w1")

    again = claim(sessions, "resp_a", "w2", LEASE)
    assert again is not None and again.attempts == 1
    assert row(sessions, "resp_a").status == "in_progress"


def test_lost_runs_are_found_once_each_and_only_those(sessions, blobs):
    old = now() - 100
    queued(sessions, blobs, "resp_lost_task", created_at=old)  # its task never started
    queued(sessions, blobs, "resp_waiting")  # queued just now: its task is on its way
    queued(sessions, blobs, "resp_dead_worker", created_at=old)
    queued(sessions, blobs, "resp_live", created_at=old)
    queued(sessions, blobs, "resp_foreground", background=False, created_at=old)
    claim(sessions, "resp_dead_worker", "dead", LEASE)
    claim(sessions, "resp_live", "alive", LEASE)
    with transaction(sessions) as session:
        session.execute(
            update(StoredResponse)
            .where(StoredResponse.id == "resp_dead_worker")
            .values(lease_expires_at=time.time() - 1)
        )
    cutoff = time.time() - 50

    assert sorted(lost_runs(sessions, cutoff, None, 100)) == ["resp_dead_worker", "resp_lost_task"]
    # Noted as queued just now: the next round leaves them to the tasks it queued.
    assert lost_runs(sessions, cutoff, None, 100) == []
    assert row(sessions, "resp_dead_worker").lease_owner is None
    assert claim(sessions, "resp_dead_worker", "w2", LEASE) is not None
    assert row(sessions, "resp_live").lease_owner == "alive"

    # A response is queued again only once its newest task is older than the cutoff.
    mark_queued(sessions, ["resp_waiting"])
    assert lost_runs(sessions, cutoff, None, 100) == []
    later = time.time() + 1
    assert sorted(lost_runs(sessions, later, None, 100)) == ["resp_lost_task", "resp_waiting"]

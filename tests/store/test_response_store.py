"""Stored responses on SQLite and PostgreSQL: per tenant, until they expire, large documents in the
blob store, conversations along previous_response_id, and the background state machine."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.ids import now
from pagedbatch.store.blobs import LocalBlobStore
from pagedbatch.store.db import transaction
from pagedbatch.store.models import (
    ResponseStatus,
    StoredResponse,
    WebhookEndpoint,
    WebhookEvent,
    WebhookMessage,
)
from pagedbatch.store.responses import (
    INLINE_BYTES,
    ItemNotFound,
    ResponseNotFinished,
    ResponseNotFound,
    ResponseRecord,
    conversation,
    delete_response,
    finish_response,
    get_response,
    list_input_items,
    load_response,
    save_response,
    transition,
)

DAY = 24 * 3600


def message(item_id: str, role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {
        "id": item_id,
        "type": "message",
        "role": role,
        "content": [{"type": kind, "text": text}],
    }


def record(
    response_id: str,
    *,
    owner: str = "default",
    status: str = "completed",
    input_items: list[dict[str, Any]] | None = None,
    output: list[dict[str, Any]] | None = None,
    created_at: int | None = None,
    previous: str | None = None,
    background: bool = False,
) -> ResponseRecord:
    inputs = (
        input_items if input_items is not None else [message(f"in_{response_id}", "user", "Hi")]
    )
    body = {
        "id": response_id,
        "object": "response",
        "status": status,
        "model": "tiny",
        "output": output
        if output is not None
        else [message(f"out_{response_id}", "assistant", "Yo")],
        "previous_response_id": previous,
    }
    return ResponseRecord(
        id=response_id,
        owner=owner,
        model="tiny",
        created_at=now() if created_at is None else created_at,
        request={"model": "tiny", "input": inputs, "instructions": "Be brief."},
        input_items=inputs,
        body=body,
        background=background,
        previous_response_id=previous,
    )


def get(
    sessions: sessionmaker[Session], blobs: LocalBlobStore, response_id: str, owner: str = "default"
) -> dict:
    with sessions() as session:
        return get_response(session, blobs, owner, response_id)


def test_a_saved_response_is_its_owners_until_it_expires(sessions, blobs):
    save_response(sessions, blobs, record("resp_a"), retention_days=30)
    save_response(sessions, blobs, record("resp_old", created_at=now() - 31 * DAY), 30)
    save_response(sessions, blobs, record("resp_kept", created_at=now() - 999 * DAY), 0)

    assert get(sessions, blobs, "resp_a")["output"][0]["content"][0]["text"] == "Yo"
    assert get(sessions, blobs, "resp_kept")["id"] == "resp_kept"  # retention 0: for good
    for response_id, owner in [
        ("resp_a", "key_other"),
        ("resp_old", "default"),
        ("resp_x", "default"),
    ]:
        with pytest.raises(ResponseNotFound):
            get(sessions, blobs, response_id, owner)
    with sessions() as session:
        expiry = dict(session.execute(select(StoredResponse.id, StoredResponse.expires_at)).all())
        # The request is kept less its input, which the input items hold.
        assert session.get(StoredResponse, "resp_a").request == {
            "model": "tiny",
            "instructions": "Be brief.",
        }
    assert expiry["resp_kept"] is None
    assert expiry["resp_a"] - now() in range(30 * DAY - 5, 30 * DAY + 1)


def test_large_documents_live_in_the_blob_store_and_go_with_their_response(
    sessions, blobs, tmp_path
):
    image = {"type": "input_image", "image_url": "data:image/png;base64," + "A" * INLINE_BYTES}
    large = [{"id": "msg_big", "type": "message", "role": "user", "content": [image]}]
    save_response(sessions, blobs, record("resp_big", input_items=large), 30)

    with sessions() as session:
        row = session.get(StoredResponse, "resp_big")
        assert row.input_items is None and row.response is not None  # only the large one moved
        (key,) = row.blob_keys.values()
        page = list_input_items(session, blobs, "default", "resp_big", limit=20)
        assert page.items == large
        assert load_response(session, blobs, "resp_big").request["input"] == large
    assert blobs.exists(key)

    with pytest.raises(ResponseNotFound):  # another tenant deletes nothing
        delete_response(sessions, blobs, "key_other", "resp_big")
    delete_response(sessions, blobs, "default", "resp_big")

    assert not blobs.exists(key)
    with pytest.raises(ResponseNotFound):
        get(sessions, blobs, "resp_big")
    with pytest.raises(ResponseNotFound):
        delete_response(sessions, blobs, "default", "resp_big")


def test_input_items_are_listed_in_pages_either_way(sessions, blobs):
    items = [message(f"msg_{i}", "user", str(i)) for i in range(5)]
    save_response(sessions, blobs, record("resp_a", input_items=items), 30)

    def ids(limit: int, order: str = "desc", after: str | None = None) -> tuple[list[str], bool]:
        with sessions() as session:
            page = list_input_items(session, blobs, "default", "resp_a", limit, order, after)
        return [item["id"] for item in page.items], page.has_more

    assert ids(2) == (["msg_4", "msg_3"], True)  # OpenAI's default order: the last first
    assert ids(2, after="msg_3") == (["msg_2", "msg_1"], True)
    assert ids(2, after="msg_1") == (["msg_0"], False)
    assert ids(3, "asc", "msg_1") == (["msg_2", "msg_3", "msg_4"], False)
    assert ids(100, "asc") == ([f"msg_{i}" for i in range(5)], False)
    with pytest.raises(ItemNotFound):
        ids(2, after="msg_nope")
    with sessions() as session, pytest.raises(ResponseNotFound):
        list_input_items(session, blobs, "key_other", "resp_a", 20)


def test_a_conversation_is_the_chain_of_previous_responses_oldest_first(sessions, blobs):
    save_response(sessions, blobs, record("resp_1"), 30)
    save_response(sessions, blobs, record("resp_2", previous="resp_1"), 30)
    save_response(sessions, blobs, record("resp_3", previous="resp_2"), 30)
    save_response(sessions, blobs, record("resp_q", status="queued", background=True), 30)

    def chain(response_id: str, owner: str = "default") -> list[str]:
        with sessions() as session:
            read = conversation(session, blobs, owner, response_id, 100, 2**20)
            assert read.whole
            return [item["id"] for item in read.items]

    assert chain("resp_3") == [
        "in_resp_1",
        "out_resp_1",
        "in_resp_2",
        "out_resp_2",
        "in_resp_3",
        "out_resp_3",
    ]
    assert chain("resp_1") == ["in_resp_1", "out_resp_1"]
    with pytest.raises(ResponseNotFound):
        chain("resp_3", owner="key_other")
    with pytest.raises(ResponseNotFinished):
        chain("resp_q")

    # An earlier response that is gone ends the chain; the one named must be there.
    delete_response(sessions, blobs, "default", "resp_1")
    assert chain("resp_3") == ["in_resp_2", "out_resp_2", "in_resp_3", "out_resp_3"]
    with pytest.raises(ResponseNotFound):
        chain("resp_1")


def test_a_conversation_is_read_newest_first_no_further_than_its_bounds(sessions, blobs):
    big = [message("in_resp_2", "user", "x" * 100_000)]  # its input items go to a blob
    save_response(sessions, blobs, record("resp_1"), 30)
    save_response(sessions, blobs, record("resp_2", previous="resp_1", input_items=big), 30)
    save_response(sessions, blobs, record("resp_3", previous="resp_2"), 30)

    def read(max_turns: int, max_bytes: int) -> tuple[list[str], bool]:
        with sessions() as session:
            found = conversation(session, blobs, "default", "resp_3", max_turns, max_bytes)
        return [item["id"] for item in found.items], found.whole

    everything = ["in_resp_1", "out_resp_1", "in_resp_2", "out_resp_2", "in_resp_3", "out_resp_3"]
    assert read(3, 2**20) == (everything, True)
    assert read(2, 2**20) == (everything[2:], False)
    assert read(1, 2**20) == (everything[4:], False)
    # The large turn's blob counts as stored, read or not: past the bytes, it and all before go.
    assert read(3, 50_000) == (everything[4:], False)
    assert read(3, 150_000) == (everything, True)
    assert read(3, 10) == ([], False)


def events(sessions: sessionmaker[Session]) -> list[tuple[str, str | None, int]]:
    """Each event's type and response, and how many messages it queued."""
    with sessions() as session:
        rows = session.scalars(select(WebhookEvent).order_by(WebhookEvent.type)).all()
        return [
            (
                event.type,
                event.response_id,
                len(
                    session.scalars(
                        select(WebhookMessage).where(WebhookMessage.event_id == event.id)
                    ).all()
                ),
            )
            for event in rows
        ]


def test_a_background_response_moves_by_compare_and_set_and_records_its_end(sessions, blobs):
    with transaction(sessions) as session:
        session.add(WebhookEndpoint(id="we_1", owner="default", url="https://x", secret="s"))
    save_response(
        sessions, blobs, record("resp_bg", status="queued", output=[], background=True), 30
    )
    assert get(sessions, blobs, "resp_bg")["status"] == "queued"

    with transaction(sessions) as session:
        assert not transition(session, "resp_bg", ResponseStatus.COMPLETED)  # not from queued
        assert transition(session, "resp_bg", ResponseStatus.IN_PROGRESS)
        assert not transition(session, "resp_bg", ResponseStatus.IN_PROGRESS)
    assert get(sessions, blobs, "resp_bg")["status"] == "in_progress"  # the row's status

    done = record("resp_bg").body
    assert finish_response(sessions, blobs, "resp_bg", done)
    assert get(sessions, blobs, "resp_bg") == done
    with transaction(sessions) as session:
        assert not transition(session, "resp_bg", ResponseStatus.CANCELLED)  # it has ended
    assert events(sessions) == [("response.completed", "resp_bg", 1)]


def test_a_cancelled_response_keeps_its_placeholder_when_its_run_ends_after_all(sessions, blobs):
    save_response(
        sessions, blobs, record("resp_c", status="queued", output=[], background=True), 30
    )
    with transaction(sessions) as session:
        assert transition(session, "resp_c", ResponseStatus.IN_PROGRESS)
        assert transition(session, "resp_c", ResponseStatus.CANCELLED)

    # The run's result, large enough for a blob, loses the race: nothing of it is kept.
    late = record("resp_c", output=[message("msg_long", "assistant", "x" * INLINE_BYTES)]).body
    assert not finish_response(sessions, blobs, "resp_c", late)

    body = get(sessions, blobs, "resp_c")
    assert (body["status"], body["output"]) == ("cancelled", [])
    assert not list((blobs.root / "responses").rglob("*.json"))
    assert events(sessions) == [("response.cancelled", "resp_c", 0)]


def test_a_large_result_replaces_the_placeholder_and_a_failure_records_its_error(sessions, blobs):
    save_response(
        sessions, blobs, record("resp_l", status="queued", output=[], background=True), 30
    )
    save_response(
        sessions, blobs, record("resp_f", status="queued", output=[], background=True), 30
    )
    with transaction(sessions) as session:
        assert transition(session, "resp_l", ResponseStatus.IN_PROGRESS)

    long = record("resp_l", output=[message("msg_long", "assistant", "x" * INLINE_BYTES)]).body
    assert finish_response(sessions, blobs, "resp_l", long)
    failed = {
        **record("resp_f", status="failed", output=[]).body,
        "error": {"code": "server_error", "message": "boom"},
    }
    assert finish_response(sessions, blobs, "resp_f", failed)  # it could not start

    assert get(sessions, blobs, "resp_l") == long
    assert len(list((blobs.root / "responses").rglob("*.json"))) == 1
    with sessions() as session:
        assert session.get(StoredResponse, "resp_f").error == failed["error"]
    assert [event[0] for event in events(sessions)] == ["response.completed", "response.failed"]

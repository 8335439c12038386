"""Stored responses through the unmodified `openai` SDK against the embedded service: retrieve,
input items in pages, delete, each tenant's own; `store=False` keeps nothing; a streamed response
is kept too; and `previous_response_id` continues a conversation, which the model sees as if it
had been sent whole."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from servers import API_KEYS
from test_response_endpoint import WEATHER

from pagedbatch.api.auth import key_owner
from pagedbatch.ids import now
from pagedbatch.store.responses import ResponseRecord, save_response

GREEDY = {"model": "tiny", "temperature": 0, "max_output_tokens": 16}
TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on"}]},
]


def not_found(call: Any, param: str = "response_id") -> str:
    with pytest.raises(openai.NotFoundError) as caught:
        call()
    assert caught.value.body["param"] == param
    return caught.value.body["message"]


def test_a_stored_response_is_its_tenants_to_retrieve_list_and_delete(serve_batches):
    server = serve_batches(api_keys=API_KEYS)
    mine, theirs = server.client(API_KEYS[0]), server.client(API_KEYS[1])
    created = mine.responses.create(input=TURNS, **GREEDY)

    assert mine.responses.retrieve(created.id) == created
    items = list(mine.responses.input_items.list(created.id, limit=2))  # pages of 2
    assert [item.role for item in items] == ["user", "assistant", "user"][::-1]
    assert items[0].content[0].text == "Go on"
    assert all(item.id for item in items) and len({item.id for item in items}) == 3
    first = mine.responses.input_items.list(created.id, limit=2, order="asc")
    assert [item.id for item in first.data] == [item.id for item in items[::-1][:2]]
    assert first.has_more and first.first_id == items[-1].id
    with pytest.raises(openai.BadRequestError) as caught:
        mine.responses.input_items.list(created.id, after="msg_nope")
    assert caught.value.body["param"] == "after"

    # Another tenant's id is as missing as one that never was, everywhere.
    assert not_found(lambda: theirs.responses.retrieve(created.id)) == (
        f"Response with id '{created.id}' not found."
    )
    not_found(lambda: theirs.responses.input_items.list(created.id))
    not_found(lambda: theirs.responses.delete(created.id))
    assert "Previous response with id" in not_found(
        lambda: theirs.responses.create(input="Hi", previous_response_id=created.id, **GREEDY),
        param="previous_response_id",
    )

    # A conversation continues only from a response that has ended.
    services = server.embedded.services
    queued = ResponseRecord(
        id="resp_queued",
        owner=key_owner(API_KEYS[0]),
        model="tiny",
        created_at=now(),
        request={"model": "tiny"},
        input_items=[],
        body={"id": "resp_queued", "status": "queued", "output": []},
        background=True,
    )
    save_response(services.session_factory, services.blobs, queued, retention_days=1)
    with pytest.raises(openai.BadRequestError) as caught:
        mine.responses.create(input="Hi", previous_response_id="resp_queued", **GREEDY)
    assert caught.value.body["param"] == "previous_response_id"
    assert "is still queued" in caught.value.body["message"]

    unstored = mine.responses.create(input="Hi", store=False, **GREEDY)
    assert unstored.store is False
    not_found(lambda: mine.responses.retrieve(unstored.id))

    with server.http(API_KEYS[0]) as http:
        deleted = http.delete(f"/v1/responses/{created.id}")
    assert deleted.json() == {"id": created.id, "object": "response", "deleted": True}
    not_found(lambda: mine.responses.retrieve(created.id))
    not_found(lambda: mine.responses.delete(created.id))
    not_found(
        lambda: mine.responses.create(input="Hi", previous_response_id=created.id, **GREEDY),
        param="previous_response_id",
    )


def test_previous_response_id_continues_the_conversation_the_model_sees_whole(serve_batches):
    client = serve_batches().client()
    # A streamed response is stored as its last event tells it.
    events = list(
        client.responses.create(
            input="Tell me a story.", instructions="Be brief.", stream=True, **GREEDY
        )
    )
    first = events[-1].response
    assert client.responses.retrieve(first.id) == first
    second = client.responses.create(input="More.", previous_response_id=first.id, **GREEDY)
    third = client.responses.create(input=TURNS, previous_response_id=second.id, **GREEDY)

    # Greedy decoding: the same text and prompt as the conversation sent in full. Instructions
    # are not carried over, as OpenAI's are not.
    whole = client.responses.create(
        input=[
            {"role": "user", "content": "Tell me a story."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "More."},
            {"role": "assistant", "content": second.output_text},
            *TURNS,
        ],
        **GREEDY,
    )
    assert third.previous_response_id == second.id
    assert third.output_text == whole.output_text
    assert third.usage.input_tokens == whole.usage.input_tokens
    # Its input items are its own, not the conversation's.
    assert len(client.responses.input_items.list(third.id).data) == len(TURNS)

    # A tool's output answers the call of the response it continues.
    called = client.responses.create(
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        **GREEDY | {"max_output_tokens": 64},
    )
    (call,) = called.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}
    answered = client.responses.create(
        input=[result], previous_response_id=called.id, tools=[WEATHER], **GREEDY
    )
    sent_whole = client.responses.create(
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            call.model_dump(exclude_none=True),
            result,
        ],
        tools=[WEATHER],
        **GREEDY,
    )
    assert answered.output_text == sent_whole.output_text
    assert answered.usage.input_tokens == sent_whole.usage.input_tokens


def test_a_conversation_past_what_one_request_reads_needs_truncation_auto(serve_batches):
    client = serve_batches(response_history_max_turns=2).client()
    first = client.responses.create(input="One.", **GREEDY)
    second = client.responses.create(input="Two.", previous_response_id=first.id, **GREEDY)
    third = client.responses.create(input="Three.", previous_response_id=second.id, **GREEDY)

    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(input="Four.", previous_response_id=third.id, **GREEDY)
    assert caught.value.body["param"] == "previous_response_id"
    assert caught.value.body["code"] == "context_length_exceeded"
    assert "PAGEDBATCH_RESPONSE_HISTORY_MAX_TURNS" in caught.value.body["message"]

    # Under auto, the turns past the bound are dropped, as older turns past the context are:
    # the model sees the last two, as if they had been sent whole.
    fourth = client.responses.create(
        input="Four.", previous_response_id=third.id, truncation="auto", **GREEDY
    )
    whole = client.responses.create(
        input=[
            {"role": "user", "content": "Two."},
            {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "Three."},
            {"role": "assistant", "content": third.output_text},
            {"role": "user", "content": "Four."},
        ],
        **GREEDY,
    )
    assert fourth.output_text == whole.output_text
    assert fourth.usage.input_tokens == whole.usage.input_tokens


def test_a_conversation_whose_newest_turn_is_past_the_bytes_starts_afresh_under_auto(
    serve_batches,
):
    client = serve_batches(response_history_max_bytes=1024).client()
    first = client.responses.create(input="word " * 400, **GREEDY)  # over 1 KiB stored

    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(input="Next.", previous_response_id=first.id, **GREEDY)
    assert caught.value.body["code"] == "context_length_exceeded"
    # Under auto every earlier turn is dropped: the model sees the new input alone.
    alone = client.responses.create(
        input="Next.", previous_response_id=first.id, truncation="auto", **GREEDY
    )
    fresh = client.responses.create(input="Next.", **GREEDY)
    assert alone.output_text == fresh.output_text
    assert alone.usage.input_tokens == fresh.usage.input_tokens

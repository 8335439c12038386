"""`Idempotency-Key` (api/idempotency.py): the same request again gets the first resource; the key
reused for a different request is a 422 `idempotency_key_reused`, and that request loses nothing
silently: nothing of it is stored, and the first resource is unchanged."""

from __future__ import annotations

import json

import openai
import pytest
from servers import Server
from sqlalchemy import update

from pagedbatch.store.db import make_engine, make_session_factory, transaction
from pagedbatch.store.models import IdempotencyKey

LINE = {
    "custom_id": "a",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]},
}


def upload(client: openai.OpenAI, data: bytes, key: str, name: str = "in.jsonl", **extra):
    return client.files.create(
        file=(name, data), purpose="batch", extra_headers={"Idempotency-Key": key}, **extra
    )


def assert_reused(caught: pytest.ExceptionInfo[openai.UnprocessableEntityError]) -> None:
    assert caught.value.status_code == 422
    assert caught.value.code == "idempotency_key_reused"
    assert caught.value.param == "idempotency-key"


def test_an_upload_again_under_its_key_gets_the_first_file_and_stores_nothing_more(server):
    client = server.client()
    first = upload(client, b"{}\n", "k")
    assert upload(client, b"{}\n", "k") == first
    assert len(server.blob_keys()) == 1


def test_a_key_reused_for_another_upload_is_refused_and_stores_nothing(server):
    client = server.client()
    first = upload(client, b'{"a": 1}\n', "k")
    for data, name, extra in [
        (b'{"a": 2}\n', "in.jsonl", {}),  # another file under the same name
        (b'{"a": 1}\n', "other.jsonl", {}),
        (b'{"a": 1}\n', "in.jsonl", {"expires_after": {"anchor": "created_at", "seconds": 3600}}),
    ]:
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            upload(client, data, "k", name, **extra)
        assert_reused(caught)
        assert first.id in caught.value.message
    assert [f.id for f in client.files.list()] == [first.id]
    assert len(server.blob_keys()) == 1
    assert client.files.content(first.id).read() == b'{"a": 1}\n'


def test_keys_stored_before_fingerprints_match_any_request(server: Server):
    client = server.client()
    first = upload(client, b"{}\n", "old")
    factory = make_session_factory(make_engine(server.settings.resolved_database_url))
    with transaction(factory) as session:
        session.execute(update(IdempotencyKey).values(fingerprint=None))
    assert upload(client, b"[]\n", "old") == first


def test_a_key_reused_for_another_batch_is_refused(serve_batches):
    client = serve_batches().client()
    file_id = client.files.create(file=("in.jsonl", json.dumps(LINE).encode()), purpose="batch").id
    headers = {"Idempotency-Key": "nightly"}
    params = {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    first = client.batches.create(**params, metadata={"run": "1"}, extra_headers=headers)
    again = client.batches.create(**params, metadata={"run": "1"}, extra_headers=headers)
    assert again.id == first.id
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.batches.create(**params, metadata={"run": "2"}, extra_headers=headers)
    assert_reused(caught)
    assert [b.id for b in client.batches.list()] == [first.id]

"""API keys: who may call, and that each key sees only its own rows."""

from __future__ import annotations

import openai
import pytest
from sqlalchemy import select

from pagedbatch.api.auth import key_owner
from pagedbatch.store.db import make_engine
from pagedbatch.store.models import DEFAULT_OWNER, File

ERROR_FIELDS = {"message", "type", "param", "code"}


def upload(client: openai.OpenAI, **options) -> openai.types.FileObject:
    return client.files.create(file=("requests.jsonl", b"{}\n"), purpose="batch", **options)


def owners(server) -> set[str]:
    engine = make_engine(server.settings.resolved_database_url)
    try:
        with engine.connect() as conn:
            return set(conn.scalars(select(File.owner)))
    finally:
        engine.dispose()


@pytest.mark.parametrize("path", ["/v1/files", "/v1/models", "/v1/files/file-x/content"])
def test_a_call_without_a_key_is_a_401(auth_server, path):
    with auth_server.http() as http:
        response = http.get(path)
    assert response.status_code == 401
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    assert response.headers["x-request-id"]


def test_a_wrong_key_raises_authentication_error(auth_server):
    with pytest.raises(openai.AuthenticationError) as caught:
        auth_server.client("k3").files.list()
    assert caught.value.code == "invalid_api_key"


def test_health_needs_no_key(auth_server):
    with auth_server.http() as http:
        assert http.get("/health").json() == {"status": "ok"}


def test_a_key_sees_only_its_own_files(auth_server):
    mine, theirs = auth_server.client("k1"), auth_server.client("k2")
    file = upload(mine)

    for call in (theirs.files.retrieve, theirs.files.content, theirs.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(file.id)
    assert list(theirs.files.list()) == []
    with pytest.raises(openai.BadRequestError):  # not even as a cursor
        theirs.files.list(after=file.id)

    assert mine.files.retrieve(file.id) == file
    assert [f.id for f in mine.files.list()] == [file.id]


def test_idempotency_keys_are_per_key(auth_server):
    first = upload(auth_server.client("k1"), extra_headers={"Idempotency-Key": "same"})
    second = upload(auth_server.client("k2"), extra_headers={"Idempotency-Key": "same"})
    assert first.id != second.id


def test_rows_record_a_hash_of_the_key_not_the_key(auth_server):
    upload(auth_server.client("k1"))
    assert owners(auth_server) == {key_owner("k1")}
    assert key_owner("k1").startswith("key_")
    assert key_owner("k1") != key_owner("k2")


def test_without_keys_every_caller_is_the_default_tenant(server):
    file = upload(server.client("anything"))
    assert server.client("something-else").files.retrieve(file.id) == file
    with server.http() as http:
        assert http.get(f"/v1/files/{file.id}").status_code == 200
    assert owners(server) == {DEFAULT_OWNER}

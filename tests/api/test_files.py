"""The Files API, through the official SDK, on embedded and distributed storage."""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from pagedbatch.store.blobs import PART_SIZE

pytestmark = pytest.mark.parametrize("storage", ["embedded", "distributed"], indirect=True)

MiB = 1 << 20
DAY = 24 * 3600
FILE_FIELDS = {
    "id",
    "object",
    "bytes",
    "created_at",
    "filename",
    "purpose",
    "status",
    "expires_at",
    "status_details",
}
REQUESTS = b"".join(
    b'{"custom_id": "r%d", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n' % i
    for i in range(3)
)


def upload(
    client: openai.OpenAI, data: bytes = REQUESTS, name: str = "requests.jsonl", **options
) -> openai.types.FileObject:
    options.setdefault("purpose", "batch")
    return client.files.create(file=(name, data), **options)


def multipart(*parts: tuple[str, str | None, bytes]) -> tuple[dict[str, str], bytes]:
    """Headers and body of a form with `(name, filename, content)` parts, in the order given."""
    boundary = "pagedbatch-test-boundary"
    body = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
        body += content + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    return {"content-type": f"multipart/form-data; boundary={boundary}"}, body


def test_upload_returns_a_file_object_with_every_field(server):
    before = int(time.time())
    response = server.client().files.with_raw_response.create(
        file=("requests.jsonl", REQUESTS), purpose="batch"
    )
    assert set(response.http_response.json()) == FILE_FIELDS
    assert response.headers["x-request-id"].startswith("req_")
    file = response.parse()
    assert file.id.startswith("file-")
    assert file.object == "file"
    assert file.bytes == len(REQUESTS)
    assert file.filename == "requests.jsonl"
    assert file.purpose == "batch"
    assert file.status == "processed"
    assert file.status_details is None
    assert before <= file.created_at <= time.time()


def test_batch_files_expire_after_30_days_and_others_never(server):
    client = server.client()
    batch = upload(client)
    assert batch.expires_at == batch.created_at + 30 * DAY
    assert upload(client, name="notes.txt", purpose="user_data").expires_at is None


def test_expires_after_sets_the_expiry(server):
    client = server.client()
    file = upload(client, expires_after={"anchor": "created_at", "seconds": 3600})
    assert file.expires_at == file.created_at + 3600
    file = upload(
        client, purpose="user_data", expires_after={"anchor": "created_at", "seconds": 7200}
    )
    assert file.expires_at == file.created_at + 7200


def test_retrieve_returns_the_uploaded_file(server):
    client = server.client()
    file = upload(client)
    assert client.files.retrieve(file.id) == file


def test_content_is_the_upload_byte_for_byte(server):
    client = server.client()
    # Every byte value, line breaks, and text that looks like a multipart boundary, spread over
    # several chunks of the upload stream and of storage.
    pattern = bytes(range(256)) + b"\r\n--pagedbatch\r\n--\r\n\r\n"
    data = pattern * (3 * MiB // len(pattern) + 7)
    file = upload(client, data=data, name="blob.bin", purpose="user_data")
    assert file.bytes == len(data)
    assert client.files.content(file.id).read() == data


def test_an_empty_file_is_stored_empty(server):
    client = server.client()
    file = upload(client, data=b"", name="empty.txt", purpose="user_data")
    assert file.bytes == 0
    assert client.files.content(file.id).read() == b""


def test_list_pages_through_every_file_newest_first(server):
    client = server.client()
    files = [upload(client) for _ in range(5)]
    # created_at has one-second resolution; ties are ordered by id.
    newest_first = [f.id for f in sorted(files, key=lambda f: (f.created_at, f.id), reverse=True)]

    first_page = client.files.list(limit=2)
    assert [f.id for f in first_page.data] == newest_first[:2]
    assert first_page.has_more
    assert [f.id for f in first_page] == newest_first  # the SDK follows `after` to the end
    assert [f.id for f in client.files.list(limit=2, order="asc")] == newest_first[::-1]

    page = client.files.list(limit=2, after=newest_first[1])
    assert [f.id for f in page.data] == newest_first[2:4]
    assert page.has_more
    last = client.files.list(limit=2, after=newest_first[3])
    assert [f.id for f in last.data] == newest_first[4:]
    assert not last.has_more


def test_list_returns_full_file_objects_and_the_envelope(server):
    file = upload(server.client())
    with server.http() as http:
        body = http.get("/v1/files").json()
    assert body == {
        "object": "list",
        "data": [file.model_dump()],
        "first_id": file.id,
        "last_id": file.id,
        "has_more": False,
    }


def test_list_filters_by_purpose(server):
    client = server.client()
    batch = upload(client)
    upload(client, name="notes.txt", purpose="user_data")
    assert [f.id for f in client.files.list(purpose="batch")] == [batch.id]


@pytest.mark.parametrize(
    ("query", "param"),
    [({"limit": 0}, "limit"), ({"limit": 10_001}, "limit"), ({"order": "newest"}, "order")],
)
def test_list_refuses_bad_parameters(server, query, param):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().files.list(**query)
    assert caught.value.status_code == 400
    assert caught.value.param == param


def test_list_refuses_an_unknown_cursor(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().files.list(after="file-unknown")
    assert caught.value.param == "after"


def test_a_deleted_file_is_gone_with_its_bytes(server):
    client = server.client()
    file = upload(client)
    assert server.blob_keys() != []

    deleted = client.files.delete(file.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (file.id, "file", True)
    assert server.blob_keys() == []
    assert list(client.files.list()) == []
    for gone in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError) as caught:
            gone(file.id)
        assert caught.value.body == {
            "message": f"No such File object: {file.id}",
            "type": "invalid_request_error",
            "param": "file_id",
            "code": "not_found",
        }


def test_an_unknown_purpose_is_refused_and_nothing_is_stored(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        upload(client, purpose="training")
    assert caught.value.param == "purpose"
    assert caught.value.code == "invalid_value"
    assert list(client.files.list()) == []
    assert server.blob_keys() == []


@pytest.mark.parametrize("seconds", [3599, 2_592_001])
def test_an_expiry_out_of_range_is_refused(server, seconds):
    with pytest.raises(openai.BadRequestError) as caught:
        upload(server.client(), expires_after={"anchor": "created_at", "seconds": seconds})
    assert caught.value.param == "expires_after.seconds"
    assert server.blob_keys() == []


def test_a_batch_file_must_be_jsonl(server):
    with pytest.raises(openai.BadRequestError) as caught:
        upload(server.client(), name="requests.csv")
    assert (caught.value.param, caught.value.code) == ("file", "invalid_file_format")
    assert server.blob_keys() == []


def test_a_file_over_the_upload_limit_is_refused_and_nothing_is_stored(serve):
    server = serve(max_upload_bytes=1 * MiB)
    client = server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        upload(client, data=b"x" * (3 * MiB), name="big.bin", purpose="user_data")
    assert (caught.value.param, caught.value.code) == ("file", "file_too_large")
    assert list(client.files.list()) == []
    assert server.blob_keys() == []
    assert upload(client, data=b"x" * MiB, name="fits.bin", purpose="user_data").bytes == MiB


def test_batch_files_have_their_own_limit(serve):
    server = serve(max_batch_file_bytes=1 * MiB)
    client = server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        upload(client, data=b"{}\n" * MiB)
    assert caught.value.code == "file_too_large"
    assert server.blob_keys() == []
    assert upload(client, data=b"{}\n" * MiB, name="big.jsonl", purpose="user_data")


def test_a_purpose_sent_after_the_file_is_enforced_too(serve):
    server = serve(max_batch_file_bytes=1 * MiB)
    with server.http() as http:
        headers, body = multipart(("file", "big.jsonl", b"{}\n" * MiB), ("purpose", None, b"batch"))
        refused = http.post("/v1/files", headers=headers, content=body)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "file_too_large"
        assert server.blob_keys() == []

        headers, body = multipart(("file", "small.jsonl", REQUESTS), ("purpose", None, b"batch"))
        accepted = http.post("/v1/files", headers=headers, content=body)
        assert accepted.status_code == 200
        assert accepted.json()["purpose"] == "batch"


@pytest.mark.parametrize(
    ("parts", "param"),
    [
        ([("purpose", None, b"batch")], "file"),
        ([("file", "requests.jsonl", REQUESTS)], "purpose"),
    ],
)
def test_a_missing_field_is_named(server, parts, param):
    with server.http() as http:
        headers, body = multipart(*parts)
        response = http.post("/v1/files", headers=headers, content=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "missing_required_parameter")
    assert server.blob_keys() == []


def test_an_unknown_field_is_refused(server):
    with server.http() as http:
        headers, body = multipart(
            ("purpose", None, b"batch"), ("purpse", None, b"batch"), ("file", "a.jsonl", REQUESTS)
        )
        response = http.post("/v1/files", headers=headers, content=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "purpse"
    assert server.blob_keys() == []


def test_a_body_that_is_not_multipart_is_refused(server):
    with server.http() as http:
        response = http.post("/v1/files", json={"purpose": "batch"})
    assert response.status_code == 415  # api/web_guard.py
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_truncated_upload_stores_nothing(server):
    headers, body = multipart(("purpose", None, b"batch"), ("file", "a.jsonl", b"{}\n" * MiB))
    cut = body[: len(body) // 2]  # a complete request whose form stops mid-file
    with server.http() as http:
        response = http.post("/v1/files", headers=headers, content=cut)
    assert response.status_code == 400
    assert server.blob_keys() == []
    assert list(server.client().files.list()) == []


def test_a_retry_with_the_same_idempotency_key_returns_the_same_file(server):
    client = server.client()
    first = upload(client, extra_headers={"Idempotency-Key": "upload-1"})
    again = upload(client, extra_headers={"Idempotency-Key": "upload-1"})
    assert again == first
    assert [f.id for f in client.files.list()] == [first.id]
    assert len(server.blob_keys()) == 1
    other = upload(client, extra_headers={"Idempotency-Key": "upload-2"})
    assert other.id != first.id


def test_concurrent_retries_with_one_idempotency_key_store_one_file(server):
    client = server.client(timeout=120)
    data = b"{}\n" * MiB

    def attempt(_: int) -> str:
        return upload(client, data=data, extra_headers={"Idempotency-Key": "race"}).id

    with ThreadPoolExecutor(6) as pool:
        ids = set(pool.map(attempt, range(6)))
    assert len(ids) == 1
    assert [f.id for f in client.files.list()] == list(ids)
    assert len(server.blob_keys()) == 1


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def test_a_large_upload_and_download_keep_server_memory_flat(server_process, storage, tmp_path):
    # The server streams; what it may add for 100 MiB is a few MiB of its own, plus on S3 the
    # store's multipart parts in flight (about four of them, measured).
    limit = 40 * MiB if storage.kind == "embedded" else 40 * MiB + 4 * PART_SIZE
    client = server_process.server.client(timeout=300)
    upload(client)  # the first upload loads what every later one uses
    baseline = _peak_rss(server_process.pid)

    path = tmp_path / "large.jsonl"
    line = b'{"custom_id": "%08d", "body": {"prompt": "' + b"z" * 200 + b'"}}\n'
    with path.open("wb") as out:
        for i in range(100 * MiB // len(line)):
            out.write(line % i)
    with path.open("rb") as data:
        file = client.files.create(file=data, purpose="batch")
    assert file.bytes == path.stat().st_size

    digest = hashlib.sha256()
    with client.files.with_streaming_response.content(file.id) as response:
        for chunk in response.iter_bytes():
            digest.update(chunk)
    assert digest.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()

    growth = _peak_rss(server_process.pid) - baseline
    assert growth < limit, f"the server's peak RSS grew by {growth / MiB:.1f} MiB"
